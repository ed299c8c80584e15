"""Benchmark one decode step of `decode_attention` per cache kind and context length.

    python scripts/bench_decode.py [--kinds bfloat16,int8,int4,int2] [--contexts 4096,32768,131072]
        [--batch 8] [--heads 32] [--kv-heads 8] [--head-dim 128] [--queries 1] [--page-size N]
        [--backend triton|mosaic_tpu|xla] [--interpret] [--iters 20]

Defaults are one Llama-3-8B attention layer (H 32, G 8, K 128) with every sequence filled to
the context length. Each configuration is jitted, warmed up, then timed over --iters steps
(block_until_ready each; the median is reported). The table gives ms/step, tokens/s (batch /
step time), the cache bytes one step must read (codes + scales at their stored dtypes, plus
the int4 residual), the bandwidth that implies, its share of the device's peak HBM bandwidth
where known (H100 SXM, H200), and the speed-up over the bf16 cache at the same context.

Decode is memory-bound: the step time should follow the bytes read, so int8 (~0.5x bytes of
bf16 at K = 128) and int4 (~0.3x) should approach 2x and 3x. On CPU, `--interpret` with tiny
sizes is a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jaxllm.kernels.decode_attention import KVCache, cache_bytes_per_token, decode_attention
from jaxllm.kernels.decode_attention.quant import codes_per_byte

# Peak HBM bandwidth (bytes/s) by device kind substring.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def peak_bandwidth(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, peak in PEAK_BANDWIDTH.items():
        if name in kind:
            return peak
    return None


def random_cache(key, kind, *, batch, kv_heads, context, head_dim, group, page_size):
    """A cache of random codes and scales (timing does not depend on the values), contiguous
    or in `page_size`-token pages with a shuffled block table."""
    rows, lead = context, (batch,)
    table = None
    if page_size:
        per_seq = context // page_size
        rows, lead = page_size, (batch * per_seq,)
        perm = jax.random.permutation(jax.random.fold_in(key, 1), batch * per_seq)
        table = perm.reshape(batch, per_seq).astype(jnp.int32)
    ks = iter(jax.random.split(key, 8))

    def normal(*shape, dtype=jnp.bfloat16):
        return jax.random.normal(next(ks), (*lead, kv_heads, *shape), jnp.float32).astype(dtype)

    def codes(*shape, dtype):
        bits = jax.random.bits(next(ks), (*lead, kv_heads, *shape), jnp.uint8)
        return bits.astype(dtype) if dtype != jnp.int8 else (bits // 2).astype(jnp.int8)

    d, gv = head_dim, min(group, head_dim)
    if kind in ("bfloat16", "float32"):
        f = dict(k=normal(rows, d, dtype=kind), v=normal(rows, d, dtype=kind))
    elif kind == "int8":
        f = dict(
            k=codes(rows, d, dtype=jnp.int8),
            v=codes(rows, d, dtype=jnp.int8),
            k_scale=normal(rows),
            v_scale=normal(rows),
        )
    else:
        res = jax.random.normal(next(ks), (batch, kv_heads, group, d), jnp.bfloat16)
        f = dict(
            k=codes(rows, d // codes_per_byte(kind), dtype=jnp.uint8),
            v=codes(rows, d // codes_per_byte(kind), dtype=jnp.uint8),
            k_scale=normal(rows // group, d),
            k_zero=normal(rows // group, d),
            v_scale=normal(rows, d // gv),
            v_zero=normal(rows, d // gv),
            k_res=res,
            v_res=res,
        )
    return KVCache(kind=kind, group=group, block_table=table, **f)


def bytes_per_step(kind, *, batch, kv_heads, context, head_dim, group) -> int:
    """Cache bytes one step reads: every live token's codes and scales at their stored dtypes
    (int8 / int4 codes at 1 / 0.5 byte a channel, bf16 scales and zeros) + the KIVI residual;
    with every sequence at `context` tokens, the bytes of the cache arrays themselves."""
    total = batch * context * cache_bytes_per_token(kind, kv_heads, head_dim, group)
    if kind in ("int4", "int2"):
        total += batch * kv_heads * group * head_dim * 2 * 2  # bf16 k_res and v_res
    return total


def time_step(fn, args, *, warmup: int, iters: int, reps: int = 5) -> float:
    """Median over `reps` of (time of `iters` back-to-back calls) / iters: the calls queue on
    the device, so a step of a few microseconds is not hidden behind one dispatch each."""
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


def default_backend(interpret: bool) -> str:
    platform = jax.default_backend()
    if platform == "gpu":
        return None  # the op's own choice: the Triton kernel on CUDA GPUs
    if platform == "tpu" or interpret:
        return "mosaic_tpu"
    return "xla"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="bfloat16,int8,int4")
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--batch", default="8", help="one or more, comma-separated")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1, help="new tokens per step (Q)")
    p.add_argument("--group", type=int, default=32, help="int4 / int2 group size")
    p.add_argument("--page-size", type=int, default=0, help="0: contiguous cache")
    p.add_argument(
        "--backend", default=None, help="default: the op's choice on GPU, mosaic_tpu on TPU"
    )
    p.add_argument("--block-kv", type=int, default=None)
    p.add_argument("--num-splits", type=int, default=None)
    p.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU smoke)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    backend = args.backend or default_backend(args.interpret)
    device = jax.devices()[0]
    peak = peak_bandwidth(device)
    kinds = args.kinds.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    h, g, d = args.heads, args.kv_heads, args.head_dim
    print(
        f"device {device.device_kind} | backend {backend or 'default'} | B {args.batch} H {h} G {g} K {d} "
        f"Q {args.queries} | {'paged ' + str(args.page_size) if args.page_size else 'contiguous'}"
    )
    head = f"{'kind':>9} {'context':>8} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} "
    head += f"{'MB read':>9} {'GB/s':>8} {'% peak':>7} {'vs bf16':>8}"
    print(head)

    step = jax.jit(
        lambda q, cache, lengths: decode_attention(
            q,
            cache,
            lengths,
            block_kv=args.block_kv,
            num_splits=args.num_splits,
            interpret=args.interpret,
            backend=backend,
        )
    )
    rows = []
    for b in batches:
        for context in contexts:
            base = None
            for i, kind in enumerate(kinds):
                key = jax.random.key(i)
                cache = jax.jit(
                    lambda key, kind=kind, context=context: random_cache(
                        key,
                        kind,
                        batch=b,
                        kv_heads=g,
                        context=context,
                        head_dim=d,
                        group=args.group,
                        page_size=args.page_size,
                    )
                )(key)
                q = jax.random.normal(key, (b, args.queries, h, d), jnp.bfloat16)
                lengths = jnp.full((b,), context, jnp.int32)
                seconds = time_step(step, (q, cache, lengths), warmup=args.warmup, iters=args.iters)
                nbytes = bytes_per_step(
                    kind, batch=b, kv_heads=g, context=context, head_dim=d, group=args.group
                )
                if kind == "bfloat16":
                    base = seconds
                row = dict(
                    kind=kind,
                    context=context,
                    batch=b,
                    ms=seconds * 1e3,
                    tokens_per_s=b / seconds,
                    bytes=nbytes,
                    gb_per_s=nbytes / seconds / 1e9,
                    peak_pct=None if peak is None else 100 * nbytes / seconds / peak,
                    speedup=None if base is None else base / seconds,
                )
                rows.append(row)
                pct = "-" if row["peak_pct"] is None else f"{row['peak_pct']:.0f}"
                vs = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
                print(
                    f"{kind:>9} {context:>8} {b:>5} {row['ms']:>9.3f} {row['tokens_per_s']:>10.0f} "
                    f"{nbytes / 1e6:>9.1f} {row['gb_per_s']:>8.1f} {pct:>7} {vs:>8}"
                )
                del cache
    return rows


if __name__ == "__main__":
    main()
