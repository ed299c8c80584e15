"""`jaxllm prune SRC OUT --method M --sparsity S [--pattern N:M]`: a trained model's weights
pruned into a new run.

SRC is a run directory (or its checkpoints, or one step), a fine-tuning run (its adapters merged
into the base first) or a Hugging Face directory; OUT is a run like `jaxllm quantize` writes:
config.yaml (the source's, with `prune.*` recording the method), the tokenizer's files and a
weights-only checkpoint at step 0, ordinary float weights whose pruned values are exact zeros.
`generate`, `eval`, `convert export`, `quantize` and `load_model` read it like any run, and a
run that trains from it (`checkpoint.init_from`) keeps its zeros (`jaxllm.optim.keep_zeros`).

Every check runs before any weight is read: the method, sparsity and pattern (`prune.*`), the
pattern against each chosen weight's input channels, a quantized source, and OUT (which may
not hold files without --overwrite). OUT appears only when complete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

from jaxllm import config as config_lib
from jaxllm import sharding, storage
from jaxllm.compress import layers, slicegpt
from jaxllm.compress.calibrate import calibration_rows, sequential
from jaxllm.compress.prune import prune_params, prune_unit, sparsity_of
from jaxllm.compress.weights import chosen as weights_chosen
from jaxllm.config import Config, ConfigError
from jaxllm.config.prune import CALIBRATED, METHODS, STRUCTURED
from jaxllm.convert import load_params
from jaxllm.convert.hf import NewRun, check_out_dir, new_run
from jaxllm.load import _is_hf_source, fetched, resolve
from jaxllm.model import abstract_model, abstract_model_state
from jaxllm.quantize import (
    _out_config,
    _source_weights,
    _tokenizer_files,
    _with_tokenizer,
    calibration_options,
)

__all__ = [
    "options",
    "prune_run",
]


def options(
    method: str,
    sparsity: float | None,
    pattern: str | None,
    calibration: str | None = None,
    samples: int | None = None,
) -> list[str]:
    """The `prune.*` overrides of the command's options (`--method`, `--sparsity`, ...); a
    ConfigError names the parameter and its option."""
    if method not in METHODS:
        raise ConfigError(
            f"method (--method) {method} is not a pruning method jaxllm has; it has "
            f"{', '.join(METHODS)}."
        )
    if sparsity is not None and not 0 <= sparsity < 1:
        raise ConfigError(f"sparsity (--sparsity) {sparsity:g} is outside [0, 1).")
    out = [f"prune.method={method}"]
    if pattern:
        out.append(f"prune.pattern={json.dumps(pattern)}")
        n, _, m = pattern.partition(":")
        if sparsity is not None and n.isdigit() and m.isdigit() and int(m):
            if not math.isclose(sparsity, int(n) / int(m)):
                raise ConfigError(
                    f"pattern (--pattern) {pattern} zeroes {int(n) / int(m):g} of each weight; "
                    f"drop sparsity (--sparsity) {sparsity:g} or make it {int(n) / int(m):g}."
                )
    elif sparsity is None:
        raise ConfigError(
            "pruning needs a sparsity (--sparsity, a fraction in [0, 1)) or a pattern N:M "
            "(--pattern)."
        )
    if sparsity is not None:
        out.append(f"prune.sparsity={sparsity!r}")
    return out + calibration_options("prune", method, CALIBRATED, calibration, samples)


def prune_run(src, out, overrides=(), *, overwrite: bool = False) -> Path:
    """Writes the pruned run OUT from SRC; `overrides` are `key=value`s, the `prune.*` of the
    command's options among them. Returns OUT."""
    return _prune(src, out, overrides, overwrite)[0]


def _prune(src, out, overrides, overwrite: bool) -> tuple[Path, str]:
    """`prune_run`, and one line saying what it removed (`jaxllm prune` prints it)."""
    if storage.is_url(str(out)):
        raise ConfigError(
            f"OUT {out}: jaxllm prune writes a local directory; write it there and copy it to "
            "the bucket."
        )
    src = Path(fetched(src, "SRC"))
    out = check_out_dir(out, flag="OUT", overwrite=overwrite, reads=(src,), nested=False)
    if _is_hf_source(src):
        new = new_run(src, out, overrides, overwrite=overwrite)
        cfg = new.cfg.validate()
        _check(cfg, src)
        mesh = sharding.make_mesh(cfg.mesh)
        params, model_state, _ = load_params(src, cfg.model, mesh)
    else:
        run_dir, _, _ = resolve(src)
        saved = config_lib.load(run_dir / "config.yaml")
        cfg = _out_config(saved, out, overrides)
        devices = jax.devices()
        cfg.validate(len(devices))
        _check(cfg, src)
        mesh = sharding.make_mesh(cfg.mesh, devices)
        params, model_state = _source_weights(src, saved, cfg, mesh)
        new = _with_tokenizer(
            NewRun(out, cfg, out / "checkpoints", _tokenizer_files(saved), overwrite)
        )
    p = cfg.prune
    if p.method == "layers":
        return _remove_layers(new, cfg, params, model_state, mesh, src)
    if p.method == "slicegpt":
        return _slice(new, cfg, params, model_state, mesh, src)
    if p.method in STRUCTURED:
        return _remove_units(new, cfg, params, model_state, mesh, src)
    _, _, axes = abstract_model(cfg.model)
    if p.calibrated:
        pruned = sequential(params, model_state, axes, cfg, mesh, p, prune_unit, None, axes)
    else:
        pruned = prune_params(params, axes, p, mesh)
    new.write(pruned, model_state)
    zeros, total = sparsity_of(pruned, axes, p)
    return Path(out), (
        f"pruned {src} into {out}: {zeros:,} of {total:,} chosen weights zero "
        f"({zeros / max(total, 1):.1%}, {p.method}{f' {p.pattern}' if p.pattern else ''})"
    )


def _remove_layers(new: NewRun, cfg: Config, params, model_state, mesh, src) -> tuple[Path, str]:
    """OUT as the model without its least important layers (`jaxllm.compress.layers`)."""
    graphdef, _, _ = abstract_model(cfg.model)
    rows = calibration_rows(cfg, cfg.prune)
    importance = layers.layer_importance(graphdef, params, model_state, rows)
    keep = layers.kept_layers(importance, cfg.prune.sparsity)
    model = dataclasses.replace(cfg.model, num_layers=len(keep))
    cfg = dataclasses.replace(cfg, model=model)
    _, _, axes = abstract_model(model)
    _, state_axes = abstract_model_state(model)
    params = jax.device_put(layers.take_layers(params, keep), sharding.tree_shardings(mesh, axes))
    model_state = layers.take_layers(model_state, keep)
    if model_state:
        model_state = jax.device_put(model_state, sharding.tree_shardings(mesh, state_axes))
    dataclasses.replace(new, cfg=cfg).write(params, model_state)
    gone = sorted(set(range(len(importance))) - set(keep))
    return Path(new.out_dir), (
        f"pruned {src} into {new.out_dir}: removed layers {gone} of {len(importance)} "
        f"(first-order importance {', '.join(f'{v:.3g}' for v in importance)})"
    )


def _remove_units(new: NewRun, cfg: Config, params, model_state, mesh, src) -> tuple[Path, str]:
    """OUT as the model without each layer's least important head groups or MLP channels
    (`jaxllm.compress.layers`): fewer heads, or a smaller mlp_dim, in every layer alike."""
    m, s = cfg.model, cfg.prune.sparsity
    graphdef, _, axes = abstract_model(m)
    scores = layers.taylor(graphdef, params, model_state, calibration_rows(cfg, cfg.prune))
    if cfg.prune.method == "heads":
        qpk = m.num_heads // m.num_kv_heads
        imp = layers.group_importance(scores, axes, "heads", qpk)
        for stack, kv in layers.group_importance(scores, axes, "kv_heads").items():
            imp[stack] = imp[stack] + kv
        drop = math.floor(s * m.num_kv_heads)
        keep = {}
        for stack, v in imp.items():
            groups = layers.kept_units(v, drop)  # [L, KV']
            heads = (groups[:, :, None] * qpk + np.arange(qpk)).reshape(len(groups), -1)
            keep[stack] = {"kv_heads": groups, "heads": heads}
        kv = m.num_kv_heads - drop
        model = dataclasses.replace(
            m, num_heads=kv * qpk, num_kv_heads=kv, head_dim=m.resolved_head_dim
        )
        what = f"{drop} of {m.num_kv_heads} key-value head groups ({drop * qpk} query heads)"
    else:
        imp = layers.group_importance(scores, axes, "mlp")
        drop = math.floor(s * m.mlp_dim)
        keep = {k: {"mlp": layers.kept_units(v, drop)} for k, v in imp.items()}
        model = dataclasses.replace(m, mlp_dim=m.mlp_dim - drop)
        what = f"{drop} of {m.mlp_dim} MLP channels"
    cfg = dataclasses.replace(cfg, model=model)
    cfg.validate(len(jax.devices()))
    _, _, new_axes = abstract_model(model)
    params = layers.take_units(params, axes, keep)
    params = jax.device_put(params, sharding.tree_shardings(mesh, new_axes))
    dataclasses.replace(new, cfg=cfg).write(params, model_state)
    return Path(new.out_dir), f"pruned {src} into {new.out_dir}: removed {what} in every layer"


def _slice(new: NewRun, cfg: Config, params, model_state, mesh, src) -> tuple[Path, str]:
    """OUT as the model rotated by its residual stream's principal components and sliced to
    d_model - floor(S x d_model) (`jaxllm.compress.slicegpt`)."""
    m = cfg.model
    _, _, axes = abstract_model(m)
    grams = []  # (Gram of gamma * x_hat, gamma) of every norm's output

    def record(p, chosen, stats, _cfg, prefix, ctx=None):
        if not prefix:  # the LM head's input: the final norm's output
            seen = [("lm_head", p["final_norm"]["scale"])]
        else:  # the attention's and the MLP's inputs: their norms' outputs
            seen = [
                (next(k for k in readers if k in chosen), p[norm]["scale"])
                for readers, norm in slicegpt.READERS
            ]
        for path, gamma in seen:
            grams.append((np.asarray(stats[path]["gram"]), np.asarray(gamma) + m.norm_offset))
        return p

    section = dataclasses.replace(cfg.prune, head=not m.tie_embeddings)
    sequential(params, model_state, axes, cfg, mesh, section, record, None, axes)
    keep = m.d_model - math.floor(cfg.prune.sparsity * m.d_model)
    q = slicegpt.rotation(grams, keep)
    params = slicegpt.slice_params(params, axes, q, offset=m.norm_offset, tied=m.tie_embeddings)
    model = dataclasses.replace(m, d_model=keep, head_dim=m.resolved_head_dim, tie_embeddings=False)
    cfg = dataclasses.replace(cfg, model=model)
    cfg.validate(len(jax.devices()))
    _, _, new_axes = abstract_model(model)
    params = jax.device_put(params, sharding.tree_shardings(mesh, new_axes))
    dataclasses.replace(new, cfg=cfg).write(params, model_state)
    return Path(new.out_dir), (
        f"pruned {src} into {new.out_dir}: d_model {m.d_model} -> {keep}, the residual stream "
        f"rotated by its principal components{'; the LM head untied' if m.tie_embeddings else ''}"
    )


def _check(cfg: Config, src) -> None:
    """ConfigError, before any weight is read: no method, a quantized source, a pattern whose
    M does not divide a chosen weight's input channels, or layers that cannot be removed."""
    if not cfg.prune.enabled:
        raise ConfigError("prune.method=none prunes nothing; name a method (--method magnitude).")
    if cfg.quantize.enabled:
        raise ConfigError(
            f"{src} is quantized (quantize.method={cfg.quantize.method}); prune the run it was "
            "quantized from, then quantize the pruned run."
        )
    m, s = cfg.model, cfg.prune.sparsity
    if cfg.prune.method == "slicegpt":
        odd = [
            what
            for what, bad in (
                ("routed experts", m.moe.enabled),
                ("MLA", m.mla.enabled),
                ("linear-attention layers (model.layer_pattern)", bool(m.layer_pattern)),
                ("LayerNorm (SliceGPT here folds RMSNorm only)", m.norm != "rmsnorm"),
                (f"{m.norm_placement} norms", m.norm_placement != "pre"),
                ("scaled embeddings", m.scale_embeddings),
                (f"model.kind={m.kind}", m.kind != "decoder"),
            )
            if bad
        ]
        if odd:
            raise ConfigError(
                "--method slicegpt rotates the residual stream of a pre-norm RMSNorm decoder; "
                f"this model has {', '.join(odd)}."
            )
        if math.floor(s * m.d_model) < 1:
            raise ConfigError(
                f"--sparsity {s:g} slices no channel of model.d_model {m.d_model}; ask for at "
                f"least {1 / m.d_model:.3g}."
            )
        return
    if cfg.prune.method == "heads":
        if m.mla.enabled or m.kind == "encoder_decoder" or m.layer_pattern:
            other = "cross-attention (encoder_decoder)"
            other = "linear-attention layers (model.layer_pattern)" if m.layer_pattern else other
            raise ConfigError(
                "--method heads prunes the key-value head groups of standard attention; this "
                f"model has {'MLA' if m.mla.enabled else other}."
            )
        qpk = m.num_heads // m.num_kv_heads
        if math.floor(s * m.num_kv_heads) < 1:
            raise ConfigError(
                f"--sparsity {s:g} removes no head group: the model's {m.num_heads} query heads "
                f"read {m.num_kv_heads} key-value heads, {qpk} each, and heads go a whole group "
                f"at a time so the grouping stays even; ask for at least {1 / m.num_kv_heads:.3g}."
            )
        return
    if cfg.prune.method == "channels":
        if m.moe.enabled or m.kind == "encoder_decoder" or m.layer_pattern:
            raise ConfigError(
                "--method channels prunes the dense MLP's intermediate channels (model.mlp_dim); "
                "this model has routed experts, is an encoder_decoder or is a hybrid "
                "(model.layer_pattern)."
            )
        if math.floor(s * m.mlp_dim) < 1:
            raise ConfigError(
                f"--sparsity {s:g} removes no channel of model.mlp_dim {m.mlp_dim}; ask for at "
                f"least {1 / m.mlp_dim:.3g}."
            )
        return
    if cfg.prune.method == "layers":
        different = m.moe.enabled or (m.sliding_window is not None and m.global_every)
        different = different or bool(m.layer_pattern)
        if different or m.kind not in ("decoder", "encoder"):
            raise ConfigError(
                "--method layers removes layers of a stack whose layers are all alike; this "
                "model's differ (MoE groups, sliding-window or model.layer_pattern patterns) or "
                "it is not one stack "
                f"(model.kind={m.kind})."
            )
        if math.floor(cfg.prune.sparsity * m.num_layers) < 1:
            raise ConfigError(
                f"--sparsity {cfg.prune.sparsity:g} removes no layer of {m.num_layers} "
                f"(floor({cfg.prune.sparsity:g} x {m.num_layers}) = 0); ask for at least "
                f"{1 / m.num_layers:.3g}."
            )
        return
    _, abstract, axes = abstract_model(cfg.model)
    chosen = weights_chosen(abstract, axes, cfg.prune)
    for path, (leaf, n_in, n_out) in chosen.items():
        lead = len(leaf.shape) - n_in - n_out
        k = math.prod(leaf.shape[lead : lead + n_in])
        if cfg.prune.nm and k % cfg.prune.nm[1]:
            raise ConfigError(
                f"--pattern {cfg.prune.pattern}: M={cfg.prune.nm[1]} does not divide the {k} "
                f"input channels of {path}; choose another pattern or leave it out with "
                "prune.skip."
            )
    if not chosen:
        raise ConfigError("prune.skip leaves no weight to prune.")


def cmd_prune(ns) -> int:
    src, out, *rest = ns.args if len(ns.args) >= 2 else (None, None)
    stray = [a for a in rest if "=" not in a]
    if src is None or out is None or stray:
        raise ConfigError("jaxllm prune takes SRC OUT, then only key=value.")
    how = options(ns.method, ns.sparsity, ns.pattern, ns.calibration, ns.samples)
    _, summary = _prune(src, out, [*rest, *how], ns.overwrite)
    print(summary, file=sys.stderr)
    return 0


def add_prune_parser(sub) -> None:
    p = sub.add_parser("prune", help="prune a trained model's weights into a new run")
    p.add_argument("args", nargs="+", metavar="SRC OUT key=value")
    p.add_argument(
        "--method",
        required=True,
        help="magnitude | wanda | sparsegpt (zeros) | layers | heads | channels | slicegpt "
        "(smaller shapes) (docs/compression.md)",
    )
    p.add_argument("--sparsity", type=float, help="the fraction of each weight set to zero")
    p.add_argument("--pattern", help="N:M semi-structured sparsity, e.g. 2:4 (N of every M zero)")
    p.add_argument(
        "--calibration",
        help="every method but magnitude: a data source (a path, or a mapping like {path: x.jsonl, "
        "format: chat}); default: the run's held-out split",
    )
    p.add_argument("--samples", type=int, help="calibration rows of data.seq_len (default 128)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=cmd_prune)
