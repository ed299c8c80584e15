"""`jaxllm bench train`: step time, throughput, FLOPs and MFU of any config, on synthetic tokens.

Analytic FLOPs come from `jaxllm.metrics.flops_per_token`; compiled FLOPs from XLA's cost
analysis of the very program that runs. Their ratio checks the analytic model (and shows
rematerialisation, which adds recomputed forward FLOPs to the compiled count).

Speed does not depend on what the weights are, so the inference benchmarks can run a model of
random weights (`random_weights`), in memory or as a run directory (`write_random_run`, with a
word-level tokenizer of the model's vocabulary): a model's shape, such as Llama-3.2-1B's, is
measured with no download and no training.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxllm import checkpoint, config, sharding
from jaxllm.config import ConfigError
from jaxllm.config.pipeline import microbatches
from jaxllm.data import span_corruption
from jaxllm.metrics import flops_per_token, param_counts, peak_flops
from jaxllm.model.abstract import abstract_model, abstract_model_state
from jaxllm.model.transformer import build, init_keys, split_peft
from jaxllm.sharding import to_global
from jaxllm.train import loss_scale, remat_auto
from jaxllm.train.compiled import compile_steps
from jaxllm.train.state import init_state, layout


def median_seconds(fn, *args, iters: int) -> float:
    """The median wall time of `fn(*args)` over `iters` calls, after one warm-up (compile)
    call, each waited for (`jax.block_until_ready`): the kernel and layer benchmarks' clock."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_description() -> str:
    """The first device in words, for a benchmark's record: the CPU's name and cores, or the
    accelerator's kind and count."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return f"{device.device_kind} x {jax.device_count()}"


def script_main(main) -> None:
    """Runs a benchmark script's `main()`; a bad argument or input (ConfigError) is one
    `jaxllm:` line and exit 2."""
    try:
        main()
    except ConfigError as e:
        print(f"jaxllm: {e}", file=sys.stderr)
        sys.exit(2)


# The specials of `word_tokenizer`, the last two ids (Llama 3's names, which jaxllm finds)
WORD_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")


def random_weights(cfg: config.Config, mesh, seed: int = 0) -> tuple[dict, dict]:
    """(params, model state) of `cfg.model` as a fresh run of `seed` starts them (untrained),
    each leaf created in its shards on `mesh` (`jit` with `out_shardings`)."""
    _, _, axes = abstract_model(cfg.model)
    _, ms_axes = abstract_model_state(cfg.model)
    shardings = tuple(sharding.tree_shardings(mesh, a) for a in (axes, ms_axes))

    def init():
        _, params, _, model_state = split_peft(build(cfg.model, init_keys(seed)[0]), None)
        return params, model_state

    return jax.jit(init, out_shardings=shardings)()


def word_tokenizer(path: Path, vocab_size: int) -> Path:
    """Writes a tokenizer.json of exactly `vocab_size` ids: words `w0` .. `w{n-3}` split at
    whitespace, then BOS and EOS (`WORD_SPECIALS`). Every other id decodes to text, so a random
    model's tokens stream as text through `jaxllm serve`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    if vocab_size < 3:
        raise ConfigError(f"a word tokenizer needs a vocabulary of 3 or more, not {vocab_size}.")
    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab |= {name: vocab_size - 2 + i for i, name in enumerate(WORD_SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(name, special=True) for name in WORD_SPECIALS])
    tok.save(str(path))
    return path


def write_random_run(out: Path, model_yaml=None, overrides=(), seed: int = 0) -> Path:
    """A run directory OUT of random weights (`random_weights`): config.yaml (`model_yaml`, or
    the defaults, with `overrides`), a word tokenizer of the model's vocabulary and a
    weights-only checkpoint at step 0, which `generate`, `quantize`, `serve` and `load_model`
    read like any run. ConfigError when OUT holds files."""
    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} holds files; name a new directory for the random run.")
    tok = out / "tokenizer.json"
    cfg = config.load(model_yaml, [*overrides, f"run.dir={out}", f"data.tokenizer={tok}"])
    out.mkdir(parents=True, exist_ok=True)
    word_tokenizer(tok, cfg.model.vocab_size)
    mesh = sharding.make_mesh(cfg.mesh)
    params, model_state = random_weights(cfg, mesh, seed)
    checkpoint.save_params(
        checkpoint.checkpoint_dir(out, cfg.checkpoint.dir),
        params,
        step=0,
        model_state=model_state,
        config=config.to_dict(cfg),
        tokenizer=checkpoint.tokenizer_record(str(tok)),
    )
    config.dump(cfg, out / "config.yaml")
    return out


def synthetic_batch(cfg: config.Config, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b, l = cfg.train.global_batch_size, cfg.data.seq_len
    if cfg.train.objective == "span_corruption":  # encoder and decoder arrays, no padding
        lengths = span_corruption.batch_lengths(cfg.data)
        return {
            k: np.ones((b, n), np.int32)
            if k in ("segment_ids", "loss_mask")
            else rng.integers(0, 256, (b, n), dtype=np.int32)
            for k, n in lengths.items()
        }
    tokens = rng.integers(0, 256, size=(b, l + 1), dtype=np.int32)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((b, l), np.int32),
        "positions": np.broadcast_to(np.arange(l, dtype=np.int32), (b, l)).copy(),
        "loss_mask": np.ones((b, l), np.int32),
    }
    if cfg.train.objective == "prefix_lm":  # the first half of each row read bidirectionally
        batch["prefix"] = (batch["positions"] < l // 2).astype(np.int32)
    return batch


def _compiled_flops(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def compiled_step_flops(cfg: config.Config, mesh) -> float | None:
    """FLOPs of one train step from XLA's cost analysis, for all devices together.

    XLA counts a while-loop body once, whatever its trip count, so this analyses the same step
    with the layer scan fully unrolled and one microbatch, and scales by the microbatch count.
    """
    accum = microbatches(cfg)
    cost_cfg = dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, pipeline_microbatches=None),
        model=dataclasses.replace(cfg.model, scan_unroll=cfg.model.num_layers),
        train=dataclasses.replace(
            cfg.train, grad_accum_steps=1, global_batch_size=cfg.train.global_batch_size // accum
        ),
    )
    jit_train, _, tx, shardings, batch_sh = compile_steps(cost_cfg, mesh)
    scaling = loss_scale.from_config(cost_cfg.optim, cost_cfg.model)
    abstract_state = jax.eval_shape(
        lambda: init_state(cost_cfg.model, tx, mesh, 0, scaling, **layout(cost_cfg))
    )
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    batch = to_global(synthetic_batch(cost_cfg), batch_sh)
    per_device = _compiled_flops(jit_train.lower(abstract_state, batch).compile())
    return None if per_device is None else per_device * mesh.size * accum


def device_op_summary(trace_dir: str, top: int = 15) -> list[tuple[str, float, int]]:
    """(name, total ms, count) of the `top` device ops by total time in the Perfetto trace that
    `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote: the complete events of
    the `/device:` processes (GPU kernels, TPU ops), summed over every stream. Empty when the
    trace has no device events (the CPU client records host activity only)."""
    paths = sorted(Path(trace_dir).glob("**/perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }
    totals: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids:
            entry = totals.setdefault(e["name"], [0.0, 0])
            entry[0] += float(e.get("dur", 0.0)) / 1e3  # microseconds -> ms
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(name, ms, count) for name, (ms, count) in ranked]


def format_summary(rows: list[tuple[str, float, int]], steps: int) -> str:
    if not rows:
        return "profile: no device ops in the trace (a CPU run records host activity only)"
    total = sum(ms for _, ms, _ in rows)
    lines = [f"top device ops over {steps} profiled steps (ms per step, share of these rows)"]
    for name, ms, count in rows:
        lines.append(
            f"  {ms / steps:9.2f} ms {100 * ms / total:5.1f}%  x{count // steps:<5} {name[:90]}"
        )
    return "\n".join(lines)


def bench_train(
    cfg: config.Config,
    steps: int = 10,
    warmup: int = 2,
    compiled_flops: bool = True,
    profile_dir: str | None = None,
) -> dict:
    devices = jax.devices()
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    cfg = remat_auto.resolve(cfg, mesh)  # model.remat=auto: the policy the budget allows
    jit_train, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    state = init_state(cfg.model, tx, mesh, cfg.run.seed, scaling, **layout(cfg))
    batch = to_global(synthetic_batch(cfg), batch_sh)

    t0 = time.perf_counter()
    compiled = jit_train.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0

    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)

    profile = None
    if profile_dir is not None:  # two more steps under the profiler, after the timed ones
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(2):
                state, metrics = compiled(state, batch)
                jax.block_until_ready(metrics)
        profile = format_summary(device_op_summary(profile_dir), 2)

    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    step_s = statistics.median(times)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    analytic = fpt["total"] * tokens
    compiled_total = compiled_step_flops(cfg, mesh) if compiled_flops else None
    peak = peak_flops(devices[0].device_kind)
    result = {
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "params": param_counts(cfg.model)["total"],
        "compile_s": compile_s,
        "step_time_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_flops_per_token": fpt["total"],
        "analytic_flops_per_step": analytic,
        "compiled_flops_per_step": compiled_total,
        "compiled_over_analytic": compiled_total / analytic if compiled_total else None,
        "mfu": analytic / step_s / (peak * len(devices)) if peak else None,
        "final_loss": float(metrics["loss"]),
        "profile": profile,
    }
    return result


def format_result(r: dict) -> str:
    na = "n/a"
    compiled = r["compiled_flops_per_step"]
    ratio = r["compiled_over_analytic"]
    mfu = "n/a (no known peak for this device)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return "\n".join(
        [
            f"device                 {r['device']}",
            f"parameters             {r['params']:,}",
            f"compile time           {r['compile_s']:.2f} s",
            f"median step time       {r['step_time_s'] * 1e3:.1f} ms",
            f"tokens/s               {r['tokens_per_s']:,.0f}",
            f"model FLOPs/token      {r['model_flops_per_token']:.4g}  (6N + attention)",
            f"analytic FLOPs/step    {r['analytic_flops_per_step']:.4g}",
            f"compiled FLOPs/step    {na if compiled is None else f'{compiled:.4g}'}  (XLA cost analysis)",
            f"compiled / analytic    {na if ratio is None else f'{ratio:.3f}'}",
            f"MFU                    {mfu}",
            *([r["profile"]] if r.get("profile") else []),
        ]
    )
