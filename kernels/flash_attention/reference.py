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


def flash_attention_reference(
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
    """Same contract as `flash_attention` (block_sizes / interpret / backend are ignored).

    Softmax in float32 on float32 copies of q, k, v; rows with no visible key return 0.
    """
    del block_sizes, interpret, backend
    b, l, h, k = q_BxLxHxK.shape
    s, g = k_BxSxGxK.shape[1], k_BxSxGxK.shape[2]
    scale = k**-0.5 if sm_scale is None else sm_scale
    q_ids_BxL, kv_ids_BxS = split_segment_ids(segment_ids, l, s)
    mask_XxLxS = attention_mask(
        l, s, causal=causal, q_ids_BxL=q_ids_BxL, kv_ids_BxS=kv_ids_BxS,
        sliding_window=sliding_window,
    )  # fmt: skip
    q_BxLxGxRxK = q_BxLxHxK.astype(jnp.float32).reshape(b, l, g, h // g, k)
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
    return out_BxLxGxRxK.reshape(b, l, h, k).astype(q_BxLxHxK.dtype)
