"""Pure-JAX attention with the masks of `flash_attention`: the ground truth of its tests.

Materialises the [B, G, R, L, S] score tensor in float32, so it is only for small shapes (tests)
and as the `xla` fallback of `flash_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": exp(MASK - m) underflows to 0 without inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def split_segment_ids(segment_ids, l: int, s: int):
    """`segment_ids` ([B, L] shared by q and kv, or a (q_ids_BxL, kv_ids_BxS) pair) -> pair."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_ids_BxL, kv_ids_BxS = segment_ids
    else:
        if l != s:
            raise ValueError("one segment_ids array needs L == S; pass (q_ids, kv_ids) instead")
        q_ids_BxL = kv_ids_BxS = segment_ids
    return jnp.asarray(q_ids_BxL, jnp.int32), jnp.asarray(kv_ids_BxS, jnp.int32)


def attention_mask(l, s, *, causal, q_ids_BxL, kv_ids_BxS, sliding_window):
    """Boolean [B or 1, L, S] mask: True where query i may attend to key j."""
    q_pos_LxS = jnp.arange(l)[:, None]
    k_pos_LxS = jnp.arange(s)[None, :]
    mask_LxS = jnp.ones((l, s), dtype=bool)
    if causal:
        mask_LxS &= k_pos_LxS <= q_pos_LxS
    if sliding_window is not None:
        mask_LxS &= q_pos_LxS - sliding_window < k_pos_LxS
        if not causal:
            mask_LxS &= k_pos_LxS < q_pos_LxS + sliding_window
    mask_1xLxS = mask_LxS[None]
    if q_ids_BxL is not None:
        return mask_1xLxS & (q_ids_BxL[:, :, None] == kv_ids_BxS[:, None, :])
    return mask_1xLxS


def masked_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, *, scale, soft_cap=None):
    """softmax(mask(cap(q k^T * scale))) v and its logsumexp for an explicit [B or 1, L, S] mask.

    Returns (out [B, L, H, K] in q's dtype, lse [B, H, L] float32). Softmax in float32 on float32
    copies of q, k, v. A row with no visible key returns out 0 and lse `MASK_VALUE`, with zero
    gradients.
    """
    b, l, h, kd = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.astype(jnp.float32).reshape(b, l, g, h // g, kd)
    scores_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK.astype(jnp.float32)
    ) * jnp.float32(scale)
    if soft_cap is not None:
        scores_BxGxRxLxS = soft_cap * jnp.tanh(scores_BxGxRxLxS / soft_cap)
    mask_XxGxRxLxS = mask_XxLxS[:, None, None]
    scores_BxGxRxLxS = jnp.where(mask_XxGxRxLxS, scores_BxGxRxLxS, MASK_VALUE)
    probs_BxGxRxLxS = jax.nn.softmax(scores_BxGxRxLxS, axis=-1)
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
    q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, out_BxLxHxK, lse_BxHxL, dout_BxLxHxK, mask_XxLxS,
    *, scale, soft_cap=None,
):  # fmt: skip
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
    scores_BxGxRxLxS = jnp.einsum("blgrk,bsgk->bgrls", q_BxLxGxRxK, k_f_BxSxGxK) * f32(scale)
    tanh_BxGxRxLxS = None
    if soft_cap is not None:
        tanh_BxGxRxLxS = jnp.tanh(scores_BxGxRxLxS / soft_cap)
        scores_BxGxRxLxS = soft_cap * tanh_BxGxRxLxS
    mask_XxGxRxLxS = mask_XxLxS[:, None, None]
    lse_BxGxRxLx1 = lse_BxHxL.astype(f32).reshape(b, g, h // g, l)[..., None]
    # Masked before the exp: an empty row has lse == MASK_VALUE and would give exp(s - lse) = inf.
    scores_BxGxRxLxS = jnp.where(mask_XxGxRxLxS, scores_BxGxRxLxS, MASK_VALUE)
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
    """The [B or 1, L, S] mask of `flash_attention`'s keyword arguments."""
    q_ids_BxL, kv_ids_BxS = split_segment_ids(segment_ids, l, s)
    return attention_mask(
        l, s, causal=causal, q_ids_BxL=q_ids_BxL, kv_ids_BxS=kv_ids_BxS,
        sliding_window=sliding_window,
    )  # fmt: skip


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
    block_sizes=None,
    interpret=False,
    backend=None,
):
    """Same contract as `flash_attention_with_lse` (block_sizes / interpret / backend are
    ignored): (out [B, L, H, K], lse [B, H, L] float32)."""
    del block_sizes, interpret, backend
    l, kd = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    mask_XxLxS = reference_mask(
        l, k_BxSxGxK.shape[1], causal=causal, segment_ids=segment_ids,
        sliding_window=sliding_window,
    )  # fmt: skip
    scale = kd**-0.5 if sm_scale is None else sm_scale
    return masked_attention(
        q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, scale=scale, soft_cap=soft_cap
    )


def flash_attention_reference(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **kwargs):
    """Same contract as `flash_attention` (block_sizes / interpret / backend are ignored).

    Softmax in float32 on float32 copies of q, k, v; rows with no visible key return 0.
    """
    return flash_attention_reference_with_lse(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, **kwargs)[0]
