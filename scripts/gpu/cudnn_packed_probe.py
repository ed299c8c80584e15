"""Does cuDNN's fused attention take packed documents (segment offsets), and at what cost?

    python scripts/gpu/cudnn_packed_probe.py [HEAD_DIM]   (on a CUDA GPU; default 64)


Compares, on one bf16 causal shape, the xla reference with packed segments against cuDNN given
the segments as ragged offsets (max segments M static), forward and gradients, and times cuDNN
without segments, with offsets at M = 16 and M = L, and the flash kernel."""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention
from jaxllm.kernels import flash_attention, flash_attention_reference

from jaxllm.model.cudnn import segment_offsets


def timed(f, *a, n=20):
    for _ in range(3):
        jax.block_until_ready(f(*a))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(*a)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts) * 1e3


def main():
    b, l, h, g, k = 4, 4096, 32, 8, int(sys.argv[1]) if len(sys.argv) > 1 else 64
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, l, h, k), jnp.bfloat16)
    kk = jax.random.normal(ks[1], (b, l, g, k), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, l, g, k), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, l, h, k), jnp.bfloat16)
    cuts = np.array([[700, 1900, 2600], [100, 3000, 3001], [4000, 4001, 4002], [1, 2, 4095]])
    seg = jnp.asarray(np.stack([np.searchsorted(c, np.arange(l), side="right") for c in cuts]))
    seg = seg.astype(jnp.int32) + 1

    def cud(m, mask_type):
        def f(q, kk, v):
            if m is None:
                return cudnn_attention(q, kk, v, scale=k**-0.5, mask_type=MaskType.CAUSAL)
            lens, offs, _ = segment_offsets(seg, m)
            return cudnn_attention(
                q,
                kk,
                v,
                q_seqlen=lens,
                kv_seqlen=lens,
                q_offsets=offs,
                kv_offsets=offs,
                scale=k**-0.5,
                mask_type=mask_type,
            )

        return f

    def ref(q, kk, v):
        return flash_attention_reference(q, kk, v, causal=True, segment_ids=seg)

    def fl(q, kk, v):
        return flash_attention(q, kk, v, causal=True, segment_ids=seg)

    def fl0(q, kk, v):
        return flash_attention(q, kk, v, causal=True)

    def grads(f):
        @jax.jit
        def g_(q, kk, v, do):
            o, vjp = jax.vjp(f, q, kk, v)
            return (o, *vjp(do))

        return g_

    want = grads(lambda *a: ref(*[x.astype(jnp.float32) for x in a]))(
        *[x.astype(jnp.float32) for x in (q, kk, v, do)]
    )

    def rel(a, r):
        return float(
            jnp.linalg.norm((a.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel())
        )

    cands = {
        "cudnn causal, no segments": cud(None, None),
        "cudnn packed M=16 PADDING_CAUSAL": cud(16, MaskType.PADDING_CAUSAL),
        "cudnn packed M=16 CAUSAL": cud(16, MaskType.CAUSAL),
        "cudnn packed M=L PADDING_CAUSAL": cud(l, MaskType.PADDING_CAUSAL),
        "flash packed": fl,
        "flash no segments": fl0,
        "xla reference packed (bf16)": ref,
    }
    print(f"B {b} L {l} H {h} G {g} K {k} bf16 causal; relative error vs f32 reference (packed)")
    for name, f in cands.items():
        try:
            got = grads(f)(q, kk, v, do)
            errs = " ".join(f"{n}={rel(a, r):.2e}" for n, a, r in zip("oqkv", got, want))
            tf = timed(jax.jit(f), q, kk, v)
            tb = timed(grads(f), q, kk, v, do)
            print(f"{name:<36} fwd {tf:7.3f} ms  fwd+bwd {tb:7.3f} ms  {errs}")
        except Exception as e:  # noqa: BLE001
            print(f"{name:<36} FAILED {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
