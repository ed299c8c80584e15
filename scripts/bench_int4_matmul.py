"""Time the int4 weight-only matmul against the bf16 weight it replaces.

    python scripts/bench_int4_matmul.py [--shapes 2048x2048,2048x8192,8192x2048,2048x128256]
        [--batch 1,16] [--group 128] [--backends triton,xla] [--interpret] [--iters 50]

Each shape KxN is one weight of a model (defaults: Llama-3.2-1B's q/o, gate/up, down and LM
head). For each batch M it times y = x [M, K] @ W three ways: `bf16` (a bf16 weight, one dot),
and `int4-<backend>` for each backend of `jaxllm.kernels.int4_matmul` (`triton`: the Pallas
kernel; `xla`: dequantize then dot, fused as XLA sees fit), each jitted, warmed up and timed
over --iters calls (the median). It prints ms per call, the bytes of weight read (bf16: 2 per
weight; int4: half a byte plus the group scales) and the speed-up over bf16. A decode step at
batch 1 is memory-bound, so the goal is the bytes' ratio, near 4x. On CPU, `--interpret` with
small shapes is a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jaxllm.kernels.int4_matmul import int4_matmul

from jaxllm.bench import median_seconds
from jaxllm.model import quantized


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2048x2048,2048x8192,8192x2048,2048x128256")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--backends", default="triton,xla")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)
    rows = []
    print("| K x N | M | kind | ms | weight MB read | speed-up vs bf16 |")
    print("|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        k, n = map(int, shape.split("x"))
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
        t = quantized.quantize(w, bits=4, group=a.group, symmetric=True, n_in=1, n_out=1)
        t = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, t)
        w16 = w.astype(jnp.bfloat16)
        for m in map(int, a.batch.split(",")):
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            bf16 = median_seconds(jax.jit(jnp.dot), x, w16, iters=a.iters)
            cases = [("bf16", bf16, w16.nbytes)]
            for backend in a.backends.split(","):
                fn = jax.jit(
                    lambda x, c, s, b=backend: int4_matmul(
                        x, c, s, backend=b, interpret=a.interpret
                    )
                )
                ms = median_seconds(fn, x, t.codes, t.scales, iters=a.iters)
                cases.append((f"int4-{backend}", ms, t.codes.nbytes + t.scales.nbytes))
            for kind, secs, nbytes in cases:
                row = {"k": k, "n": n, "m": m, "kind": kind, "ms": secs * 1e3,
                       "weight_bytes": nbytes, "speedup": bf16 / secs}  # fmt: skip
                rows.append(row)
                print(
                    f"| {k} x {n} | {m} | {kind} | {row['ms']:.4f} | {nbytes / 1e6:.2f} | "
                    f"{row['speedup']:.2f}x |"
                )
    print(f"device: {jax.devices()[0].device_kind}")
    return rows


if __name__ == "__main__":
    main()
