"""`dot_product_attention`, the single function the model calls for attention, and its
implementations: `xla` (einsum reference with float32 softmax, the only one with ALiBi, T5's
bias, a prefix LM and a traced per-layer window), `flash` (the Pallas kernel of
`jaxllm.kernels`) and `cudnn` (`jaxllm.model.cudnn`), both run per shard by
`jaxllm.model.attention_kernels`; `resolve_impl` picks one for `auto`. `sinks_H` (gpt-oss's
learned logit per head in the softmax denominator) runs on xla and flash.
Masks (causal, segments, windows) and caps are described in `jaxllm.model.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.reference import (
    attention_mask,
    masked_logits,
    masked_scores,
    softmax_with_sinks,
)
from jaxllm.model.attention_kernels import cudnn, flash
from jaxllm.model.layers import widening_einsum


def _xla_attention(
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, scale, soft_cap, bias_HxLxS, sinks_H=None
):
    """Softmax over the masked float32 scores of `jaxllm.kernels.reference` (and the sink
    logits, whose column is then dropped); the probabilities are cast to v's dtype for the
    second matmul. bfloat16 q . k goes through `widening_einsum`, so the float32 scores'
    cotangent is cast to bfloat16 before the dq and dk matmuls, as flash attention's is."""
    b, l, h, _ = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    bias_1xGxRxLxS = None
    if bias_HxLxS is not None:
        bias_1xGxRxLxS = bias_HxLxS.reshape(1, g, h // g, *bias_HxLxS.shape[1:])
    if q_BxLxHxK.dtype == k_BxSxGxK.dtype == jnp.bfloat16:
        q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, q_BxLxHxK.shape[-1])
        products_BxGxRxLxS = widening_einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK)
        mask_Xx1x1xLxS = mask_XxLxS[:, None, None]
        scores_BxGxRxLxS, _ = masked_logits(
            products_BxGxRxLxS, mask_Xx1x1xLxS, scale=scale, soft_cap=soft_cap, bias=bias_1xGxRxLxS
        )
    else:
        scores_BxGxRxLxS, _ = masked_scores(
            q_BxLxHxK, k_BxSxGxK, mask_XxLxS, scale=scale, soft_cap=soft_cap, bias=bias_1xGxRxLxS
        )
    if sinks_H is None:
        probs_BxGxRxLxS = jax.nn.softmax(scores_BxGxRxLxS, axis=-1)
    else:
        probs_BxGxRxLxS = softmax_with_sinks(scores_BxGxRxLxS, sinks_H.reshape(1, g, h // g, 1, 1))
    probs_BxGxRxLxS = probs_BxGxRxLxS.astype(v_BxSxGxK.dtype)
    out_BxLxGxRxV = jnp.einsum("bgrls,bsgv->blgrv", probs_BxGxRxLxS, v_BxSxGxK)
    return out_BxLxGxRxV.reshape(b, l, h, v_BxSxGxK.shape[-1])


def pad_values(v_BxSxGxV: jax.Array, width: int) -> jax.Array:
    """Values zero-padded to `width` channels: attention kernels take one head width for q, k
    and v, and the padded output channels are 0 (callers slice them off)."""
    return jnp.pad(v_BxSxGxV, [(0, 0)] * 3 + [(0, width - v_BxSxGxV.shape[-1])])


def resolve_impl(
    impl: str,
    alibi: bool = False,
    soft_cap: bool = False,
    dtype=None,
    head_dim: int | None = None,
    causal: bool = True,
    sinks: bool = False,
) -> str:
    """`auto` -> the fastest implementation measured for the default backend (docs/benchmarks.md):
    on TPU the Pallas kernel; on a CUDA GPU, for bfloat16 / float16 with head dim 64 or 128,
    cuDNN's fused attention for causal self-attention (2-3x the Mosaic GPU kernel on an H100,
    packed documents included) and the kernel when a logit soft cap rules cuDNN out or the
    attention is bidirectional or has sinks (cuDNN has none), XLA otherwise; XLA on CPU.
    ALiBi always runs on XLA: the kernels take no additive bias."""
    if impl != "auto":
        return impl
    platform = jax.default_backend()
    if alibi or platform not in ("tpu", "gpu"):
        return "xla"
    if platform == "tpu":
        return "flash"
    if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    if head_dim is not None and head_dim not in (64, 128):
        return "xla"
    return "flash" if soft_cap or sinks or not causal else "cudnn"


def dot_product_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    q_segment_ids_BxL: jax.Array | None = None,
    kv_segment_ids_BxS: jax.Array | None = None,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    alibi_slopes_H: jax.Array | None = None,
    bias_HxLxS: jax.Array | None = None,
    impl: str = "xla",
    prefix_BxL: jax.Array | None = None,
    cudnn_max_segments: int = 32,
    sinks_H: jax.Array | None = None,
) -> jax.Array:
    """Softmax(cap(q k^T * scale) + alibi + mask) v, the layout of `jax.nn.dot_product_attention`.

    Causality is by index: query i sees keys j <= i (q and kv aligned, L == S); a sliding window
    w further limits it to i - w < j. `sliding_window` may be a traced int32 (0: no window) for
    `xla`, so scanned layers can differ; the kernels need a Python int. `soft_cap` c maps each
    scaled logit s to c * tanh(s / c); `alibi_slopes_H` adds -slope_h * (i - j) and
    `bias_HxLxS` any float32 bias (T5's relative positions), both xla only.
    `prefix_BxL` (a prefix LM; self-attention, xla only, so `auto` picks xla): where query and
    key are both 1 (the prefix of their segment) the key is visible even after the query, so the
    prefix attends bidirectionally and the tokens after it causally. `sinks_H` [H]: a learned
    logit per head in the softmax denominator only (gpt-oss); xla and flash.
    """
    l, k = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    s = k_BxSxGxK.shape[1]
    scale = k**-0.5 if scale is None else scale
    bias = alibi_slopes_H is not None or bias_HxLxS is not None
    impl = resolve_impl(
        impl,
        bias or prefix_BxL is not None,
        soft_cap is not None,
        q_BxLxHxK.dtype,
        k,
        causal,
        sinks_H is not None,
    )
    if impl != "xla" and bias:
        raise ValueError(f"attention_impl={impl} takes no additive bias (ALiBi, T5); use xla")
    if impl != "xla" and prefix_BxL is not None:
        raise ValueError(f"attention_impl={impl} takes no prefix-LM mask; use xla")
    if impl != "xla" and v_BxSxGxK.shape[-1] != k:  # MLA: the kernels want one head width
        out = dot_product_attention(
            q_BxLxHxK,
            k_BxSxGxK,
            pad_values(v_BxSxGxK, k),
            q_segment_ids_BxL=q_segment_ids_BxL,
            kv_segment_ids_BxS=kv_segment_ids_BxS,
            causal=causal,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            impl=impl,
            cudnn_max_segments=cudnn_max_segments,
            sinks_H=sinks_H,
        )
        return out[..., : v_BxSxGxK.shape[-1]]
    if impl == "flash":
        return flash(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            q_segment_ids_BxL,
            kv_segment_ids_BxS,
            causal,
            scale,
            sliding_window,
            soft_cap,
            sinks_H,
        )
    if impl == "cudnn":
        if soft_cap is not None or sinks_H is not None:
            raise ValueError("attention_impl=cudnn has no logit soft cap or sinks; use flash / xla")
        return cudnn(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            q_segment_ids_BxL,
            kv_segment_ids_BxS,
            causal,
            scale,
            sliding_window,
            cudnn_max_segments,
        )
    if impl != "xla":
        raise ValueError(f"unknown attention implementation {impl!r}")
    segment_ids = None
    if q_segment_ids_BxL is not None:
        kv_seg = q_segment_ids_BxL if kv_segment_ids_BxS is None else kv_segment_ids_BxS
        segment_ids = (q_segment_ids_BxL, kv_seg)
    q_idx_L, kv_idx_S = jnp.arange(l), jnp.arange(s)
    mask_XxLxS = attention_mask(
        q_idx_L, kv_idx_S, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids
    )
    if prefix_BxL is not None:  # prefix x prefix of one segment: visible both ways
        prefix_BxL = prefix_BxL.astype(bool)
        both_BxLxS = prefix_BxL[:, :, None] & prefix_BxL[:, None, :]
        if segment_ids is not None:
            both_BxLxS &= segment_ids[0][:, :, None] == segment_ids[1][:, None, :]
        mask_XxLxS = mask_XxLxS | both_BxLxS
    if alibi_slopes_H is not None:
        distance_LxS = jnp.abs(q_idx_L[:, None] - kv_idx_S[None, :]).astype(jnp.float32)
        alibi_HxLxS = -jnp.asarray(alibi_slopes_H, jnp.float32)[:, None, None] * distance_LxS[None]
        bias_HxLxS = alibi_HxLxS if bias_HxLxS is None else bias_HxLxS + alibi_HxLxS
    return _xla_attention(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, scale, soft_cap, bias_HxLxS, sinks_H
    )
