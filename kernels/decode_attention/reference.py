"""Pure-JAX decode attention over a `KVCache`: the ground truth of the kernel's tests and the
`xla` backend of `decode_attention`.

Dequantizes the whole cache to float32 (gathering pages through the block table, overlaying
the int4 / int2 residual), then plain masked softmax attention in float32, with the mask and masked
logits of `jaxllm.kernels.reference`. Query i of Q (0-based) of sequence b sits at position
lengths[b] - Q + i and sees tokens 0 .. lengths[b] - Q + i.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxllm.kernels.decode_attention.quant import (
    KIVI_BITS,
    KVCache,
    cache_geometry,
    dequantize_int8,
    dequantize_kivi_keys,
    dequantize_kivi_values,
)
from jaxllm.kernels.reference import attention_mask, masked_logits


def _select_layer(x, layer):
    if x is None or layer is None:
        return x
    return lax.dynamic_index_in_dim(x, jnp.asarray(layer, jnp.int32), 0, keepdims=False)


def _gather_pages(x_PxGxNxX, block_table_BxJ):
    """[P, G, N, ...] pages -> [B, G, J * N, ...] logical rows (for page-row arrays)."""
    x_BxJxGxNxX = x_PxGxNxX[block_table_BxJ]
    b, j, g, n = x_BxJxGxNxX.shape[:4]
    x_BxGxJxNxX = jnp.swapaxes(x_BxJxGxNxX, 1, 2)
    return x_BxGxJxNxX.reshape(b, g, j * n, *x_BxJxGxNxX.shape[4:])


def dequantize_cache(cache: KVCache, lengths_B, *, layer=None):
    """(k, v) float32 [B, G, T, K]: every token of `cache` (one layer) in logical order (v
    [B, G, T, value_dim] of a latent cache: a slice of k).

    For int4 / int2, tokens q(n) .. q(n) + group - 1 come from the residual and the rest from the
    codes (rows past n - 1 are whatever the cache holds; callers mask them).
    """
    geo = cache_geometry(cache)
    if (layer is None) != (geo.num_layers is None):
        raise ValueError("pass `layer` exactly when the cache has a leading layer axis")
    arrays = {
        name: _select_layer(getattr(cache, name), layer)
        for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero", "k_res", "v_res")
    }
    if cache.paged:
        for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
            if arrays[name] is not None:
                arrays[name] = _gather_pages(arrays[name], cache.block_table)
    a, f32, group = arrays, jnp.float32, cache.group
    if cache.value_dim is not None:  # latent (MLA): the keys are the values
        k_BxGxTxK = (
            a["k"].astype(f32) if cache.kind != "int8" else dequantize_int8(a["k"], a["k_scale"])
        )
        return k_BxGxTxK, k_BxGxTxK[..., : cache.value_dim]
    if cache.kind in ("float32", "bfloat16"):
        return a["k"].astype(f32), a["v"].astype(f32)
    if cache.kind == "int8":
        return dequantize_int8(a["k"], a["k_scale"]), dequantize_int8(a["v"], a["v_scale"])
    bits = KIVI_BITS[cache.kind]
    k_BxGxTxK = dequantize_kivi_keys(a["k"], a["k_scale"], a["k_zero"], group, bits)
    v_BxGxTxK = dequantize_kivi_values(a["v"], a["v_scale"], a["v_zero"], group, bits)
    t = geo.seq_len
    start_B = (jnp.asarray(lengths_B, jnp.int32) // group) * group
    offset_BxT = jnp.arange(t)[None, :] - start_B[:, None]  # row in the residual
    in_res_BxT = (offset_BxT >= 0) & (offset_BxT < group)
    rows_BxT = jnp.clip(offset_BxT, 0, group - 1)

    def overlay(x_BxGxTxK, res_BxGxRxK):
        from_res = jnp.take_along_axis(res_BxGxRxK.astype(f32), rows_BxT[:, None, :, None], 2)
        return jnp.where(in_res_BxT[:, None, :, None], from_res, x_BxGxTxK)

    return overlay(k_BxGxTxK, a["k_res"]), overlay(v_BxGxTxK, a["v_res"])


def visible_BxMxT(lengths_B, token_pos_BxT, num_queries: int, num_rows: int, sliding_window=None):
    """[B, M, T] mask: row m (query m % Q of a query head) sees token positions <= its own,
    and with a sliding window w > 0 (int or traced int32; 0 is none) only the last w of them.

    Rows are ordered (query head r of the kv group, query i) -> r * Q + i, as in the kernel.
    """
    q_pos_BxM = _query_positions(lengths_B, num_queries, num_rows)
    return attention_mask(q_pos_BxM, token_pos_BxT, causal=True, sliding_window=sliding_window)


def _query_positions(lengths_B, num_queries: int, num_rows: int):
    """[B, M] position of each query row."""
    query_1xM = (jnp.arange(num_rows) % num_queries)[None, :]
    return jnp.asarray(lengths_B, jnp.int32)[:, None] - num_queries + query_1xM


def attend_partial(
    q_BxGxMxK,
    k_BxGxTxK,
    v_BxGxTxK,
    visible_BxMxT,
    *,
    sm_scale,
    soft_cap,
    bias_BxGxMxT=None,
    sinks_1xGxMx1=None,
):
    """Softmax attention of q rows over the visible tokens, in float32 (`bias` added to the
    capped logits: ALiBi). `sinks_1xGxMx1`: a logit per row in the denominator only (attention
    sinks); the lse then includes it.

    Returns (out [B, G, M, K] normalized over this part, lse [B, G, M, 1]); rows that see no
    token give out 0 and lse MASK_VALUE, so parts merge by logsumexp without NaN.
    """
    products_BxGxMxT = jnp.einsum(
        "bgmk,bgtk->bgmt",
        q_BxGxMxK.astype(jnp.float32),
        k_BxGxTxK.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )
    mask_Bx1xMxT = visible_BxMxT[:, None]
    s_BxGxMxT, _ = masked_logits(
        products_BxGxMxT, mask_Bx1xMxT, scale=sm_scale, soft_cap=soft_cap, bias=bias_BxGxMxT
    )
    m_BxGxMx1 = jnp.max(s_BxGxMxT, axis=-1, keepdims=True)
    if sinks_1xGxMx1 is not None:
        m_BxGxMx1 = jnp.maximum(m_BxGxMx1, sinks_1xGxMx1.astype(jnp.float32))
    p_BxGxMxT = jnp.where(mask_Bx1xMxT, jnp.exp(s_BxGxMxT - m_BxGxMx1), 0.0)
    l_BxGxMx1 = jnp.sum(p_BxGxMxT, axis=-1, keepdims=True)
    if sinks_1xGxMx1 is not None:  # the sink's share of the denominator; its value is 0
        l_BxGxMx1 = l_BxGxMx1 + jnp.exp(sinks_1xGxMx1.astype(jnp.float32) - m_BxGxMx1)
    l_safe = jnp.where(l_BxGxMx1 == 0.0, 1.0, l_BxGxMx1)
    # Values of tokens no row sees are zeroed: probability 0 times stale cache contents (even
    # NaN) must not reach the output.
    seen_Bx1xTx1 = jnp.any(visible_BxMxT, axis=1)[:, None, :, None]
    v_BxGxTxK = jnp.where(seen_Bx1xTx1, v_BxGxTxK.astype(jnp.float32), 0.0)
    out_BxGxMxK = (
        jnp.einsum(
            "bgmt,bgtk->bgmk",
            p_BxGxMxT,
            v_BxGxTxK,
            precision=lax.Precision.HIGHEST,
        )
        / l_safe
    )
    return out_BxGxMxK, m_BxGxMx1 + jnp.log(l_safe)


def rows_from_queries(q_BxQxHxK, num_kv_heads: int):
    """[B, Q, H, K] -> [B, G, R * Q, K]: the R query heads of kv head g, query-minor."""
    b, nq, h, d = q_BxQxHxK.shape
    r = h // num_kv_heads
    q_BxGxRxQxK = q_BxQxHxK.reshape(b, nq, num_kv_heads, r, d).transpose(0, 2, 3, 1, 4)
    return q_BxGxRxQxK.reshape(b, num_kv_heads, r * nq, d)


def queries_from_rows(x_BxGxMxK, num_queries: int):
    """Inverse of `rows_from_queries`."""
    b, g, m, d = x_BxGxMxK.shape
    x_BxGxRxQxK = x_BxGxMxK.reshape(b, g, m // num_queries, num_queries, d)
    return x_BxGxRxQxK.transpose(0, 3, 1, 2, 4).reshape(b, num_queries, m // num_queries * g, d)


def sink_rows(sinks_H, num_queries: int, num_kv_heads: int):
    """[H] per-head sink logits -> [1, G, M, 1] laid out like the query rows."""
    h = sinks_H.shape[0]
    sinks_1xQxHx1 = jnp.broadcast_to(
        jnp.asarray(sinks_H, jnp.float32)[None, None, :, None], (1, num_queries, h, 1)
    )
    return rows_from_queries(sinks_1xQxHx1, num_kv_heads)


def decode_attention_reference(
    q_BxQxHxK,
    cache: KVCache,
    lengths_B,
    *,
    layer=None,
    sm_scale=None,
    soft_cap=None,
    sliding_window=None,
    alibi_slopes_H=None,
    sinks_H=None,
):
    """Same contract as `decode_attention`: [B, Q, H, K] in q's dtype; length-0 rows give 0."""
    geo = cache_geometry(cache)
    b, nq, h, d = q_BxQxHxK.shape
    if h % geo.num_kv_heads or d != geo.head_dim or b != geo.batch:
        raise ValueError(f"q {q_BxQxHxK.shape} does not match the cache {geo}")
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    k_BxGxTxK, v_BxGxTxK = dequantize_cache(cache, lengths_B, layer=layer)
    q_BxGxMxK = rows_from_queries(q_BxQxHxK, geo.num_kv_heads)
    m = q_BxGxMxK.shape[2]
    pos_BxT = jnp.broadcast_to(jnp.arange(geo.seq_len)[None, :], (b, geo.seq_len))
    visible = visible_BxMxT(lengths_B, pos_BxT, nq, m, sliding_window)
    bias_BxGxMxT = None
    if alibi_slopes_H is not None:  # -slope * distance, slopes laid out like the query rows
        slopes_1xQxHx1 = jnp.broadcast_to(
            jnp.asarray(alibi_slopes_H, jnp.float32)[None, None, :, None], (1, nq, h, 1)
        )
        slopes_1xGxMx1 = rows_from_queries(slopes_1xQxHx1, geo.num_kv_heads)
        distance_BxMxT = _query_positions(lengths_B, nq, m)[:, :, None] - pos_BxT[:, None, :]
        bias_BxGxMxT = -slopes_1xGxMx1 * distance_BxMxT[:, None].astype(jnp.float32)
    out_BxGxMxK, _ = attend_partial(
        q_BxGxMxK,
        k_BxGxTxK,
        v_BxGxTxK,
        visible,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        bias_BxGxMxT=bias_BxGxMxT,
        sinks_1xGxMx1=None if sinks_H is None else sink_rows(sinks_H, nq, geo.num_kv_heads),
    )
    return queries_from_rows(out_BxGxMxK, nq).astype(q_BxQxHxK.dtype)
