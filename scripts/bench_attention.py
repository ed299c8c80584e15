"""Benchmark attention implementations: forward and forward+backward TFLOP/s.

    python scripts/bench_attention.py [--impls flash,flash_ws,flash_ws_fused,cudnn,xla]
        [--seqs 2048,4096,8192,16384]
        [--head-dim 128] [--tokens 16384] [--hidden 2048] [--kv-heads N] [--no-causal]
        [--flash-backend mosaic_gpu|triton|mosaic_tpu] [--block-q 64 --block-kv 64]
        [--dtype bfloat16] [--interpret] [--iters 10]

The FlashAttention papers' setting: batch x seq = --tokens (16k), heads = --hidden / head_dim
(16 at head_dim 128), bf16, causal. FLOPs counted as 4 * S^2 * D * H * B per forward (half of
it when causal) and 2.5x that for the backward, so forward+backward is 3.5x the forward.

Implementations: `flash` (`jaxllm.kernels.flash_attention`; its backend is the platform default
unless --flash-backend says otherwise), `flash_ws` (the warp-specialised Mosaic GPU forward,
`BlockSizes(..., warp_specialized=True)`, with --block-q / --block-kv or 128 / 128, and the
two-kernel FlashAttention-2 Mosaic GPU backward), `flash_ws_fused` (the same forward with the
fused one-kernel backward, `fused_backward=True`), `cudnn` and `xla`
(`jax.nn.dot_product_attention` with that `implementation`). Each is jitted, warmed up and timed over --iters calls (median). An
implementation that fails (e.g. cudnn without a GPU) is reported as such, not skipped silently.
Public anchors on H100 SXM, head_dim 128, 16k, causal forward: FlashAttention-3 ~616 TFLOP/s,
cuDNN ~539, FlashAttention-2 ~335. On CPU, `--interpret` with tiny sizes is a smoke test only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from jaxllm.kernels import BlockSizes, flash_attention


def attention_fn(impl: str, *, causal: bool, flash_backend, block_sizes, interpret: bool):
    if impl in ("flash_ws", "flash_ws_fused"):
        return lambda q, k, v: flash_attention(
            q,
            k,
            v,
            causal=causal,
            block_sizes=block_sizes,
            interpret=interpret,
            backend="mosaic_gpu",
        )
    if impl == "flash":
        return lambda q, k, v: flash_attention(
            q,
            k,
            v,
            causal=causal,
            block_sizes=block_sizes,
            interpret=interpret,
            backend=flash_backend,
        )
    if impl in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl
        )
    raise ValueError(f"unknown implementation {impl!r}")


def time_call(fn, args, warmup: int, iters: int, reps: int = 3) -> float:
    """Median over `reps` of (time of `iters` back-to-back calls) / iters."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default="flash,cudnn,xla")
    p.add_argument("--seqs", default="2048,4096,8192,16384")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16384, help="batch x seq")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head_dim")
    p.add_argument("--kv-heads", type=int, help="default: heads (MHA)")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--flash-backend")
    p.add_argument("--block-q", type=int)
    p.add_argument("--block-kv", type=int)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    ns = p.parse_args(argv)

    causal = not ns.no_causal
    d = ns.head_dim
    h = ns.hidden // d
    g = ns.kv_heads or h
    dtype = jnp.dtype(ns.dtype)
    blocks = BlockSizes(ns.block_q, ns.block_kv) if ns.block_q and ns.block_kv else None
    ws_blocks = BlockSizes(ns.block_q or 128, ns.block_kv or 128, warp_specialized=True)
    impl_blocks = dict(
        flash_ws=ws_blocks, flash_ws_fused=dataclasses.replace(ws_blocks, fused_backward=True)
    )
    print(
        f"device: {jax.devices()[0].device_kind}; heads {h} (kv {g}), head_dim {d}, "
        f"{'causal' if causal else 'full'}, {dtype.name}"
    )
    print(
        f"{'impl':<14} {'seq':>6} {'batch':>5} {'fwd ms':>9} {'fwd TF/s':>9} "
        f"{'fwd+bwd ms':>11} {'fwd+bwd TF/s':>12}"
    )
    rows = []
    for s in (int(x) for x in ns.seqs.split(",")):
        b = max(1, ns.tokens // s)
        keys = jax.random.split(jax.random.key(s), 4)
        q = jax.random.normal(keys[0], (b, s, h, d), dtype)
        k = jax.random.normal(keys[1], (b, s, g, d), dtype)
        v = jax.random.normal(keys[2], (b, s, g, d), dtype)
        do = jax.random.normal(keys[3], (b, s, h, d), dtype)
        fwd_flops = 4 * s * s * d * h * b * (0.5 if causal else 1.0)
        for impl in ns.impls.split(","):
            fn = attention_fn(
                impl,
                causal=causal,
                flash_backend=ns.flash_backend,
                block_sizes=impl_blocks.get(impl, blocks),
                interpret=ns.interpret,
            )
            fwd = jax.jit(fn)

            @jax.jit
            def fwd_bwd(q, k, v, do, fn=fn):
                out, vjp = jax.vjp(fn, q, k, v)
                return out, vjp(do)

            row = {"impl": impl, "seq": s, "batch": b}
            try:
                row["fwd_s"] = time_call(fwd, (q, k, v), ns.warmup, ns.iters)
                row["fwd_bwd_s"] = time_call(fwd_bwd, (q, k, v, do), ns.warmup, ns.iters)
            except Exception as e:  # noqa: BLE001 - report, e.g. cudnn on a machine without it
                print(f"{impl:<14} {s:>6} {b:>5}  failed: {type(e).__name__}: {str(e)[:90]}")
                row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                continue
            row["fwd_tflops"] = fwd_flops / row["fwd_s"] / 1e12
            row["fwd_bwd_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_s"] / 1e12
            rows.append(row)
            print(
                f"{impl:<14} {s:>6} {b:>5} {row['fwd_s'] * 1e3:>9.3f} "
                f"{row['fwd_tflops']:>9.1f} {row['fwd_bwd_s'] * 1e3:>11.3f} "
                f"{row['fwd_bwd_tflops']:>12.1f}"
            )
    return rows


if __name__ == "__main__":
    main()
