"""Time one SwiGLU MLP layer's forward + backward in bf16 and under each fp8 scaling.

    python scripts/bench_fp8.py [--shapes 2048x8192,4096x14336] [--tokens 8192]
        [--scalings current,blockwise,delayed] [--iters 20]

Each shape DxF is a model width and MLP width (defaults: Llama-3.2-1B and Llama-3.1-8B). For
each it times the gradient of sum(down(silu(x gate) * (x up))) with respect to x and the three
weights, through `layers.matmul` (the model's one matmul seam): `bf16` (bf16 operands, the
compute dtype), then `fp8-<scaling>` for each `model.fp8_scaling` (`current`: per-tensor;
`blockwise`: DeepSeek-V3's 1x128 / 128x128 tiles; `delayed`: per-tensor scales from a full
amax history, Transformer Engine's recipe). Each is jitted, warmed up and timed over
--iters calls (the median); it prints ms, TFLOP/s (3 matmuls, forward and backward: 18 M D F
flops) and the speed-up over bf16. A shape that fails (out of memory) prints its error and the
rest go on. On CPU, fp8 is emulated: small shapes there are a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxllm.bench import median_seconds
from jaxllm.model import fp8_delayed, layers


def _history(x, w, top_grad: float = 1.0) -> jax.Array:
    """A full amax history ([3, 1024]: the input's, the weight's and an output gradient's amax
    in every column), as delayed scaling holds it after 1024 steps."""
    amax = jnp.stack([jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w)), jnp.float32(top_grad)])
    return jnp.broadcast_to(amax.astype(jnp.float32)[:, None], (3, 1024))


def _layer_grad(fp8: str | None):
    def loss(x, gate, up, down):
        def mm(spec, a, w):
            if fp8 == "delayed":  # the weight with its history, as `lora.kernel` hands it
                w = fp8_delayed.DelayedKernel(w, jax.lax.stop_gradient(_history(a, w)))
            return layers.matmul(spec, a, w, jnp.bfloat16, fp8=fp8)

        h = jax.nn.silu(mm("md,df->mf", x, gate)) * mm("md,df->mf", x, up)
        return jnp.sum(mm("mf,fd->md", h, down).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="2048x8192,4096x14336")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--scalings", default="current,blockwise,delayed")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    rows = []
    print("| D x F | tokens | kind | ms | TFLOP/s | speed-up vs bf16 |")
    print("|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        d, f = map(int, shape.split("x"))
        keys = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(keys[0], (a.tokens, d), jnp.bfloat16)
        gate, up = (jax.random.normal(k, (d, f), jnp.bfloat16) * d**-0.5 for k in keys[1:3])
        down = jax.random.normal(keys[3], (f, d), jnp.bfloat16) * f**-0.5
        flops = 18 * a.tokens * d * f
        bf16 = None
        for kind in ["bf16", *(f"fp8-{s}" for s in a.scalings.split(","))]:
            fp8 = None if kind == "bf16" else kind.removeprefix("fp8-")
            try:
                secs = median_seconds(_layer_grad(fp8), x, gate, up, down, iters=a.iters)
            except Exception as e:  # out of memory at a large shape: report it, go on
                print(f"| {d} x {f} | {a.tokens} | {kind} | failed: {str(e).splitlines()[0]} |")
                continue
            bf16 = secs if kind == "bf16" else bf16
            row = {"d": d, "f": f, "tokens": a.tokens, "kind": kind, "ms": secs * 1e3,
                   "tflops": flops / secs / 1e12, "speedup": bf16 / secs if bf16 else None}  # fmt: skip
            rows.append(row)
            speedup = f"{row['speedup']:.2f}x" if bf16 else "-"
            print(
                f"| {d} x {f} | {a.tokens} | {kind} | {row['ms']:.3f} | {row['tflops']:.1f} | "
                f"{speedup} |"
            )
    print(f"device: {jax.devices()[0].device_kind}")
    return rows


if __name__ == "__main__":
    main()
