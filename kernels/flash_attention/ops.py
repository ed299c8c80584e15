"""`flash_attention`: the public, differentiable FlashAttention-2 op (arXiv:2307.08691).

Layout of `jax.nn.dot_product_attention`: q [B, L, H, K], k/v [B, S, G, K] with H a multiple of G
(MHA G = H, GQA, MQA G = 1; kv head g serves query heads g * R .. g * R + R - 1, R = H / G).

Backends (`backend=`):
- `"mosaic_tpu"`: Pallas Mosaic TPU kernels; the default when `jax.default_backend()` is TPU.
- `"triton"`: Pallas Triton kernels for CUDA GPUs, only when asked for explicitly. JAX deprecates
  Pallas-on-Triton from 0.11, and its default GPU lowering (Mosaic GPU) needs a different kernel
  style (`plgpu.kernel`, warpgroups) that is not written yet.
- `"xla"`: `flash_attention_reference` (materialises [B, H, L, S] scores in float32); the default
  on GPU and on CPU without `interpret`.
`interpret=True` runs the kernels of the chosen backend (Mosaic TPU when `backend` is None) in the
Pallas interpreter, on any platform (CPU tests).

Masks, all combinable: `causal` (query i sees keys j <= i, indices aligned at 0 as in
`jaxllm.model.attention`), `sliding_window` w (additionally i - w < j; without `causal`,
|i - j| < w), `segment_ids` (packed documents: a query sees only keys of its own segment).
`soft_cap` c replaces each logit s by c * tanh(s / c) (Gemma 2). A row with no visible key
returns 0 (and zero gradients), never NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxllm.kernels.flash_attention import kernel
from jaxllm.kernels.flash_attention.reference import (
    flash_attention_reference,
    split_segment_ids,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows of q (`block_q`) and of k/v (`block_kv`) per kernel block.

    Defaults per backend: Mosaic TPU 128 / 128 (one MXU tile; lane-dense segment-id slices),
    Triton 64 / 64 (keeps the f32 [64, 64] tiles and a K <= 128 accumulator in registers).
    Both are clipped to the padded sequence length for short sequences; Triton needs powers of 2.
    """

    block_q: int
    block_kv: int

    @classmethod
    def default(cls, backend: str) -> BlockSizes:
        return cls(64, 64) if backend == "triton" else cls(128, 128)


def _resolve_backend(backend: str | None, interpret: bool) -> str:
    if backend is None:
        platform = jax.default_backend()
        backend = "mosaic_tpu" if platform == "tpu" or interpret else "xla"
    if backend not in (*kernel.BACKENDS, "xla"):
        raise ValueError(f"unknown backend {backend!r}; expected mosaic_tpu, triton or xla")
    return backend


def _block(requested: int, length: int) -> int:
    """Short sequences get one block of the next power of 2 (>= 8 sublanes) instead of a mostly
    padded full-size block."""
    return max(8, min(requested, pl.next_power_of_2(length)))


def _pad_to(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def flash_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    causal: bool = False,
    segment_ids=None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    backend: str | None = None,
) -> jax.Array:
    """softmax(mask(cap(q k^T * sm_scale))) v, differentiable in q, k and v.

    segment_ids: None, an int [B, L] array shared by q and kv (needs L == S), or a pair
    (q_ids [B, L], kv_ids [B, S]). sm_scale defaults to K ** -0.5. Returns [B, L, H, K] in q's
    dtype; inputs may be float32 or bfloat16 (accumulation is float32 either way).
    """
    b, l, h, d = q_BxLxHxK.shape
    s, g = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    if k_BxSxGxK.shape != (b, s, g, d) or v_BxSxGxK.shape != k_BxSxGxK.shape:
        raise ValueError(f"bad shapes q {q_BxLxHxK.shape} k {k_BxSxGxK.shape} v {v_BxSxGxK.shape}")
    if h % g:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {g}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    backend = _resolve_backend(backend, interpret)
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    if backend == "xla":
        return flash_attention_reference(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, segment_ids=segment_ids,
            sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale,
        )  # fmt: skip

    sizes = block_sizes or BlockSizes.default(backend)
    bq, bk = _block(sizes.block_q, l), _block(sizes.block_kv, s)
    lp, sp = -(-l // bq) * bq, -(-s // bk) * bk
    q_ids_BxL, kv_ids_BxS = split_segment_ids(segment_ids, l, s)
    has_segments = q_ids_BxL is not None
    if not has_segments:  # placeholders keep one kernel signature; never read
        q_ids_BxL, kv_ids_BxS = jnp.zeros((b, l), jnp.int32), jnp.zeros((b, s), jnp.int32)
    q_ids_BxLpx1 = _pad_to(q_ids_BxL, 1, lp)[:, :, None]
    kv_ids_Bx1xSp = _pad_to(kv_ids_BxS, 1, sp)[:, None, :]
    cfg = kernel.Config(
        block_q=bq, block_kv=bk, q_len=l, kv_len=s, causal=causal,
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
        sm_scale=sm_scale, has_segments=has_segments, backend=backend, interpret=interpret,
    )  # fmt: skip
    q_BxHxLpxK = _pad_to(q_BxLxHxK, 1, lp).transpose(0, 2, 1, 3)
    k_BxGxSpxK = _pad_to(k_BxSxGxK, 1, sp).transpose(0, 2, 1, 3)
    v_BxGxSpxK = _pad_to(v_BxSxGxK, 1, sp).transpose(0, 2, 1, 3)
    out_BxHxLpxK = _flash(q_BxHxLpxK, k_BxGxSpxK, v_BxGxSpxK, q_ids_BxLpx1, kv_ids_Bx1xSp, cfg)
    return out_BxHxLpxK.transpose(0, 2, 1, 3)[:, :l]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_ids, kv_ids, cfg):
    return kernel.forward(q, k, v, q_ids, kv_ids, cfg)[0]


def _flash_fwd(q, k, v, q_ids, kv_ids, cfg):
    out, lse = kernel.forward(q, k, v, q_ids, kv_ids, cfg)
    return out, (q, k, v, q_ids, kv_ids, out, lse)  # no [L, S] residual: recomputed in bwd


def _flash_bwd(cfg, residuals, do):
    q, k, v, q_ids, kv_ids, out, lse = residuals
    dq, dk, dv = kernel.backward(q, k, v, out, lse, do, q_ids, kv_ids, cfg)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
