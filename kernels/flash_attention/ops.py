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
- `"mosaic_gpu"`: Mosaic GPU kernels (`mosaic_gpu.py`, `mosaic_gpu_backward.py`: TMA, wgmma) for
  Hopper; the default on a Hopper GPU (compute capability 9.x) for bfloat16 / float16 inputs
  with head dim 64 or 128. Asked for explicitly, other inputs raise. `BlockSizes(...,
  warp_specialized=True)` runs the FlashAttention-3 style forward (`mosaic_gpu_ws.py`) instead,
  `fused_backward=True` the fused one-kernel backward (`mosaic_gpu_fused_backward.py`).
- `"triton"`: Pallas Triton kernels for CUDA GPUs (`triton.py`), only when asked for explicitly:
  JAX deprecates Pallas-on-Triton from 0.11.
- `"xla"`: `flash_attention_reference` (materialises [B, H, L, S] scores in float32); the default
  on other GPUs (pre-Hopper; Blackwell, which has no wgmma), for inputs the Mosaic GPU kernels do
  not take (float32, other head dims) and on CPU without `interpret`. On a GPU, falling back to
  it without being asked warns once per process (`JaxllmWarning`).
A backend's module (and its Pallas lowering) is imported the first time a call uses it; what the
backends share is in `common.py`.
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
import warnings

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxllm.kernels.flash_attention.common import (
    BACKENDS,
    MOSAIC_GPU_BLOCK_MULTIPLE,
    BlockSizes,
    Config,
    block_size,
    mosaic_gpu_runs_on,
    mosaic_gpu_supported,
    pad_to,
    round_up,
)
from jaxllm.kernels.flash_attention.reference import (
    flash_attention_reference,
    flash_attention_reference_with_lse,
    masked_attention_backward,
    reference_mask,
    split_segment_ids,
)
from jaxllm.kernels.reference import apply_sinks, check_floating

from jaxllm.config.errors import JaxllmWarning

__all__ = [
    "BlockSizes",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_with_lse",
]

_warned_gpu_fallback = False  # the O(L^2) fallback on a GPU is reported once per process


def _warn_gpu_fallback(reason: str):
    global _warned_gpu_fallback
    if _warned_gpu_fallback:
        return
    _warned_gpu_fallback = True
    warnings.warn(
        f"flash_attention: no kernel for {reason} on this GPU; falling back to the XLA "
        "reference, which materialises the [B, H, L, S] float32 scores (O(L^2) memory). "
        "backend='xla' chooses it without this warning; backend='triton' runs the Pallas Triton "
        "kernels.",
        JaxllmWarning,
        stacklevel=4,
    )


def _resolve_backend(backend: str | None, interpret: bool, q_BxLxHxK) -> str:
    if backend is None:
        platform = jax.default_backend()
        if platform == "tpu" or interpret:
            backend = "mosaic_tpu"
        elif platform == "gpu":
            device = jax.devices()[0]
            reason = mosaic_gpu_supported(q_BxLxHxK.dtype, q_BxLxHxK.shape[-1])
            if not mosaic_gpu_runs_on(device):
                capability = getattr(device, "compute_capability", "unknown")
                reason = f"compute capability {capability} (the default kernels need Hopper, 9.x)"
            backend = "xla" if reason else "mosaic_gpu"
            if reason:
                _warn_gpu_fallback(reason)
        else:
            backend = "xla"
    names = (*BACKENDS, "xla")
    if backend not in names:
        raise ValueError(f"unknown backend {backend!r}; expected one of {names}")
    return backend


def _kernels(cfg: Config):
    """(forward, backward) of the backend `cfg.backend`. The import is deferred to here: a
    backend's module pulls in its Pallas lowering (Triton, Mosaic TPU, Mosaic GPU), which a
    process that never runs that backend does not load."""
    if cfg.backend == "mosaic_tpu":
        from jaxllm.kernels.flash_attention import mosaic_tpu

        return mosaic_tpu.forward, mosaic_tpu.backward
    if cfg.backend == "mosaic_gpu":
        from jaxllm.kernels.flash_attention import mosaic_gpu, mosaic_gpu_backward, mosaic_gpu_ws
        from jaxllm.kernels.flash_attention import mosaic_gpu_fused_backward as fused

        backward = fused.backward if cfg.fused_backward else mosaic_gpu_backward.backward
        if cfg.warp_specialized:
            return mosaic_gpu_ws.forward, _default_blocks(backward)
        return mosaic_gpu.forward, backward
    from jaxllm.kernels.flash_attention import triton

    return triton.forward, triton.backward


def _default_blocks(backward):
    """The backward of a warp-specialised forward, run with the default Mosaic GPU blocks (which
    fit its pipelines in shared memory at K = 128 and divide the forward's padded lengths). Rows
    and keys padded beyond the smaller blocks need no mask: their q, k, v and cotangents are
    zero, so they add exactly nothing to the kept gradients."""
    sizes = BlockSizes.default("mosaic_gpu")

    def run(*args, **kwargs):
        *args, cfg = args
        blocks = dict(block_q=sizes.block_q, block_kv=sizes.block_kv)
        return backward(*args, dataclasses.replace(cfg, **blocks, warp_specialized=False), **kwargs)

    return run


def _forward(cfg: Config):
    return _kernels(cfg)[0]


def _backward(cfg: Config):
    return _kernels(cfg)[1]


def _check_shapes(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sliding_window):
    check_floating(q=q_BxLxHxK, k=k_BxSxGxK, v=v_BxSxGxK)
    q, k, v = q_BxLxHxK.shape, k_BxSxGxK.shape, v_BxSxGxK.shape
    if len(q) != 4 or len(k) != 4 or k != v or (k[0], k[3]) != (q[0], q[3]):
        raise ValueError(f"want q [B, L, H, K] and k, v [B, S, G, K]; got q {q} k {k} v {v}")
    if q[2] % k[2]:
        raise ValueError(f"num_heads {q[2]} is not a multiple of num_kv_heads {k[2]}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")


def _kernel_inputs(
    q_BxLxHxK,
    k_BxSxGxK,
    *,
    causal,
    segment_ids,
    sliding_window,
    soft_cap,
    sm_scale,
    block_sizes,
    interpret,
    backend,
):
    """The static kernel Config and the segment ids padded to [B, Lp, 1] / [B, 1, Sp]."""
    b, l, _, _ = q_BxLxHxK.shape
    s = k_BxSxGxK.shape[1]
    sizes = block_sizes or BlockSizes.default(backend)
    bq, bk = block_size(sizes.block_q, l, backend), block_size(sizes.block_kv, s, backend)
    for flag in ("warp_specialized", "fused_backward"):
        if getattr(sizes, flag) and backend != "mosaic_gpu":
            raise ValueError(f"{flag} needs backend 'mosaic_gpu', not {backend!r}")
    if sizes.warp_specialized:
        bq = max(bq, 2 * MOSAIC_GPU_BLOCK_MULTIPLE)  # a wgmma row tile per compute warpgroup
    q_ids_BxL, kv_ids_BxS = split_segment_ids(segment_ids, l, s)
    has_segments = q_ids_BxL is not None
    if not has_segments:  # placeholders keep one kernel signature; never read
        q_ids_BxL, kv_ids_BxS = jnp.zeros((b, l), jnp.int32), jnp.zeros((b, s), jnp.int32)
    q_ids_BxLpx1 = pad_to(q_ids_BxL, 1, round_up(l, bq))[:, :, None]
    kv_ids_Bx1xSp = pad_to(kv_ids_BxS, 1, round_up(s, bk))[:, None, :]
    cfg = Config(
        block_q=bq,
        block_kv=bk,
        q_len=l,
        kv_len=s,
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        sm_scale=sm_scale,
        has_segments=has_segments,
        backend=backend,
        interpret=interpret,
        warp_specialized=sizes.warp_specialized,
        fused_backward=sizes.fused_backward,
    )
    return cfg, q_ids_BxLpx1, kv_ids_Bx1xSp


def _to_kernel(x_BxLxNxK, length_padded):  # [B, L, N, K] -> [B, N, Lp, K]
    return pad_to(x_BxLxNxK, 1, length_padded).transpose(0, 2, 1, 3)


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
        causal=causal,
        segment_ids=segment_ids,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sm_scale=sm_scale,
    )
    if backend == "xla":
        return flash_attention_reference_with_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **masks)
    cfg, q_ids, kv_ids = _kernel_inputs(
        q_BxLxHxK, k_BxSxGxK, block_sizes=block_sizes, interpret=interpret, backend=backend, **masks
    )
    lp, sp = round_up(l, cfg.block_q), round_up(cfg.kv_len, cfg.block_kv)
    out_BxHxLpxK, lse_BxHxLpx1 = _flash(
        _to_kernel(q_BxLxHxK, lp),
        _to_kernel(k_BxSxGxK, sp),
        _to_kernel(v_BxSxGxK, sp),
        q_ids,
        kv_ids,
        cfg,
    )
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
    sinks: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    backend: str | None = None,
) -> jax.Array:
    """softmax(mask(cap(q k^T * sm_scale))) v, differentiable in q, k and v.

    sinks: None, or a float [H] logit per query head that joins each row's softmax denominator
    only (gpt-oss's attention sinks); differentiable. The kernels stay as they are: the sink
    re-normalizes the (out, lse) of `flash_attention_with_lse` (`apply_sinks`), and the lse's
    cotangent carries the sink into the kernels' backward.

    segment_ids: None, an int [B, L] array shared by q and kv (needs L == S), or a pair
    (q_ids [B, L], kv_ids [B, S]). sm_scale defaults to K ** -0.5. Returns [B, L, H, K] in q's
    dtype; inputs may be float32 or bfloat16 (accumulation is float32 either way).
    """
    if sinks is not None:
        if jnp.shape(sinks) != (q_BxLxHxK.shape[2],):
            raise ValueError(f"sinks must be [{q_BxLxHxK.shape[2]}], got {jnp.shape(sinks)}")
        out_BxLxHxK, lse_BxHxL = flash_attention_with_lse(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            causal=causal,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sm_scale=sm_scale,
            block_sizes=block_sizes,
            interpret=interpret,
            backend=backend,
        )
        return apply_sinks(out_BxLxHxK, lse_BxHxL, sinks).astype(q_BxLxHxK.dtype)
    if _resolve_backend(backend, interpret, q_BxLxHxK) == "xla":
        _check_shapes(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sliding_window)
        return flash_attention_reference(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            causal=causal,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sm_scale=sm_scale,
        )
    # The lse is dropped: its cotangent reaches the backward as zeros (one [B, H, L] subtraction).
    return flash_attention_with_lse(
        q_BxLxHxK,
        k_BxSxGxK,
        v_BxSxGxK,
        causal=causal,
        segment_ids=segment_ids,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        backend=backend,
    )[0]


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
            l,
            k_BxSxGxK.shape[1],
            causal=causal,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
        )
        return masked_attention_backward(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            out_BxLxHxK,
            lse_BxHxL,
            dout_BxLxHxK,
            mask_XxLxS,
            scale=sm_scale,
            soft_cap=soft_cap,
        )
    cfg, q_ids, kv_ids = _kernel_inputs(
        q_BxLxHxK,
        k_BxSxGxK,
        causal=causal,
        segment_ids=segment_ids,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sm_scale=sm_scale,
        block_sizes=block_sizes,
        interpret=interpret,
        backend=backend,
    )
    s = k_BxSxGxK.shape[1]
    lp, sp = round_up(l, cfg.block_q), round_up(s, cfg.block_kv)
    # Padded query rows: lse 0 keeps exp(s - lse) finite; dk/dv mask them, their dq is cut off.
    lse_BxHxLpx1 = pad_to(lse_BxHxL.astype(jnp.float32), 2, lp)[..., None]
    dq_BxHxLpxK, dk_BxGxSpxK, dv_BxGxSpxK = _backward(cfg)(
        _to_kernel(q_BxLxHxK, lp),
        _to_kernel(k_BxSxGxK, sp),
        _to_kernel(v_BxSxGxK, sp),
        _to_kernel(out_BxLxHxK.astype(q_BxLxHxK.dtype), lp),
        lse_BxHxLpx1,
        _to_kernel(dout_BxLxHxK.astype(q_BxLxHxK.dtype), lp),
        q_ids,
        kv_ids,
        cfg,
    )
    return (
        dq_BxHxLpxK.transpose(0, 2, 1, 3)[:, :l],
        dk_BxGxSpxK.transpose(0, 2, 1, 3)[:, :s],
        dv_BxGxSpxK.transpose(0, 2, 1, 3)[:, :s],
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_ids, kv_ids, cfg):
    return _forward(cfg)(q, k, v, q_ids, kv_ids, cfg)


def _flash_fwd(q, k, v, q_ids, kv_ids, cfg):
    out, lse = _forward(cfg)(q, k, v, q_ids, kv_ids, cfg)
    # named, so that a remat policy saving these names keeps them and the backward pass does
    # not run the forward kernel again (jaxllm's model.remat=dots_attention)
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)  # no [L, S] residual: recomputed


def _flash_bwd(cfg, residuals, cotangents):
    q, k, v, q_ids, kv_ids, out, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = _backward(cfg)(q, k, v, out, lse, do, q_ids, kv_ids, cfg, dlse=dlse)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
