"""Starting a run from a fine-tuning run: `checkpoint.init_from` a LoRA, QLoRA, bottleneck-
adapter or prompt-tuning run, the post-training chain SFT -> DPO -> GRPO of TRL's recipes.

A fine-tuning run's checkpoints hold its adapters (or soft prompt) and a record of its base
(`jaxllm.load`), so its starting point for another run is one of two things
(`checkpoint.init_adapters`):

- `merge` (the default, and the only choice without `peft`): the source's merged model, every
  adapter folded into its weight (W + s A B, a QLoRA base dequantized first), as
  `jaxllm.load.load_weights` reads any PEFT source (a soft prompt or bottleneck adapters, which
  merge into no weight, are refused). Under `peft` the new run trains fresh
  adapters on that merged base, of any rank and targets, as TRL's DPOTrainer does when given an
  SFT adapter and a `peft_config` (it merges the adapter and adds a new one). Its base record
  names the source step (with the hash of its adapters; the source's own base is checked when
  it is loaded), and a reference (DPO, GRPO / PPO's KL) is that base with the new adapters off:
  the merged model itself, no copy.
- `continue`: the new run trains the source's own adapters (or soft prompt) on the source's
  own base, which needs the same peft.rank, alpha, rslora, dora, modules_to_save,
  layers_to_transform and targets (or num_virtual_tokens, or a bottleneck run's adapter_size
  and adapter_activation); peft.method may go from lora to qlora or back (the base is then
  stored the new way). Its base record is the source's, so `convert export --peft` names the
  same Hugging Face base. The reference is the starting model, the base with the starting
  adapters: only those adapters are held beside the policy (`jaxllm.train.companions`), as
  TRL's second adapter loaded for the reference, so a QLoRA run never holds a full-precision
  copy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import jax
from jax.sharding import Mesh

from jaxllm import checkpoint, config
from jaxllm.adapters.hf_peft import imported_adapters
from jaxllm.compress import not_trained
from jaxllm.config import Config, ConfigError, PeftConfig, QuantizeConfig
from jaxllm.config.prune import STRUCTURED
from jaxllm.convert import is_hf_dir
from jaxllm.load import (
    BASE_ITEM,
    check_base,
    check_shapes,
    content_hash,
    load_weights,
    resolve,
    weight_files,
    weight_targets,
)
from jaxllm.load import base_record as _own_base_record
from jaxllm.model import abstract_model, build, init_keys, split_peft


def source_config(cfg: Config) -> Config | None:
    """The config of the jaxllm run `checkpoint.init_from` names (None for a Hugging Face
    directory, or without init_from)."""
    source = cfg.checkpoint.init_from
    if not source or is_hf_dir(Path(source)):
        return None
    if not Path(source).exists():
        raise ConfigError(f"checkpoint.init_from={source} does not exist.")
    run_dir, _, _ = resolve(source)
    return config.load(run_dir / "config.yaml")


def continued(cfg: Config) -> Config | None:
    """Under `checkpoint.init_adapters=continue`, the config of the fine-tuning run whose
    adapters (or soft prompt) this run continues, checked against this run's model and peft
    (ConfigError naming the keys that differ); None under `merge`."""
    if cfg.checkpoint.init_adapters != "continue":
        return None
    source = cfg.checkpoint.init_from
    theirs = source_config(cfg)
    if theirs is None or theirs.peft.method == "none":
        what = "a full run (peft.method=none)" if theirs else "no jaxllm fine-tuning run"
        raise ConfigError(
            f"checkpoint.init_adapters=continue continues a fine-tuning run's adapters, but "
            f"checkpoint.init_from={source} is {what}; train new adapters on it with "
            "checkpoint.init_adapters=merge."
        )
    check_shapes(source, cfg.model, theirs.model)
    differ = _peft_keys(cfg, theirs)
    if differ:
        there = ", ".join(f"peft.{k}={_show(getattr(theirs.peft, k))}" for k in differ)
        here = ", ".join(f"peft.{k}={_show(getattr(cfg.peft, k))}" for k in differ)
        raise ConfigError(
            f"checkpoint.init_adapters=continue trains on the adapters of {source}, which has "
            f"{there}, where this run has {here}; set those keys to its values, or "
            "checkpoint.init_adapters=merge to train new adapters on its merged model."
        )
    return theirs


def quantized_base(cfg: Config) -> Config:
    """`cfg` with the `quantize` section of its frozen base. LoRA trains on a quantized run
    (`jaxllm quantize`) as QLoRA does on NF4: the base stays in its packed codes, and the run's
    `quantize.*` records how (taken from `checkpoint.init_from`, or from the run it continues
    the adapters of). ConfigError when anything else would train quantized weights, or when
    `quantize.*` is set by hand to something other than the base's."""
    theirs = source_config(cfg)
    base = QuantizeConfig()
    if theirs is not None and (theirs.peft.method == "none" or continued(cfg) is not None):
        base = theirs.quantize
    if not base.enabled and not cfg.quantize.enabled:
        return cfg
    if not base.enabled and cfg.peft.method == "none":  # a quantized run's own config
        if not (Path(cfg.run.dir) / "config.yaml").is_file():  # or a new run that sets it
            raise ConfigError(
                f"quantize.method={cfg.quantize.method}: a run trains float weights, and "
                "quantize.* records what jaxllm quantize made of them; leave it unset and "
                "quantize the trained run (or fake-quantize while training with train.qat.*)."
            )
        not_trained(cfg.quantize, f"run.dir={cfg.run.dir}")
    if cfg.quantize.enabled and cfg.quantize != base:
        where = f"checkpoint.init_from={cfg.checkpoint.init_from}" if base.enabled else "nothing"
        raise ConfigError(
            f"quantize.method={cfg.quantize.method}: a run's quantize section describes "
            f"quantized weights it holds, and {where} gives that; leave quantize.* unset "
            "(jaxllm quantize writes it)."
        )
    if cfg.peft.method != "lora":
        raise ConfigError(
            f"checkpoint.init_from={cfg.checkpoint.init_from} holds quantized weights "
            f"(quantize.method={base.method}, jaxllm quantize), which do not train; train LoRA "
            "adapters on it (peft.method=lora), or start from the run it was quantized from."
        )
    return dataclasses.replace(cfg, quantize=base)


def pruned_base(cfg: Config) -> Config:
    """`cfg` with the `prune` section of the pruned run it starts from
    (`checkpoint.init_from`), so its config.yaml records it and its zeros stay zero while it
    trains: a full run's through `optim.keep_zeros`, a LoRA run's (whose base is frozen) with
    `peft.keep_zeros` on, so its update keeps them too. A run that sets `prune.*` itself, or
    one that trains neither (prompt tuning, bottleneck adapters: the base stays as it is),
    keeps its own."""
    if cfg.prune.enabled or cfg.peft.method not in ("none", "lora", "qlora"):
        return cfg
    theirs = source_config(cfg)
    if theirs is None or not theirs.prune.enabled:
        return cfg
    cfg = dataclasses.replace(cfg, prune=theirs.prune)
    if cfg.peft.lora and theirs.prune.method not in STRUCTURED:
        if cfg.peft.dora:
            raise ConfigError(
                f"peft.dora rescales whole outputs, which cannot keep the zeros of "
                f"checkpoint.init_from (pruned with prune.method={theirs.prune.method}); train "
                "it with plain LoRA (peft.dora=false)."
            )
        cfg = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, keep_zeros=True))
    return cfg


def _peft_keys(cfg: Config, theirs: Config) -> list[str]:
    """The peft keys whose values keep this run from continuing the adapters of `theirs`."""
    mine, old = cfg.peft, theirs.peft
    for own in ("prompt", "adapter"):  # methods whose parameters no other method has
        if (mine.method == own) != (old.method == own):
            return ["method"]
    if mine.method == "prompt":
        return [] if mine.num_virtual_tokens == old.num_virtual_tokens else ["num_virtual_tokens"]
    if mine.method == "adapter":
        keys = ("adapter_size", "adapter_activation")
        return [k for k in keys if getattr(mine, k) != getattr(old, k)]
    keys = ("rank", "alpha", "rslora", "dora", "modules_to_save", "layers_to_transform")
    keys = [k for k in keys if getattr(mine, k) != getattr(old, k)]
    if _adapted(cfg.model, mine) != _adapted(theirs.model, old):
        keys.append("targets")
    return keys


def _adapted(model, peft: PeftConfig) -> set[str]:
    """The weights `peft` adapts in `model`, by path."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_model(model, peft)[1])[0]
    paths = ("/".join(str(k.key) for k in path) for path, _ in flat)
    return {p.removesuffix("_lora_a") for p in paths if p.endswith("_lora_a")}


def _show(value) -> str:
    if isinstance(value, tuple):
        return f"[{', '.join(value)}]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def base_record(cfg: Config) -> dict | None:
    """What this run's base is (`jaxllm.load.base_record`); when it continues a fine-tuning
    run's adapters, that run's own base record (of the checkpoint it starts from)."""
    if continued(cfg) is None:
        return _own_base_record(cfg)
    step_dir = weight_files(Path(cfg.checkpoint.init_from).resolve())[0]
    record = checkpoint.read_json_item(step_dir.parent, int(step_dir.name), BASE_ITEM)
    if record is None:
        raise ConfigError(f"{step_dir} has no record of its fine-tuning base; it cannot go on.")
    return record


def adapters_of(source, cfg: Config, theirs: Config, mesh: Mesh) -> tuple[dict, dict]:
    """(the adapters or soft prompt, the model state) of the fine-tuning run `source` (config
    `theirs`), of the checkpoint its base record pins (`weight_files`), in this run's dtypes
    and shards; the adapters carry a PPO value head when `source` has one."""
    step_dir = weight_files(Path(source).resolve())[0]
    read = dataclasses.replace(cfg.model, value_head=theirs.model.value_head)
    _, target, ms_target = weight_targets(read, mesh, cfg.peft)
    w = checkpoint.restore_weights(step_dir.parent, target, ms_target, int(step_dir.name))
    return w.params, w.model_state


class Start(NamedTuple):
    """What a fresh run starts from (`starting_weights`)."""

    params: dict  # every parameter, the base under peft
    model_state: dict | None  # None: zeros
    adapters: dict | None  # under peft: the adapters / soft prompt to go on from, else fresh
    how: str  # for the log line


def starting_weights(cfg: Config, source: str, mesh: Mesh, base: dict | None, ckpt_dir) -> Start:
    """The weights a fresh run starts from `source` (`checkpoint.init_from`, or an imported
    checkpoint in the run's own `ckpt_dir`): the source's parameters (a fine-tuning run's merged
    model), with under peft the adapters imported into this run; or, continuing a fine-tuning
    run (`continued`), the base of its record `base` and its adapters."""
    theirs = continued(cfg) if source == cfg.checkpoint.init_from else None
    if theirs is None:
        base_q = cfg.quantize if base else None  # LoRA on a quantized run: its codes
        params, model_state = load_weights(source, cfg.model, mesh, quantize=base_q)
        target = weight_targets(cfg.model, mesh, cfg.peft)[1] if base else None
        trained = imported_adapters(Path(ckpt_dir), target, base)
        how = ", adapters from this run's imported checkpoint" if trained else ""
        return Start(params, model_state, trained, how)
    if "seed" in base:  # the source's base was its own random initialisation
        init_key = init_keys(base["seed"])[0]
        shardings = jax.tree.map(lambda t: t.sharding, weight_targets(cfg.model, mesh)[1])
        init = lambda: split_peft(build(cfg.model, init_key), None)[1]  # noqa: E731
        params = jax.jit(init, out_shardings=shardings)()
    else:  # as its own readers do, the base must still hold the weights it recorded
        where, files = weight_files(Path(base["source"]))
        check_base(base, {"source": str(where), "sha256": content_hash(files, where)})
        params, _ = load_weights(base["source"], cfg.model, mesh, quantize=cfg.quantize)
    trained, model_state = adapters_of(source, cfg, theirs, mesh)
    if not cfg.model.value_head:
        trained.pop("value", None)
    what = "soft prompt" if cfg.peft.method == "prompt" else "adapters"
    return Start(params, model_state or None, trained, f", its {what} continued")
