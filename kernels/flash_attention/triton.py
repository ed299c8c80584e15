"""FlashAttention-2 forward and backward as Pallas Triton kernels (Dao 2023, arXiv:2307.08691).

The contract, masks and numerics of every backend are in `common.py`. One program handles one
block of rows and loops over the blocks of the other sequence inside the kernel (the whole padded
K/V of one kv head, resp. the whole padded Q of its R query heads, is one block), since Triton
programs cannot carry state across grid steps. Static masks (causal, sliding window) shrink the
loop bounds, so fully masked blocks are never visited; dynamic masks (segments, the padded tail)
are applied per block.

- forward, grid (B, H, L/bq): online softmax over kv blocks, returns out and logsumexp.
- dq, grid (B, H, L/bq): recomputes p = exp(s - lse) per kv block, dq = sum_j ds_j k_j.
- dk/dv, grid (B, G, S/bk): loops over the R query heads of kv head g and over the q blocks, so
  GQA gradients are summed in the kernel and K/V are never repeated in memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxllm.kernels.flash_attention.common import (
    Config,
    backward_delta,
    block_mask,
    block_scores,
    dot_nn,
    dot_nt,
    dot_tn,
    kv_block_range,
    q_block_range,
)
from jaxllm.kernels.reference import MASK_VALUE


def _compiler_params(cfg: Config):
    if cfg.backend != "triton":
        raise ValueError(f"triton.py implements backend 'triton', not {cfg.backend!r}")
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, k_ref, v_ref, qid_ref, kvid_ref, o_ref, lse_ref, *, cfg: Config):
    q_block = pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    q = q_ref[...]
    q_ids = qid_ref[...] if cfg.has_segments else None
    lo, hi = kv_block_range(q_block, cfg, k_ref.shape[0] // bk)

    def body(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s, _ = block_scores(q, k, cfg)
        kv_ids = kvid_ref[:, pl.ds(start, bk)] if cfg.has_segments else None
        mask = block_mask(q_block * bq, start, q_ids, kv_ids, cfg, bq, pad_q=False)
        if mask is not None:
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if mask is not None:  # a row with no visible key so far has m_new == MASK_VALUE
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + dot_nn(p.astype(v.dtype), v)
        return m_new, l, acc

    m0 = jnp.full((bq, 1), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((bq, 1), jnp.float32)
    acc0 = jnp.zeros((bq, q.shape[1]), jnp.float32)
    m, l, acc = lax.fori_loop(lo, hi, body, (m0, l0, acc0))
    l_safe = jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: out 0, no NaN
    o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l_safe)


def forward(q, k, v, q_ids, kv_ids, cfg: Config):
    """q [B, H, Lp, K], k/v [B, G, Sp, K] -> (out [B, H, Lp, K], lse [B, H, Lp, 1] f32)."""
    b, h, lp, d = q.shape
    g, sp = k.shape[1], k.shape[2]
    r = h // g
    bq = cfg.block_q
    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec((None, None, sp, d), lambda bi, hi, qi: (bi, lax.div(hi, r), 0, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, qi: (bi, hi, qi, 0))
    qid_spec = pl.BlockSpec((None, bq, 1), lambda bi, hi, qi: (bi, qi, 0))
    kvid_spec = pl.BlockSpec((None, 1, sp), lambda bi, hi, qi: (bi, 0, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(b, h, lp // bq),
        in_specs=[q_spec, kv_spec, kv_spec, qid_spec, kvid_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, lp, 1), jnp.float32),
        ],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, q_ids, kv_ids)


# ---------------------------------------------------------------------------------- backward


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref, kvid_ref, dq_ref, *, cfg: Config
):
    q_block = pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_ids = qid_ref[...] if cfg.has_segments else None
    lo, hi = kv_block_range(q_block, cfg, k_ref.shape[0] // bk)

    def body(j, dq):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s, t = block_scores(q, k, cfg)
        p = jnp.exp(s - lse)
        kv_ids = kvid_ref[:, pl.ds(start, bk)] if cfg.has_segments else None
        mask = block_mask(q_block * bq, start, q_ids, kv_ids, cfg, bq, pad_q=False)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        ds = p * (dot_nt(do, v) - delta)
        if t is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * jnp.float32(cfg.sm_scale)).astype(dq_ref.dtype)


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qid_ref,
    kvid_ref,
    dk_ref,
    dv_ref,
    *,
    cfg: Config,
    num_heads_per_kv: int,
    q_len_padded: int,
):
    kv_block = pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    k, v = k_ref[...], v_ref[...]
    kv_ids = kvid_ref[...] if cfg.has_segments else None
    num_q_blocks = q_len_padded // bq
    lo, hi = q_block_range(kv_block, cfg, num_q_blocks)

    def q_body(i, carry, r):
        dk, dv = carry
        q_start = pl.multiple_of(i * bq, bq)
        row = pl.multiple_of(r * q_len_padded + q_start, bq)  # rows of query head g * R + r
        q = q_ref[pl.ds(row, bq), :]
        do = do_ref[pl.ds(row, bq), :]
        lse = lse_ref[pl.ds(row, bq), :]
        delta = delta_ref[pl.ds(row, bq), :]
        s, t = block_scores(q, k, cfg)
        p = jnp.exp(s - lse)
        q_ids = qid_ref[pl.ds(q_start, bq), :] if cfg.has_segments else None
        mask = block_mask(q_start, kv_block * bk, q_ids, kv_ids, cfg, bq, pad_q=True)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dv = dv + dot_tn(p.astype(do.dtype), do)
        ds = p * (dot_nt(do, v) - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk = dk + dot_tn(ds.astype(q.dtype), q)
        return dk, dv

    def head_body(r, carry):
        return lax.fori_loop(lo, hi, functools.partial(q_body, r=r), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, num_heads_per_kv, head_body, (zeros, zeros))
    dk_ref[...] = (dk * jnp.float32(cfg.sm_scale)).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(q, k, v, out, lse, do, q_ids, kv_ids, cfg: Config, dlse=None):
    """Gradients (dq, dk, dv) of `forward` given the cotangents `do` of its output and, optionally,
    `dlse` [B, H, Lp, 1] float32 of its logsumexp.

    `out` / `lse` need not be this call's own: given the statistics of a longer attention whose
    keys include these (ring attention), p = exp(s - lse) is that attention's probability and the
    result is this block's share of its gradients.
    """
    b, h, lp, d = q.shape
    g, sp = k.shape[1], k.shape[2]
    r = h // g
    bq, bk = cfg.block_q, cfg.block_kv
    delta = backward_delta(out, do, dlse)

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, qi: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec((None, None, sp, d), lambda bi, hi, qi: (bi, lax.div(hi, r), 0, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, qi: (bi, hi, qi, 0))
    qid_spec = pl.BlockSpec((None, bq, 1), lambda bi, hi, qi: (bi, qi, 0))
    kvid_spec = pl.BlockSpec((None, 1, sp), lambda bi, hi, qi: (bi, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(b, h, lp // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, qid_spec, kvid_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, q_ids, kv_ids)

    # The R query heads of kv head g are rows [g * R * Lp, (g + 1) * R * Lp) of this view.
    def by_kv_head(x):
        return x.reshape(b, g, r * lp, x.shape[-1])

    rows_spec = pl.BlockSpec((None, None, r * lp, d), lambda bi, gi, ki: (bi, gi, 0, 0))
    stat_spec = pl.BlockSpec((None, None, r * lp, 1), lambda bi, gi, ki: (bi, gi, 0, 0))
    kv_block_spec = pl.BlockSpec((None, None, bk, d), lambda bi, gi, ki: (bi, gi, ki, 0))
    qids_spec = pl.BlockSpec((None, lp, 1), lambda bi, gi, ki: (bi, 0, 0))
    kvids_spec = pl.BlockSpec((None, 1, bk), lambda bi, gi, ki: (bi, 0, ki))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, num_heads_per_kv=r, q_len_padded=lp),
        grid=(b, g, sp // bk),
        in_specs=[
            rows_spec,
            kv_block_spec,
            kv_block_spec,
            rows_spec,
            stat_spec,
            stat_spec,
            qids_spec,
            kvids_spec,
        ],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=_compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_attention_dkdv",
    )(by_kv_head(q), k, v, by_kv_head(do), by_kv_head(lse), by_kv_head(delta), q_ids, kv_ids)
    return dq, dk, dv
