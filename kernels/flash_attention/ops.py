"""`flash_attention`: the public, differentiable FlashAttention-2 op (arXiv:2307.08691).

- `flash_attention_with_lse` also returns the row logsumexp, differentiably: the merge key for
  blockwise attention (ring attention combines per-block results as
  out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i).
- `flash_attention_backward` is the FlashAttention-2 backward on its own: (dq, dk, dv) from the
  softmax statistics (out, lse), which may be those of a longer attention this call is one key
  block of (a custom ring backward).

Layout of `jax.nn.dot_product_attention`: q [B, L, H, K], k/v [B, S, G, K] with H a multiple of G
(MHA G = H, GQA, MQA G = 1; kv head g serves query heads g * R .. g * R + R - 1, R = H / G).

Backends (`backend=`):
- `"mosaic_tpu"`: Pallas Mosaic TPU kernels (`mosaic_tpu.py`: the blocks of the other sequence
  stream through VMEM on the innermost grid axis, so VMEM use does not grow with the sequence
  length); the default when `jax.default_backend()` is TPU.
- `"mosaic_gpu"`: Mosaic GPU kernels (`mosaic_gpu.py`: TMA, wgmma) for Hopper; the default on a
  Hopper GPU (compute capability 9.x) for bfloat16 / float16 inputs with head dim 64 or 128.
  Asked for explicitly, other inputs raise.
- `"triton"`: Pallas Triton kernels for CUDA GPUs (`kernel.py`), only when asked for explicitly:
  JAX deprecates Pallas-on-Triton from 0.11.
- `"xla"`: `flash_attention_reference` (materialises [B, H, L, S] scores in float32); the default
  on other GPUs (pre-Hopper; Blackwell, which has no wgmma), for inputs the Mosaic GPU kernels do
  not take (float32, other head dims) and on CPU without `interpret`.
`interpret=True` runs the kernels of the chosen backend (Mosaic TPU when `backend` is None) in the
Pallas interpreter of that backend, on any platform (CPU tests).

Masks, all combinable: `causal` (query i sees keys j <= i, indices aligned at 0 as in
`jaxllm.model.attention`), `sliding_window` w (additionally i - w < j; without `causal`,
|i - j| < w), `segment_ids` (packed documents: a query sees only keys of its own segment).
`soft_cap` c replaces each logit s by c * tanh(s / c) (Gemma 2). A row with no visible key
returns 0 (and zero gradients), never NaN, and logsumexp `MASK_VALUE` (-0.7 * float32 max), not
-inf: finite, so merges never compute inf - inf, and exp(MASK_VALUE - lse) is exactly 0 next to
any row that sees a key (two empty rows merge to an empty row: out 0, lse MASK_VALUE).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxllm.kernels.flash_attention import kernel, mosaic_gpu, mosaic_tpu
from jaxllm.kernels.flash_attention.reference import (
    flash_attention_reference,
    flash_attention_reference_with_lse,
    masked_attention_backward,
    reference_mask,
    split_segment_ids,
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows of q (`block_q`) and of k/v (`block_kv`) per kernel block.

    Defaults per backend: Mosaic TPU 128 / 128 for the forward and both backward kernels (one
    [128, 128] MXU tile per grid step; lane-dense kv segment-id slices),
    Triton 64 / 64 (keeps the f32 [64, 64] tiles and a K <= 128 accumulator in registers),
    Mosaic GPU 64 / 64 (one wgmma row tile per warpgroup; the dq and dk/dv pipelines fit Hopper's
    shared memory at K = 128). Clipped to the padded sequence length for short sequences (not
    below 64 rows for Mosaic GPU); Triton needs powers of 2, Mosaic GPU multiples of 64, Mosaic
    TPU multiples of 8 and, with segment ids, a block_kv that is a multiple of 128 (lane-dim
    slices of the kv ids) unless one block holds the whole padded sequence.
    """

    block_q: int
    block_kv: int

    @classmethod
    def default(cls, backend: str) -> BlockSizes:
        return cls(64, 64) if backend in ("triton", "mosaic_gpu") else cls(128, 128)


def _resolve_backend(backend: str | None, interpret: bool, q_BxLxHxK) -> str:
    if backend is None:
        platform = jax.default_backend()
        if platform == "tpu" or interpret:
            backend = "mosaic_tpu"
        elif (
            platform == "gpu"
            and mosaic_gpu.runs_on(jax.devices()[0])
            and mosaic_gpu.supported(q_BxLxHxK.dtype, q_BxLxHxK.shape[-1]) is None
        ):
            backend = "mosaic_gpu"
        else:
            backend = "xla"
    names = (*kernel.BACKENDS, "xla")
    if backend not in names:
        raise ValueError(f"unknown backend {backend!r}; expected one of {names}")
    return backend


def _kernels(cfg: kernel.Config):
    """The module whose forward / backward implement `cfg.backend`."""
    return {"mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu, "triton": kernel}[cfg.backend]


def _block(requested: int, length: int, minimum: int = 8) -> int:
    """Short sequences get one block of the next power of 2 (>= 8 sublanes, >= one wgmma tile for
    Mosaic GPU) instead of a mostly padded full-size block."""
    return max(minimum, min(requested, pl.next_power_of_2(length)))


def _pad_to(x, axis: int, size: int, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _check_shapes(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sliding_window):
    b, l, h, d = q_BxLxHxK.shape
    s, g = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    if k_BxSxGxK.shape != (b, s, g, d) or v_BxSxGxK.shape != k_BxSxGxK.shape:
        raise ValueError(f"bad shapes q {q_BxLxHxK.shape} k {k_BxSxGxK.shape} v {v_BxSxGxK.shape}")
    if h % g:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {g}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")


def _round_up(length: int, block: int) -> int:
    return -(-length // block) * block


def _kernel_inputs(
    q_BxLxHxK, k_BxSxGxK, *, causal, segment_ids, sliding_window, soft_cap, sm_scale,
    block_sizes, interpret, backend,
):  # fmt: skip
    """The static kernel Config and the segment ids padded to [B, Lp, 1] / [B, 1, Sp]."""
    b, l, _, _ = q_BxLxHxK.shape
    s = k_BxSxGxK.shape[1]
    sizes = block_sizes or BlockSizes.default(backend)
    minimum = mosaic_gpu.BLOCK_MULTIPLE if backend == "mosaic_gpu" else 8
    bq, bk = _block(sizes.block_q, l, minimum), _block(sizes.block_kv, s, minimum)
    q_ids_BxL, kv_ids_BxS = split_segment_ids(segment_ids, l, s)
    has_segments = q_ids_BxL is not None
    if not has_segments:  # placeholders keep one kernel signature; never read
        q_ids_BxL, kv_ids_BxS = jnp.zeros((b, l), jnp.int32), jnp.zeros((b, s), jnp.int32)
    q_ids_BxLpx1 = _pad_to(q_ids_BxL, 1, _round_up(l, bq))[:, :, None]
    kv_ids_Bx1xSp = _pad_to(kv_ids_BxS, 1, _round_up(s, bk))[:, None, :]
    cfg = kernel.Config(
        block_q=bq, block_kv=bk, q_len=l, kv_len=s, causal=causal,
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
        sm_scale=sm_scale, has_segments=has_segments, backend=backend, interpret=interpret,
    )  # fmt: skip
    return cfg, q_ids_BxLpx1, kv_ids_Bx1xSp


def _to_kernel(x_BxLxNxK, length_padded):  # [B, L, N, K] -> [B, N, Lp, K]
    return _pad_to(x_BxLxNxK, 1, length_padded).transpose(0, 2, 1, 3)


def flash_attention_with_lse(
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
) -> tuple[jax.Array, jax.Array]:
    """(out [B, L, H, K] in q's dtype, lse [B, H, L] float32), differentiable in q, k and v
    through both outputs. lse_i = log sum_j exp(s_ij) over the visible keys of row i (after the
    soft cap and sm_scale); `MASK_VALUE` for a row with none. Arguments as `flash_attention`.
    """
    _check_shapes(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sliding_window)
    backend = _resolve_backend(backend, interpret, q_BxLxHxK)
    l, d = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    masks = dict(
        causal=causal, segment_ids=segment_ids, sliding_window=sliding_window, soft_cap=soft_cap,
        sm_scale=sm_scale,
    )  # fmt: skip
    if backend == "xla":
        return flash_attention_reference_with_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **masks)
    cfg, q_ids, kv_ids = _kernel_inputs(
        q_BxLxHxK, k_BxSxGxK, block_sizes=block_sizes, interpret=interpret, backend=backend, **masks
    )
    lp, sp = _round_up(l, cfg.block_q), _round_up(cfg.kv_len, cfg.block_kv)
    out_BxHxLpxK, lse_BxHxLpx1 = _flash(
        _to_kernel(q_BxLxHxK, lp), _to_kernel(k_BxSxGxK, sp), _to_kernel(v_BxSxGxK, sp),
        q_ids, kv_ids, cfg,
    )  # fmt: skip
    return out_BxHxLpxK.transpose(0, 2, 1, 3)[:, :l], lse_BxHxLpx1[:, :, :l, 0]


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
    if _resolve_backend(backend, interpret, q_BxLxHxK) == "xla":
        _check_shapes(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sliding_window)
        return flash_attention_reference(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, segment_ids=segment_ids,
            sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale,
        )  # fmt: skip
    # The lse is dropped: its cotangent reaches the backward as zeros (one [B, H, L] subtraction).
    return flash_attention_with_lse(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, causal=causal, segment_ids=segment_ids,
        sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale,
        block_sizes=block_sizes, interpret=interpret, backend=backend,
    )[0]  # fmt: skip


def flash_attention_backward(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    out_BxLxHxK: jax.Array,
    lse_BxHxL: jax.Array,
    dout_BxLxHxK: jax.Array,
    *,
    causal: bool = False,
    segment_ids=None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) in the input dtypes from the softmax row statistics `out` / `lse`.

    With the (out, lse) of `flash_attention_with_lse` on the same arguments this is the VJP of
    `flash_attention` for cotangent `dout`. With the (out, lse) of a longer attention whose keys
    include these k/v as one block (ring or blockwise attention, merged by logsumexp), it is this
    block's share of that attention's gradients: p = exp(s - lse) is then the probability under
    the whole attention and delta = rowsum(dout * out) its FlashAttention-2 correction, so no
    per-block forward has to be kept or recomputed. Not itself differentiable.
    """
    _check_shapes(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sliding_window)
    backend = _resolve_backend(backend, interpret, q_BxLxHxK)
    b, l, h, d = q_BxLxHxK.shape
    if out_BxLxHxK.shape != q_BxLxHxK.shape or dout_BxLxHxK.shape != q_BxLxHxK.shape:
        raise ValueError(f"out {out_BxLxHxK.shape} and dout {dout_BxLxHxK.shape} must be q's shape")
    if lse_BxHxL.shape != (b, h, l):
        raise ValueError(f"lse has shape {lse_BxHxL.shape}, expected {(b, h, l)}")
    sm_scale = d**-0.5 if sm_scale is None else float(sm_scale)
    if backend == "xla":
        mask_XxLxS = reference_mask(
            l, k_BxSxGxK.shape[1], causal=causal, segment_ids=segment_ids,
            sliding_window=sliding_window,
        )  # fmt: skip
        return masked_attention_backward(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, out_BxLxHxK, lse_BxHxL, dout_BxLxHxK, mask_XxLxS,
            scale=sm_scale, soft_cap=soft_cap,
        )  # fmt: skip
    cfg, q_ids, kv_ids = _kernel_inputs(
        q_BxLxHxK, k_BxSxGxK, causal=causal, segment_ids=segment_ids,
        sliding_window=sliding_window, soft_cap=soft_cap, sm_scale=sm_scale,
        block_sizes=block_sizes, interpret=interpret, backend=backend,
    )  # fmt: skip
    s = k_BxSxGxK.shape[1]
    lp, sp = _round_up(l, cfg.block_q), _round_up(s, cfg.block_kv)
    # Padded query rows: lse 0 keeps exp(s - lse) finite; dk/dv mask them, their dq is cut off.
    lse_BxHxLpx1 = _pad_to(lse_BxHxL.astype(jnp.float32), 2, lp)[..., None]
    dq_BxHxLpxK, dk_BxGxSpxK, dv_BxGxSpxK = _kernels(cfg).backward(
        _to_kernel(q_BxLxHxK, lp), _to_kernel(k_BxSxGxK, sp), _to_kernel(v_BxSxGxK, sp),
        _to_kernel(out_BxLxHxK.astype(q_BxLxHxK.dtype), lp), lse_BxHxLpx1,
        _to_kernel(dout_BxLxHxK.astype(q_BxLxHxK.dtype), lp), q_ids, kv_ids, cfg,
    )  # fmt: skip
    return (
        dq_BxHxLpxK.transpose(0, 2, 1, 3)[:, :l],
        dk_BxGxSpxK.transpose(0, 2, 1, 3)[:, :s],
        dv_BxGxSpxK.transpose(0, 2, 1, 3)[:, :s],
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_ids, kv_ids, cfg):
    return _kernels(cfg).forward(q, k, v, q_ids, kv_ids, cfg)


def _flash_fwd(q, k, v, q_ids, kv_ids, cfg):
    out, lse = _kernels(cfg).forward(q, k, v, q_ids, kv_ids, cfg)
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)  # no [L, S] residual: recomputed


def _flash_bwd(cfg, residuals, cotangents):
    q, k, v, q_ids, kv_ids, out, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = _kernels(cfg).backward(q, k, v, out, lse, do, q_ids, kv_ids, cfg, dlse=dlse)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
