"""Pure-JAX attention with the masks of `flash_attention`: the ground truth of its tests.

Materialises the [B, G, R, L, S] score tensor in float32 (`jaxllm.kernels.reference`), so it is
only for small shapes (tests) and as the `xla` fallback of `flash_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxllm.kernels.reference import (
    MASK_VALUE,
    attention_mask,
    masked_scores,
    softmax_with_sinks,
    split_segment_ids,
)

__all__ = [
    "MASK_VALUE",
    "flash_attention_reference",
    "flash_attention_reference_with_lse",
    "masked_attention",
    "masked_attention_backward",
    "reference_mask",
    "split_segment_ids",
]


def masked_attention(
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, *, scale, soft_cap=None, sinks_H=None
):
    """softmax(mask(cap(q k^T * scale))) v and its logsumexp for an explicit [B or 1, L, S] mask.
    `sinks_H`: a logit per query head in the softmax denominator only (`softmax_with_sinks`);
    the lse stays the one over the keys.

    Returns (out [B, L, H, K] in q's dtype, lse [B, H, L] float32). Softmax in float32 on float32
    copies of q, k, v. A row with no visible key returns out 0 and lse `MASK_VALUE`, with zero
    gradients.
    """
    b, l, h, kd = q_BxLxHxK.shape
    scores_BxGxRxLxS, _ = masked_scores(
        q_BxLxHxK.astype(jnp.float32),
        k_BxSxGxK.astype(jnp.float32),
        mask_XxLxS,
        scale=scale,
        soft_cap=soft_cap,
    )
    mask_XxGxRxLxS = mask_XxLxS[:, None, None]
    if sinks_H is None:
        probs_BxGxRxLxS = jax.nn.softmax(scores_BxGxRxLxS, axis=-1)
    else:
        g = k_BxSxGxK.shape[2]
        sinks_1xGxRx1x1 = jnp.asarray(sinks_H).reshape(1, g, h // g, 1, 1)
        probs_BxGxRxLxS = softmax_with_sinks(scores_BxGxRxLxS, sinks_1xGxRx1x1)
    probs_BxGxRxLxS = jnp.where(mask_XxGxRxLxS, probs_BxGxRxLxS, 0.0)  # empty rows -> 0
    out_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", probs_BxGxRxLxS, v_BxSxGxK.astype(jnp.float32))
    # An empty row's logsumexp over MASK_VALUE scores rounds to MASK_VALUE anyway; the where makes
    # it exact and cuts the (masked, uniform) softmax gradient off.
    lse_BxGxRxL = jnp.where(
        jnp.any(mask_XxGxRxLxS, axis=-1),
        jax.nn.logsumexp(scores_BxGxRxLxS, axis=-1),
        MASK_VALUE,
    )
    out_BxLxHxK = out_BxLxGxRxK.reshape(b, l, h, kd).astype(q_BxLxHxK.dtype)
    return out_BxLxHxK, lse_BxGxRxL.reshape(b, h, l)


def masked_attention_backward(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    out_BxLxHxK,
    lse_BxHxL,
    dout_BxLxHxK,
    mask_XxLxS,
    *,
    scale,
    soft_cap=None,
):
    """(dq, dk, dv) of attention over these keys, from the softmax row statistics `out` / `lse`.

    The FlashAttention-2 backward in jnp: p = exp(s - lse), ds = p * (dout v^T - delta) with
    delta = rowsum(dout * out). With this block's own (out, lse) it is the VJP of
    `masked_attention`; with the (out, lse) of a longer attention that these keys are one block of
    (ring / blockwise attention), it is this block's share of that attention's gradients, since p
    is then that attention's probability. Float32 math; results in the input dtypes.
    """
    b, l, h, kd = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    f32 = jnp.float32

    def by_group(x_BxLxHxK):
        return x_BxLxHxK.astype(f32).reshape(b, l, g, h // g, kd)

    q_BxLxGxRxK, out_BxLxGxRxK, do_BxLxGxRxK = map(by_group, (q_BxLxHxK, out_BxLxHxK, dout_BxLxHxK))
    k_f_BxSxGxK, v_f_BxSxGxK = k_BxSxGxK.astype(f32), v_BxSxGxK.astype(f32)
    # Masked before the exp: an empty row has lse == MASK_VALUE and would give exp(s - lse) = inf.
    scores_BxGxRxLxS, tanh_BxGxRxLxS = masked_scores(
        q_BxLxHxK.astype(f32), k_f_BxSxGxK, mask_XxLxS, scale=scale, soft_cap=soft_cap
    )
    mask_XxGxRxLxS = mask_XxLxS[:, None, None]
    lse_BxGxRxLx1 = lse_BxHxL.astype(f32).reshape(b, g, h // g, l)[..., None]
    probs_BxGxRxLxS = jnp.where(mask_XxGxRxLxS, jnp.exp(scores_BxGxRxLxS - lse_BxGxRxLx1), 0.0)
    dprobs_BxGxRxLxS = jnp.einsum("blgrk,bsgk->bgrls", do_BxLxGxRxK, v_f_BxSxGxK)
    delta_BxLxGxR = jnp.sum(do_BxLxGxRxK * out_BxLxGxRxK, axis=-1)
    delta_BxGxRxLx1 = jnp.transpose(delta_BxLxGxR, (0, 2, 3, 1))[..., None]
    dscores_BxGxRxLxS = probs_BxGxRxLxS * (dprobs_BxGxRxLxS - delta_BxGxRxLx1)
    if tanh_BxGxRxLxS is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        dscores_BxGxRxLxS = dscores_BxGxRxLxS * (1.0 - tanh_BxGxRxLxS * tanh_BxGxRxLxS)
    dq_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", dscores_BxGxRxLxS, k_f_BxSxGxK) * f32(scale)
    dk_BxSxGxK = jnp.einsum("bgrls,blgrk->bsgk", dscores_BxGxRxLxS, q_BxLxGxRxK) * f32(scale)
    dv_BxSxGxK = jnp.einsum("bgrls,blgrk->bsgk", probs_BxGxRxLxS, do_BxLxGxRxK)
    return (
        dq_BxLxGxRxK.reshape(b, l, h, kd).astype(q_BxLxHxK.dtype),
        dk_BxSxGxK.astype(k_BxSxGxK.dtype),
        dv_BxSxGxK.astype(v_BxSxGxK.dtype),
    )


def reference_mask(l, s, *, causal=False, segment_ids=None, sliding_window=None):
    """The [B or 1, L, S] mask of `flash_attention`'s keyword arguments (query and key indices
    aligned at 0)."""
    return attention_mask(
        jnp.arange(l),
        jnp.arange(s),
        causal=causal,
        sliding_window=sliding_window,
        segment_ids=segment_ids,
    )


def flash_attention_reference_with_lse(
    q_BxLxHxK,
    k_BxSxGxK,
    v_BxSxGxK,
    *,
    causal=False,
    segment_ids=None,
    sliding_window=None,
    soft_cap=None,
    sm_scale=None,
    sinks=None,
    block_sizes=None,
    interpret=False,
    backend=None,
):
    """Same contract as `flash_attention_with_lse` (block_sizes / interpret / backend are
    ignored): (out [B, L, H, K], lse [B, H, L] float32). `sinks` [H] (as `flash_attention`)
    join the softmax of `out` as an extra column; the lse is over the keys only."""
    del block_sizes, interpret, backend
    l, kd = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    mask_XxLxS = reference_mask(
        l,
        k_BxSxGxK.shape[1],
        causal=causal,
        segment_ids=segment_ids,
        sliding_window=sliding_window,
    )
    scale = kd**-0.5 if sm_scale is None else sm_scale
    return masked_attention(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, scale=scale, soft_cap=soft_cap, sinks_H=sinks
    )


def flash_attention_reference(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **kwargs):
    """Same contract as `flash_attention` (block_sizes / interpret / backend are ignored).

    Softmax in float32 on float32 copies of q, k, v; rows with no visible key return 0.
    """
    return flash_attention_reference_with_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **kwargs)[0]
