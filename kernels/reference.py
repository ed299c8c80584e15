"""Masked attention scores in pure JAX: the one place where positions, segment ids, causality,
a sliding window and a logit soft cap become the mask and the masked float32 scores.

Every jnp attention of the project is built on it: the model's XLA path
(`jaxllm.model.attention.dot_product_attention`), the references of the flash and decode kernels
(`flash_attention/reference.py`, `decode_attention/reference.py`) and the exact blocks of ring
attention. The Pallas kernels apply the same mask block by block and are tested against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity": exp(MASK - m) underflows to 0 without inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_floating(**arrays) -> None:
    """TypeError unless every named array (q, k, v, ...) is floating point: attention over
    integer arrays (token ids passed for activations) would run and mean nothing."""
    bad = [f"{k} {x.dtype}" for k, x in arrays.items() if not jnp.issubdtype(x.dtype, jnp.floating)]
    if bad:
        raise TypeError(f"attention takes floating-point inputs; got {', '.join(bad)}")


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


def _rows(positions):
    """int [N] (shared by the batch) or [B, N] -> [1 or B, N]."""
    positions = jnp.asarray(positions)
    return positions[None] if positions.ndim == 1 else positions


def attention_mask(
    q_positions, kv_positions, *, causal=False, sliding_window=None, segment_ids=None
):
    """Boolean [X, L, S]: True where query i may attend to key j (X = B when the positions are
    per batch row or segment ids are given, else 1).

    q_positions int [L] or [B, L], kv_positions [S] or [B, S]: the position of each query and
    key (indices 0.. for plain self-attention; global indices in a ring block; cache positions
    in decoding). `causal`: k <= q. `sliding_window` w: also q - w < k and, without `causal`,
    k < q + w; a Python int or a traced int32, where w <= 0 means no window (so a scanned layer
    can switch its window off). `segment_ids`: as `split_segment_ids` (a query sees only keys of
    its own segment).
    """
    q_XxLx1 = _rows(q_positions)[:, :, None]
    k_Xx1xS = _rows(kv_positions)[:, None, :]
    mask_XxLxS = jnp.ones(jnp.broadcast_shapes(q_XxLx1.shape, k_Xx1xS.shape), dtype=bool)
    if causal:
        mask_XxLxS &= k_Xx1xS <= q_XxLx1
    w = sliding_window
    static = isinstance(w, (int, np.integer))
    if w is not None and not (static and w <= 0):
        in_window_XxLxS = q_XxLx1 - w < k_Xx1xS
        if not causal:
            in_window_XxLxS &= k_Xx1xS < q_XxLx1 + w
        if not static:
            w = jnp.asarray(w, jnp.int32)
            in_window_XxLxS |= w <= 0
        mask_XxLxS &= in_window_XxLxS
    q_ids_BxL, kv_ids_BxS = split_segment_ids(segment_ids, q_XxLx1.shape[1], k_Xx1xS.shape[2])
    if q_ids_BxL is not None:
        mask_XxLxS &= q_ids_BxL[:, :, None] == kv_ids_BxS[:, None, :]
    return mask_XxLxS


def masked_scores(
    q_BxLxHxK, k_BxSxGxK, mask_XxLxS, *, scale, soft_cap=None, bias=None, precision=None
):
    """The masked logits of attention: (scores [B, G, R, L, S] float32, tanh or None).

    q [B, L, H, K] against k [B, S, G, K] with H = G * R (query head g * R + r reads kv head g);
    the product takes the inputs' dtype and accumulates in float32 (a float32 reference passes
    float32 copies), then `masked_logits` with the [X, L, S] mask of `attention_mask`.
    """
    b, l, h, kd = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, kd)
    products_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls",
        q_BxLxGxRxK,
        k_BxSxGxK,
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    return masked_logits(
        products_BxGxRxLxS, mask_XxLxS[:, None, None], scale=scale, soft_cap=soft_cap, bias=bias
    )


def masked_logits(products, mask, *, scale, soft_cap=None, bias=None):
    """(where(mask, cap(products * scale) + bias, MASK_VALUE), tanh or None) for float32 q . k
    products in any layout (`masked_scores` for [B, L, H, K] inputs; the decode reference's rows),
    `mask` from `attention_mask`, broadcast against them.

    `soft_cap` c maps s to c * tanh(s / c); `tanh` is tanh(s / c) for the derivative of the cap
    (1 - tanh^2), None without a cap. `bias` (ALiBi) broadcasts against the products and is
    added after the cap.
    """
    scores = products * jnp.float32(scale)
    tanh = None
    if soft_cap is not None:
        tanh = jnp.tanh(scores / soft_cap)
        scores = soft_cap * tanh
    if bias is not None:
        scores = scores + bias
    return jnp.where(mask, scores, MASK_VALUE), tanh


def softmax_with_sinks(scores_XxS, sinks_X1):
    """softmax over [scores, sink] with the sink's column dropped: a learned per-head logit
    that joins the denominator only, so a head can put weight on "nothing" (attention sinks,
    Xiao et al. 2023, arXiv:2309.17453; gpt-oss learns one per head, as transformers'
    `GptOssAttention`). `sinks_X1` broadcasts against the scores with a last axis of 1."""
    sinks = jnp.broadcast_to(sinks_X1.astype(jnp.float32), (*scores_XxS.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores_XxS, sinks], axis=-1), axis=-1)
    return probs[..., :-1]


def apply_sinks(out_BxLxHxK, lse_BxHxL, sinks_H):
    """Attention normalized over its keys, (out, lse), re-normalized with a sink logit per head
    in the denominator: out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink). Exact, and
    differentiable through the lse, so a kernel that returns (out, lse) gets sinks (and their
    gradients) without a change inside it. A row with no visible key (lse `MASK_VALUE`) stays
    0. Float32; returns out's shape."""
    sinks_1xHx1 = jnp.asarray(sinks_H, jnp.float32)[None, :, None]
    weight_BxHxL = jax.nn.sigmoid(lse_BxHxL.astype(jnp.float32) - sinks_1xHx1)
    return out_BxLxHxK.astype(jnp.float32) * jnp.transpose(weight_BxHxL, (0, 2, 1))[..., None]
