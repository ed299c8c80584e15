"""`model.remat=auto`: the remat policy chosen by a memory budget.

The train step is compiled ahead of time on abstract inputs (no parameters, no data) under each
policy of `jaxllm.model.remat.AUTO_ORDER` in turn, least recomputation first (none,
dots_attention, dots, dots_with_no_batch_dims, full), and the first whose compiled step fits
`train.memory_budget` x one device's memory is taken: the device's allocator limit, or
`train.device_memory`, or `jaxllm plan --hbm`. What a step needs is XLA's memory analysis, as
`jaxllm plan` bills it: arguments + outputs - aliased (donated) + temporaries + code.

`jaxllm train` logs "model.remat=auto: chose dots (N GiB of M GiB)" and trains with it; its
config.yaml records the chosen policy (the budget keys back at their defaults), so a resume or
`jaxllm eval` of the run reads what ran. The choice changes no state: a run may resume under
another policy.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm import config
from jaxllm.config.memory_budget import parse_size
from jaxllm.data import span_corruption
from jaxllm.model.remat import AUTO_ORDER
from jaxllm.train import loss_scale
from jaxllm.train.compiled import compile_steps
from jaxllm.train.state import init_state, layout


def abstract_inputs(cfg: config.Config, mesh, tx, shardings, batch_sh):
    """(state, batch) of `jax.ShapeDtypeStruct`s with their shardings: what the train step
    takes, for lowering it without creating a parameter or reading a row."""
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    state = jax.eval_shape(
        lambda: init_state(cfg.model, tx, mesh, cfg.run.seed, scaling, **layout(cfg))
    )
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings
    )
    b, l = cfg.train.global_batch_size, cfg.data.seq_len
    lengths = dict.fromkeys(("inputs", "targets", "segment_ids", "positions", "loss_mask"), l)
    if cfg.train.objective == "span_corruption":  # encoder and decoder arrays
        lengths = span_corruption.batch_lengths(cfg.data)
    if cfg.train.objective == "kto":  # which examples are desirable
        lengths["label"] = l
    if cfg.train.objective == "prefix_lm":  # the tokens read bidirectionally
        lengths["prefix"] = l
    batch = {
        k: jax.ShapeDtypeStruct((b, n), np.int32, sharding=batch_sh) for k, n in lengths.items()
    }
    return state, batch


def memory(compiled) -> dict:
    """XLA's memory analysis of a compiled step, per device, with its `total`."""
    mem = compiled.memory_analysis()
    m = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
    }
    m["total"] = m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["code"]
    return m


def step_bytes(cfg: config.Config, mesh) -> int:
    """Bytes per device the train step of `cfg` needs, compiled on abstract inputs."""
    jit_train, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    state, batch = abstract_inputs(cfg, mesh, tx, shardings, batch_sh)
    return memory(jit_train.lower(state, batch).compile())["total"]


def with_remat(cfg: config.Config, name: str) -> config.Config:
    """`cfg` under remat policy `name`, the budget keys (which only auto reads) at defaults."""
    train = dataclasses.replace(
        cfg.train,
        memory_budget=config.TrainConfig.memory_budget,
        device_memory=config.TrainConfig.device_memory,
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=name), train=train)


def device_memory(cfg: config.Config, devices, hbm: int | None = None) -> int:
    """One device's memory: `hbm` (plan's --hbm), else `train.device_memory`, else what the
    device's allocator reports; ConfigError where none is known (a CPU)."""
    if hbm is not None:
        return hbm
    if cfg.train.device_memory is not None:
        return parse_size(cfg.train.device_memory, "train.device_memory")
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise config.ConfigError(
            f"model.remat=auto: a {devices[0].platform} device reports no memory size; give "
            "one as train.device_memory (e.g. 16GiB) or jaxllm plan --hbm."
        )
    return int(stats["bytes_limit"])


def state_bytes(cfg: config.Config, mesh) -> int:
    """Bytes per device of the train state in device memory: what every policy's step takes
    as its argument, a floor under each (no compile needed)."""
    _, _, tx, shardings, batch_sh = compile_steps(with_remat(cfg, "full"), mesh)
    state, _ = abstract_inputs(cfg, mesh, tx, shardings, batch_sh)
    total = 0
    for leaf in jax.tree.leaves(state):
        if getattr(leaf.sharding, "memory_kind", None) not in ("pinned_host", "unpinned_host"):
            total += int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    return total


def choose(cfg: config.Config, mesh, budget: int, measure=step_bytes):
    """(policy, bytes) of the first of `AUTO_ORDER` whose step (`measure(cfg, mesh)`) needs at
    most `budget` bytes per device; ConfigError when none does, at once when the train state
    alone is over the budget."""
    need = state_bytes(cfg, mesh)
    if need > budget:
        raise config.ConfigError(
            f"model.remat=auto: the train state alone needs {_gib(need)} per device, over "
            f"train.memory_budget={cfg.train.memory_budget} ({_gib(budget)}): no remat policy "
            "fits; shard the state over more devices (mesh.fsdp) or offload it (optim.offload)."
        )
    for name in AUTO_ORDER:
        need = measure(with_remat(cfg, name), mesh)
        if need <= budget:
            return name, need
    raise config.ConfigError(
        f"model.remat=auto: no policy fits train.memory_budget={cfg.train.memory_budget} "
        f"({_gib(budget)} per device): even full needs {_gib(need)}; lower "
        "train.global_batch_size or data.seq_len, add train.grad_accum_steps, or shard over "
        "more devices."
    )


def resolve(cfg: config.Config, mesh, hbm: int | None = None, log=print, measure=step_bytes):
    """`cfg` with `model.remat=auto` replaced by the policy `choose` takes (and said through
    `log`); any other config unchanged."""
    if cfg.model.remat != "auto":
        return cfg
    total = device_memory(cfg, list(mesh.devices.flat), hbm)
    budget = int(cfg.train.memory_budget * total)
    name, need = choose(cfg, mesh, budget, measure)
    log(f"model.remat=auto: chose {name} ({_gib(need)} of {_gib(budget)})")
    return with_remat(cfg, name)


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1 (as `jaxllm plan` writes)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
