"""Calibrated quantization (and pruning, `sequential` with `cfg.prune`), one block at a time (GPTQ's and llm-compressor's sequential
scheme): the calibration rows' hidden states pass through the model block by block; each
block runs once to record the statistics of its chosen weights' inputs (`jaxllm.model.tap`),
its weights are quantized from them (a `UNIT_METHODS` method), and the quantized block runs
again to give the next block its inputs. So a block's statistics see the errors of the blocks
quantized before it, and only one block's activations (rows x seq_len x d_model) are held at a
time. The untied LM head, with `quantize.head`, comes last, on the final norm's output.

Calibration rows are the run's own held-out split (`data.eval_sources`, or the
`data.eval_fraction` held out of its sources), or `quantize.calibration`: any `data.sources`
entry, a path or a mapping, read and packed by the run's data pipeline with its tokenizer into
rows of `data.seq_len` tokens. The first `quantize.samples` rows are used; padding (segment id
0) is left out of every statistic.

Everything runs on the run's mesh: the rows' batches are sharded like training's, each block's
weights stay in their shards, and the quantized stacks are put together in their shards.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from jaxllm import config as config_lib
from jaxllm import sharding
from jaxllm.compress import weights as weights_lib
from jaxllm.compress.awq import awq_unit, kept
from jaxllm.compress.gptq import gptq
from jaxllm.compress.smoothquant import smoothquant_unit
from jaxllm.config import Config, ConfigError
from jaxllm.data.pipeline import load_splits
from jaxllm.model import tap
from jaxllm.model.transformer import Transformer, build


def per_weight(fn) -> Callable:
    """A unit method quantizing each chosen weight on its own by `fn(w, stats, cfg, *, n_in,
    n_out)` (jitted, in the weight's shards)."""
    jitted = jax.jit(fn, static_argnames=("cfg", "n_in", "n_out"))

    def method(params, chosen, stats, cfg, prefix, ctx=None):
        cfg = cfg.quantize
        out = jax.tree.map(lambda x: x, params)
        for path, (n_in, n_out) in chosen.items():
            *parents, name = path.split("/")
            leaf = _sub(out, parents)
            leaf[name] = jitted(leaf[name], stats[path], cfg=cfg, n_in=n_in, n_out=n_out)
        return out

    return method


# method -> fn(unit params, {path: (n_in, n_out)}, {path: stats}, Config, prefix, Context)
# -> the unit's params
UNIT_METHODS: dict[str, Callable] = {
    "gptq": per_weight(gptq),
    "awq": awq_unit,
    "smoothquant": smoothquant_unit,
}
# method -> fn(unit params, chosen, Config) -> the names whose inputs it needs whole
KEEP: dict[str, Callable] = {"awq": kept}

TOKENS_PER_DEVICE = 2048  # rows per calibration batch: about this many tokens per device


def calibration_rows(cfg: Config, section=None) -> dict[str, np.ndarray]:
    """{inputs, positions, segment_ids} int32 [samples, seq_len]: the first `samples` rows of
    the calibration data (module docstring) of `section` (`cfg.quantize` by default, or
    `cfg.prune`). ConfigError when there are fewer."""
    q, data = section or cfg.quantize, cfg.data
    if q.calibration:
        source = yaml.safe_load(q.calibration)
        source = source if isinstance(source, dict) else {"path": q.calibration}
        tree = config_lib.to_dict(cfg)
        tree["data"].update(sources=[source], eval_sources=[], eval_fraction=0.0)
        data = config_lib.from_dict(tree).data
        what = f"--calibration {q.calibration}"
        try:
            rows = load_splits(data)[0]
        except ConfigError as e:  # named as the option, not the data key it stands in for
            said = str(e).replace("data.sources[0].", "").replace("data.sources[0]", "it")
            raise ConfigError(f"{what}: {said}") from None
    else:
        rows, what = load_splits(data)[1], "the run's held-out split"
        if rows is None:
            raise ConfigError(
                "the run holds nothing out (data.eval_fraction=0, no data.eval_sources) to "
                "calibrate on; name the data with --calibration PATH."
            )
    n = len(rows)
    if n < q.samples:
        raise ConfigError(
            f"{what} gives {n} rows of {data.seq_len} tokens ({n * data.seq_len} tokens); "
            f"--samples {q.samples} needs {q.samples * data.seq_len}: pass more data or fewer "
            "--samples."
        )
    items = [rows[i] for i in range(q.samples)]
    keys = ("inputs", "positions", "segment_ids")
    return {k: np.stack([np.asarray(it[k], np.int32) for it in items]) for k in keys}


@dataclasses.dataclass
class Unit:
    """One block of the model: where its parameters lie in the stacked tree."""

    keys: tuple[str, ...]  # the stacked subtree: ("layers",), ("moe_layers", "moe"), ...
    index: tuple[int, ...]  # its index in the stacked dims
    layer: int  # its layer number (per-layer inputs)


def units(cfg) -> list[Unit]:
    """The model's blocks in the order they run."""
    if cfg.layer_pattern:  # hybrid: repeats of the pattern, `block_i` stacked over repeats
        every = len(cfg.layer_pattern)
        return [
            Unit(("hybrid_layers", f"block_{i}"), (g,), g * every + i)
            for g in range(cfg.num_layers // every)
            for i in range(every)
        ]
    moe = cfg.moe
    n_dense = moe.first_dense_layers if moe.enabled else cfg.num_layers
    out = [Unit(("layers",), (i,), i) for i in range(n_dense)]
    if moe.enabled:
        every = moe.moe_every
        for g in range((cfg.num_layers - n_dense) // every):
            first = n_dense + g * every
            out += [Unit(("moe_layers", "dense"), (g, j), first + j) for j in range(every - 1)]
            out.append(Unit(("moe_layers", "moe"), (g,), first + every - 1))
    return out


def _sub(tree, keys):
    for k in keys:
        tree = tree.get(k, {}) if isinstance(tree, dict) else {}
    return tree


@jax.jit
def _take(tree, index):
    """`tree`'s arrays at `index` of their leading (stacked) dims: one jitted program, so no
    eager slice of a sharded array is dispatched while the previous block still runs (on a
    loaded host such a slice's collectives could wait on that block past their rendezvous
    timeout). `index` is traced: one compilation serves every block."""
    return jax.tree.map(lambda a: a[index], tree)


def _var(module, path: str):
    for part in path.split("/"):
        module = getattr(module, part)
    return module


def _chosen(params: dict, axes: dict, prefix: str, cfg) -> dict[str, tuple[int, int]]:
    """{path within the block: (n_in, n_out)} of the weights `cfg` quantizes."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    out = {}
    for (keys, _), ax in zip(flat, flat_axes):
        rel = weights_lib.path_of(keys)
        d = weights_lib.dims(f"{prefix}/{rel}" if prefix else rel, tuple(ax), cfg)
        if d is not None:
            out[rel] = d
    return out


@dataclasses.dataclass
class Context:
    """What a unit method may run the block on: its graphdef, state and per-layer inputs,
    the calibration batches ([x, positions, segment ids, mask]) and, per name it asked to
    keep (`KEEP`), that weight's input [K, B * L] in each batch."""

    gdef: object
    state: dict
    inputs: dict
    batches: list
    raw: dict


def _run(gdef, params, state, x, pos, seg, mask, per_layer, names, kind, keep=frozenset()):
    """The block's (or with kind="tail" the model's head's) output on x and, with `names`,
    the statistics of those weights' inputs (and the inputs of `keep`)."""
    module = nnx.merge(gdef, params, state) if state else nnx.merge(gdef, params)
    ids = {id(_var(module, p).get_value()): p for p in names}
    with tap.recording(ids, mask.reshape(-1), keep) as rec:
        if kind == "tail":
            return module.outputs(x).logits[..., :0], rec.stats
        y = module(x, pos, seg, None, **per_layer)[0]
    return y, rec.stats


def quantize_calibrated(params: dict, model_state: dict, axes: dict, cfg: Config, mesh: Mesh):
    """`params` with the weights `cfg.quantize` chooses quantized by its calibrated method,
    block by block on `mesh` (module docstring)."""
    q = cfg.quantize
    q_abstract, q_axes = weights_lib.quantized_abstract(params, axes, q)
    keep = KEEP.get(q.method)
    out = sequential(params, model_state, axes, cfg, mesh, q, UNIT_METHODS[q.method], keep, q_axes)
    assert jax.tree.structure(out) == jax.tree.structure(q_abstract)
    return out


def sequential(
    params: dict,
    model_state: dict,
    axes: dict,
    cfg: Config,
    mesh: Mesh,
    section,
    method: Callable,
    keep_fn: Callable | None,
    out_axes: dict,
):
    """`params` with the weights `section` (`cfg.quantize` or `cfg.prune`: its method, head,
    skip, calibration and samples) chooses rewritten by the unit `method`, block by block on
    `mesh` (module docstring); `out_axes` the logical axes of the result."""
    q = section
    rows = calibration_rows(cfg, section)
    abstract = nnx.eval_shape(lambda: build(cfg.model, 0))
    if not isinstance(abstract, Transformer):
        raise ConfigError(
            f"--method {q.method} calibrates decoder and encoder stacks; model.kind="
            f"{cfg.model.kind} takes --method rtn."
        )
    full_def = nnx.graphdef(abstract)
    per_layer = Transformer.per_layer(abstract, None)
    batch_sh = sharding.named(mesh, ("batch", None))
    n_dev = max(1, batch_sh.num_devices // max(1, mesh.shape.get("tensor", 1)))
    bsz = n_dev * max(1, TOKENS_PER_DEVICE // rows["inputs"].shape[1])

    @jax.jit
    def embed(p, s, t, pos, seg):
        return nnx.merge(full_def, p, s).inputs(t, pos, seg, None, None)[0]

    run = jax.jit(_run, static_argnums=(0, 8, 9, 10))
    batches = []  # (x, positions, segment ids, mask) of each batch
    for start in range(0, len(rows["inputs"]), bsz):
        part = {k: v[start : start + bsz] for k, v in rows.items()}
        mask = (part["segment_ids"] > 0).astype(np.float32)
        if len(mask) < bsz:  # the last batch padded with masked rows
            pad = bsz - len(mask)
            part = {k: np.concatenate([v, np.repeat(v[:1], pad, 0)]) for k, v in part.items()}
            mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), np.float32)])
        t, pos, seg, mask = (
            jax.device_put(a, batch_sh)
            for a in (part["inputs"], part["positions"], part["segment_ids"], mask)
        )
        batches.append([embed(params, model_state, t, pos, seg), pos, seg, mask])

    def calibrate(gdef, p, s, prefix, layer_inputs, chosen, kind="block"):
        """`p` quantized by the method from its statistics over every batch."""
        names = tuple(sorted(chosen))
        keep = keep_fn(p, chosen, cfg) if keep_fn is not None and kind == "block" else ()
        stats, raw = None, {n: [] for n in keep}
        for x, pos, seg, mask in batches:
            _, got = run(gdef, p, s, x, pos, seg, mask, layer_inputs, names, kind, keep)
            for n in keep:
                raw[n].append(got[n].pop("x"))
            stats = got if stats is None else {k: tap.merge(stats[k], got[k]) for k in stats}
        missing = [n for n in names if n not in (stats or {})]
        if missing:
            raise ConfigError(f"calibration saw no input of {prefix}/{missing[0]}.")
        return method(p, chosen, stats, cfg, prefix, Context(gdef, s, layer_inputs, batches, raw))

    out_units: dict[tuple, list] = {}
    todo = units(cfg.model)
    bar = tqdm(total=len(todo), unit="layer", desc=q.method, file=sys.stderr, disable=None)
    with bar:
        for u in todo:
            prefix = "/".join(u.keys)
            gdef = nnx.graphdef(_var(abstract, prefix))
            p = _take(_sub(params, u.keys), u.index)
            s = _take(_sub(model_state, u.keys), u.index)
            inputs = _take(per_layer, u.layer)
            chosen = _chosen(p, _sub(axes, u.keys), prefix, q)
            qp = calibrate(gdef, p, s, prefix, inputs, chosen)
            for b in batches:  # the next block's inputs, through the quantized block
                b[0] = run(gdef, qp, s, *b, inputs, (), "block")[0]
            out_units.setdefault(u.keys, []).append((u.index, qp))
            bar.update(1)
    out = jax.tree.map(lambda x: x, params)
    shardings = sharding.tree_shardings(mesh, out_axes)
    for keys, parts in out_units.items():
        stacked = jax.jit(_stack_units, static_argnums=0, out_shardings=_sub(shardings, keys))(
            tuple(i for i, _ in parts), [p for _, p in parts]
        )
        _sub(out, keys[:-1])[keys[-1]] = stacked
    head = {k: v for k, v in _chosen(params, axes, "", q).items() if k == "lm_head"}
    if head:  # last, on the final norm's output of the quantized blocks
        out = calibrate(full_def, out, model_state, "", {}, head, kind="tail")  # AWQ: the
        # final norm too, which takes the head's scales
        out["lm_head"] = jax.device_put(out["lm_head"], shardings["lm_head"])
    return out


def _stack_units(index, parts):
    """The units' parameters stacked back along their stacked dims (one or two)."""
    if len(index[0]) == 1:
        return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
    groups = sorted({i[0] for i in index})
    per_group = [[p for i, p in zip(index, parts) if i[0] == g] for g in groups]
    return jax.tree.map(
        lambda *gs: jnp.stack(gs), *[jax.tree.map(lambda *xs: jnp.stack(xs), *g) for g in per_group]
    )
