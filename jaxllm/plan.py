"""`jaxllm plan`: will it fit? Compile the train step ahead of time and read what XLA planned.

No parameters are created and no data is read: the state and batch are abstract
(`jax.ShapeDtypeStruct` with shardings), so an 8B model plans on a laptop with simulated CPU
devices (`--devices 8`), or for a TPU topology where `libtpu` is installed (`--target`).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxllm import compress, config, sharding
from jaxllm.config.memory_budget import parse_size
from jaxllm.config.pipeline import microbatches
from jaxllm.hlo_collectives import collectives
from jaxllm.infer import kv_cache
from jaxllm.metrics import flops_per_token, param_counts
from jaxllm.model import abstract_model, nf4
from jaxllm.model.groups import freeze_mask
from jaxllm.optim.freeze import select
from jaxllm.optim.groups import frozen_mask
from jaxllm.parallel import schedules
from jaxllm.parallel.grad_compression import Compression
from jaxllm.plan_vision import vision_bill, vision_lines
from jaxllm.train import remat_auto
from jaxllm.train.compiled import compile_steps
from jaxllm.train.state import grad_shardings


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920; plain numbers are bytes."""
    return parse_size(text, "--hbm")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def grad_exchange(cfg: config.Config, abstract_params) -> dict | None:
    """The gradient bytes one data replica contributes per step: what the compressed exchange
    (`train.grad_compression`) sends, beside the float32 gradients an all-reduce carries."""
    comp = Compression.of(cfg)
    if comp is None:
        return None
    dense = sum(p.size * 4 for p in jax.tree.leaves(abstract_params))
    return {"method": comp.method, "sent": comp.wire_bytes(abstract_params), "dense": dense}


def lower_step(cfg: config.Config, mesh):
    """(the configured train step lowered on an abstract state and batch, that state, its
    shardings): `jaxllm plan`'s compile, and what tests that read the step's HLO compile."""
    jit_train, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    abstract_state, batch = remat_auto.abstract_inputs(cfg, mesh, tx, shardings, batch_sh)
    return jit_train.lower(abstract_state, batch), abstract_state, shardings


def plan(cfg: config.Config, devices, hbm_bytes: int | None = None, images=None) -> dict:
    """Compiles the configured train step for `devices` and returns the report's numbers;
    a VLM's tower is billed for `images` images (default: a device's rows of a microbatch)."""
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    chose = []  # model.remat=auto: the policy --hbm (or the device) allows, and its line
    cfg = remat_auto.resolve(cfg, mesh, hbm_bytes, log=chose.append)
    t0 = time.perf_counter()
    lowered, abstract_state, shardings = lower_step(cfg, mesh)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    b, l = cfg.train.global_batch_size, cfg.data.seq_len

    _, abstract_params, axes = abstract_model(cfg.model, cfg.peft)
    rows = []
    flat_axes = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))
    for (path, ax), leaf in zip(flat_axes[0], jax.tree.leaves(abstract_params)):
        spec = sharding.named(mesh, ax).spec
        shard_shape = sharding.named(mesh, ax).shard_shape(leaf.shape)
        rows.append(
            {
                "name": "/".join(str(getattr(k, "key", k)) for k in path),
                "shape": leaf.shape,
                "axes": ax,
                "spec": spec,
                "bytes_per_device": int(np.prod(shard_shape)) * leaf.dtype.itemsize,
            }
        )

    grad_sh = grad_shardings(cfg.model, mesh, cfg.mesh.zero_stage, cfg.peft)
    bill = memory_bill(abstract_state, shardings, axes, grad_sh)
    frozen = freeze_mask(abstract_params, cfg.train.freeze, cfg.peft.method)  # train.freeze
    frozen = frozen_mask(abstract_params, cfg.optim.param_groups, frozen)
    trainable = sum(p.size for p in jax.tree.leaves(select(abstract_params, frozen)))
    q_bill = cfg.quantize.enabled and compress.weight_bytes(
        abstract_params, axes, cfg.quantize, mesh
    )
    memory = remat_auto.memory(compiled)
    if images is None:  # one image per row of a device's share of a microbatch
        ways = mesh.shape["data"] * mesh.shape["fsdp"] * microbatches(cfg)
        images = max(1, b // ways)
    tower_trains = "visual" in select(abstract_params, frozen)  # else only its forward
    return {
        "vision": vision_bill(cfg, abstract_state, shardings, images, tower_trains),
        "pipeline": pipeline_report(cfg, mesh),
        "kv_cache": kv_cache.cache_report(cfg, mesh),
        "mesh": dict(mesh.shape),
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "params": param_counts(cfg.model)["total"],
        "trainable": trainable,
        "base": base_bill(abstract_state.frozen, shardings.frozen),
        "quantized": q_bill,  # a quantized run's weights as stored
        "param_rows": rows,
        "memory": memory,
        "bill": bill,
        "flops_per_step": flops_per_token(cfg.model, l)["total"] * b * l,
        "collectives": collectives(compiled.as_text()),
        "grad_exchange": grad_exchange(cfg, abstract_params),
        "compile_s": compile_s,
        "hbm": hbm_bytes,
        "remat_auto": chose[0] if chose else None,
        "fits": None if hbm_bytes is None else memory["total"] <= hbm_bytes,
    }


def base_bill(frozen, frozen_sh) -> dict | None:
    """The frozen base of a PEFT run (None without): its parameters and bytes in all and per
    device, and those of its NF4 weights (QLoRA)."""
    if frozen is None:
        return None
    is_nf4 = lambda x: isinstance(x, nf4.NF4Tensor)  # noqa: E731
    leaves = jax.tree.leaves(frozen, is_leaf=is_nf4)
    shs = jax.tree.leaves(frozen_sh, is_leaf=is_nf4)
    out = {"params": 0, "bytes": 0, "per_device": 0, "nf4_params": 0, "nf4_bytes": 0}
    for leaf, sh in zip(leaves, shs):
        if is_nf4(leaf):
            parts = jax.tree.leaves(leaf)
            nbytes = sum(_bytes(a) for a in parts)
            n = 2 * leaf.codes.size  # two 4-bit codes a byte
            out["nf4_params"] += n
            out["nf4_bytes"] += nbytes
            out["per_device"] += sum(_bytes(a, s) for a, s in zip(parts, jax.tree.leaves(sh)))
        else:
            n, nbytes = leaf.size, _bytes(leaf)
            out["per_device"] += _bytes(leaf, sh)
        out["params"] += n
        out["bytes"] += nbytes
    return out


def _bytes(leaf, sharding=None) -> int:
    shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
    return int(np.prod(shape)) * leaf.dtype.itemsize


def _on_host(sharding) -> bool:
    return getattr(sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")


def memory_bill(state, shardings, axes, grad_sh=None) -> dict:
    """The state's share of one device's memory, in bytes: parameters, gradients (one per
    parameter, in its dtype, sharded as `grad_sh`, by default like the parameter) and the
    optimizer state held in device memory; `host`: the state this device keeps in host memory
    (`optim.offload=host`, and the parameters with `model.param_offload=host`). Plus
    optimizer-state bytes per parameter over the whole model, and over matrices alone (leaves
    whose parameter has two or more dims besides the stacked layer/expert dims), where factored
    optimizers save."""
    params = jax.tree.leaves(state.params)
    param_sh = jax.tree.leaves(shardings.params)
    n_params = sum(p.size for p in params)
    opt_leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    opt_sh = jax.tree.leaves(shardings.opt_state)
    opt_total = sum(_bytes(leaf) for _, leaf in opt_leaves)
    # matrices: state leaves found under a matrix parameter's path, as `state_shardings` finds it
    flat_axes = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))
    matrix_paths = {
        tuple(str(getattr(k, "key", k)) for k in path): leaf.size
        for (path, ax), leaf in zip(flat_axes[0], params)
        if sum(a not in ("layers", "expert") for a in ax) >= 2
    }
    matrix_opt = 0
    for path, leaf in opt_leaves:
        keys = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        if any(keys[i:] in matrix_paths for i in range(len(keys))):
            matrix_opt += _bytes(leaf)

    def per_device(leaves, shs, host=False):
        return sum(_bytes(a, s) for a, s in zip(leaves, shs) if _on_host(s) == host)

    opt = [leaf for _, leaf in opt_leaves]
    return {
        "parameters": per_device(params, param_sh),
        # on the device whatever memory their parameters live in between steps
        "gradients": sum(
            _bytes(a, s)
            for a, s in zip(params, param_sh if grad_sh is None else jax.tree.leaves(grad_sh))
        ),
        "optimizer_state": per_device(opt, opt_sh),
        "host": per_device(opt, opt_sh, host=True) + per_device(params, param_sh, host=True),
        "opt_bytes_per_param": opt_total / n_params,
        "opt_bytes_per_matrix_param": matrix_opt / max(sum(matrix_paths.values()), 1),
    }


def pipeline_report(cfg: config.Config, mesh) -> dict | None:
    """The pipeline's schedule table in numbers (None without stages): ticks, bubble (idle
    share of stage-ticks, and idle per busy tick against the textbook formula), and the peak
    in-flight microbatches per stage (the input slots each device keeps; XLA's memory analysis
    above holds them)."""
    p = mesh.shape["stage"]
    if p == 1:
        return None
    m, v, name = microbatches(cfg), cfg.mesh.virtual_stages, cfg.mesh.pipeline_schedule
    table = schedules.build(name, p, m, v)
    return {
        "schedule": name,
        "stages": p,
        "microbatches": m,
        "virtual": table.virtual,
        "ticks": table.ticks,
        "bubble": table.bubble,
        "bubble_ratio": table.bubble_ratio,
        "formula": schedules.formula(name, p, m, v),
        "in_flight": table.in_flight,
    }


def _pipeline_lines(pp: dict | None) -> list[str]:
    if pp is None:
        return []
    return [
        "",
        f"pipeline    {pp['schedule']}: {pp['stages']} stages x {pp['virtual']} virtual, "
        f"{pp['microbatches']} microbatches, {pp['ticks']} ticks",
        f"  bubble {pp['bubble']:.3f} of stage-ticks; idle per busy tick {pp['bubble_ratio']:.3f} "
        f"(formula {pp['formula']:.3f})",
        f"  in-flight microbatches per stage {list(pp['in_flight'])} (memory above: the "
        "largest stage, every device keeps that many input slots)",
    ]


def format_plan(r: dict) -> str:
    lines = [
        f"mesh        {' x '.join(f'{k}={v}' for k, v in r['mesh'].items() if v > 1) or 'single'}"
        f"  ({r['devices']})",
        f"parameters  {r['params'] + (r['trainable'] if r['base'] else 0):,}",
        *(
            [
                f"trainable   {r['trainable']:,} "
                f"({100 * r['trainable'] / (r['params'] + r['trainable']):.3f}%)"
            ]
            if r["base"]
            else []
        ),
        f"compiled in {r['compile_s']:.1f} s",
        "",
        f"{'parameter':<28} {'shape':<24} {'logical axes':<44} {'spec':<36} per device",
    ]
    for row in r["param_rows"]:
        lines.append(
            f"{row['name']:<28} {str(row['shape']):<24} {str(row['axes']):<44} "
            f"{str(tuple(row['spec'])):<36} {fmt_bytes(row['bytes_per_device'])}"
        )
    m = r["memory"]
    lines += [
        "",
        "memory per device (XLA memory analysis)",
        *(
            f"  {k:<12} {fmt_bytes(m[k])}"
            for k in ("arguments", "outputs", "aliased", "temporaries", "code", "total")
        ),
        "",
        "memory bill per device (state by its shardings; activations: XLA temporaries)",
        *(
            f"  {k.replace('_', ' '):<20} {fmt_bytes(v)}"
            for k, v in (
                ("parameters", r["bill"]["parameters"]),
                ("gradients", r["bill"]["gradients"]),
                ("optimizer_state", r["bill"]["optimizer_state"]),
                ("activations/temps", m["temporaries"]),
                ("in host memory", r["bill"]["host"]),
            )
        ),
        f"  optimizer state per parameter: {r['bill']['opt_bytes_per_param']:.3f} bytes "
        f"({r['bill']['opt_bytes_per_matrix_param']:.3f} over matrices)",
        *vision_lines(r.get("vision"), fmt_bytes),
        *_base_lines(r["base"]),
        *(_quantized_line(**r["quantized"]) if r["quantized"] else []),
        *_pipeline_lines(r.get("pipeline")),
        "",
        f"FLOPs per step  {r['flops_per_step']:.4g}  (6N + attention, all devices)",
        "collectives in the compiled step (static: ops in the layer loop run once per layer)",
    ]
    if not r["collectives"]:
        lines.append("  none")
    for kind, c in sorted(r["collectives"].items()):
        lines.append(f"  {kind:<20} {c['count']:>4} ops  {fmt_bytes(c['bytes'])}")
    if (g := r.get("grad_exchange")) is not None:
        lines.append(
            f"  gradient exchange ({g['method']}): {fmt_bytes(g['sent'])} sent per replica per "
            f"step, {fmt_bytes(g['dense'])} as float32 gradients"
        )
    kv = r["kv_cache"]
    bf16 = kv["per_token"]["bfloat16"]
    lines += ["", "KV cache per token (all layers, scales included; generate.kv_cache_dtype)"]
    lines += [
        f"  {kind:<9} {n:>9,} bytes  {n / bf16:.3f}x bf16" for kind, n in kv["per_token"].items()
    ]
    lines.append(
        f"  {kv['kind']} cache of {kv['tokens']:,} tokens (global batch x max_seq_len): "
        f"{fmt_bytes(kv['bytes_per_device'])} per device"
    )
    if kv["linear_state"]:  # fixed-size, in place of the linear layers' KV cache
        lines.append(
            f"  + linear-attention state of the global batch (any length): "
            f"{fmt_bytes(kv['linear_state_per_device'])} per device"
        )
    if r.get("remat_auto"):
        lines += ["", r["remat_auto"]]
    if r["hbm"] is not None:
        verdict = "FITS" if r["fits"] else "DOES NOT FIT"
        lines += [
            "",
            f"verdict: {verdict}: {fmt_bytes(m['total'])} of {fmt_bytes(r['hbm'])} per device",
        ]
    return "\n".join(lines)


def _quantized_line(how, quantized, quantized_bytes, per_device, total) -> list[str]:
    n, nb = quantized, quantized_bytes
    return [
        f"  quantized weights    {fmt_bytes(per_device)} (all, {fmt_bytes(total)}); {how}: "
        f"{n:,} parameters in {fmt_bytes(nb)}, {8 * nb / n:.3f} bits each"
    ]


def _base_lines(base: dict | None) -> list[str]:
    if base is None:
        return []
    lines = [
        f"  frozen base          {fmt_bytes(base['per_device'])}",
        f"  frozen base: {base['params']:,} parameters in {fmt_bytes(base['bytes'])}, "
        f"{base['bytes'] / base['params']:.3f} bytes per parameter",
    ]
    if base["nf4_params"]:
        lines.append(
            f"    NF4 weights: {base['nf4_params']:,} parameters in "
            f"{fmt_bytes(base['nf4_bytes'])}, {base['nf4_bytes'] / base['nf4_params']:.3f} "
            "bytes per parameter"
        )
    return lines


# Cloud TPU slice names -> (version, topology) for jax.experimental.topologies.
TPU_TARGETS = {
    "tpu-v4-8": "v4:2x2x1",
    "tpu-v4-16": "v4:2x2x2",
    "tpu-v4-32": "v4:2x2x4",
    "tpu-v5p-8": "v5p:2x2x1",
    "tpu-v5p-16": "v5p:2x2x2",
    "tpu-v5p-32": "v5p:2x2x4",
    "tpu-v5e-8": "v5e:2x4",
    "tpu-v5e-16": "v5e:4x4",
    "tpu-v6e-8": "v6e:2x4",
    "tpu-v6e-16": "v6e:4x4",
}


def target_devices(target: str):
    """Devices of a TPU topology (`tpu-v5p-8`, or `v5p:2x2x1` spelled out), for compiling ahead
    of time without the hardware. Needs `libtpu` installed."""
    from jax.experimental import topologies

    name = TPU_TARGETS.get(target, target)
    if ":" not in name:
        raise config.ConfigError(
            f"--target {target!r} is unknown; use one of {', '.join(TPU_TARGETS)} or "
            "VERSION:TOPOLOGY such as v5p:2x2x1."
        )
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as e:  # libtpu missing, or a topology it does not know
        raise config.ConfigError(f"--target {target}: cannot build the TPU topology ({e}).") from e
