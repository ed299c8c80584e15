"""FlashAttention-2 forward and backward as streaming Mosaic TPU kernels (arXiv:2307.08691).

The contract (layouts, masks, rows with no visible key, float32 statistics) is that of every
backend, in `common.py`, as are the block ranges, masks and matmul forms used here.

Written in the TPU-native grid style of JAX's `pallas/ops/tpu/flash_attention.py` and splash
attention: the blocks of the other sequence are the innermost grid axis ("arbitrary": sequential
on one core), and the running max / sum / accumulators live in VMEM scratch, initialised at the
first inner step and written out at the last. Each step holds one [bq, K] q tile and one [bk, K]
k/v tile (plus their segment-id slices), so VMEM use does not depend on the sequence length; the
Triton style (`triton.py`) of holding a whole K/V (or Q/dO) per program caps the length by VMEM.

- forward, grid (B, H, L/bq, kv steps): online softmax over the kv blocks of kv head h // R.
- dq, grid (B, H, L/bq, kv steps): recomputes p = exp(s - lse) per kv block, dq += ds k.
- dk/dv, grid (B, G, S/bk, R, q steps): the R query heads of kv head g and their q blocks are
  the two inner axes, so GQA gradients are summed in VMEM and K/V are never repeated in memory.

Block skipping: the static masks (causal, sliding window) give each row block a range [lo, hi)
of blocks of the other sequence (`common.kv_block_range` / `q_block_range`). Inner step t
visits block lo + t; the inner axis is as long as the longest range (a sliding window needs only
about (w + bq) / bk steps, not S / bk). Steps past hi run no compute (`pl.when`) and their index
map repeats block hi - 1, which the Pallas TPU pipeline does not fetch again (as JAX's TPU flash
kernel does), so fully masked blocks cost neither compute nor DMA. Visited blocks that lie inside
every mask (no diagonal or window edge, no padded row or key, no segment ids) skip the
per-element mask too. Segment ids are applied per element in every visited block: blocks are
not skipped by document (splash attention's block-sparse mask info would do that).

The running max and sum are kept lane-replicated as [bq, 128] float32 (as in JAX's TPU kernels):
the row statistics then broadcast against [bq, bk] and [bq, K] tiles without relayouts. The dk/dv
kernel computes scores as [bq, bk] like the others, so dv += p^T do and dk += ds^T q take a
transposed operand (as in JAX's TPU flash dk/dv kernel).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
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

NUM_LANES = 128  # lane width of a TPU vector register: the row statistics' minor dim


def _compiler_params(num_parallel: int, num_sequential: int):
    """Outer grid axes are independent (split across TensorCores); the inner ones carry the
    scratch accumulators from step to step, so they must run in order on one core."""
    return pltpu.CompilerParams(
        dimension_semantics=("parallel",) * num_parallel + ("arbitrary",) * num_sequential
    )


def _lanes(x_Nx128, n: int):
    """A lane-replicated [N, 128] row statistic as [N, n] (n = bk or K)."""
    if n % NUM_LANES == 0:
        return jnp.tile(x_Nx128, (1, n // NUM_LANES))
    if n < NUM_LANES:
        return x_Nx128[:, :n]
    return jnp.broadcast_to(x_Nx128[:, :1], (x_Nx128.shape[0], n))


def _schedule(block_range, num_rows: int, num_cols: int, cfg: Config):
    """(inner steps, visited blocks) of a grid whose row block i visits columns
    `block_range(i)`: the inner axis is the longest range (at least 1, so every row block has a
    last step that writes its outputs); the visited count feeds the cost estimate."""
    with jax.ensure_compile_time_eval():  # static: evaluated while tracing, on concrete indices
        lo, hi = block_range(jnp.arange(num_rows, dtype=jnp.int32), cfg, num_cols)
        counts = np.broadcast_to(np.maximum(np.asarray(hi) - np.asarray(lo), 0), (num_rows,))
    return max(1, int(counts.max())), int(counts.sum())


def _visited(block_range, row, step, cfg: Config, num_cols: int):
    """(block index, visible) of inner step `step` of row block `row`: blocks lo, lo + 1, ... while
    visible; past hi the index stays at hi - 1 (the block of the previous step: no new DMA)."""
    lo, hi = block_range(row, cfg, num_cols)
    return jnp.minimum(lo + step, hi - 1), lo + step < hi


def _needs_mask(q_start, k_start, cfg: Config, pad_q: bool):
    """Whether `common.block_mask` may hide an entry of the block at (q_start, k_start): False (a
    Python bool) when no mask applies at all, a traced bool otherwise."""
    if cfg.has_segments:
        return True
    bq, bk, w = cfg.block_q, cfg.block_kv, cfg.sliding_window
    q_last, k_last = q_start + (bq - 1), k_start + (bk - 1)
    edges = []
    if cfg.kv_len % bk:
        edges.append(k_last >= cfg.kv_len)  # padded keys
    if pad_q and cfg.q_len % bq:
        edges.append(q_last >= cfg.q_len)  # padded queries
    if cfg.causal:
        edges.append(k_last > q_start)  # not all k <= q
    if w is not None:
        edges.append(q_last - w >= k_start)  # not all q - w < k
        if not cfg.causal:
            edges.append(k_last >= q_start + w)  # not all k < q + w
    return functools.reduce(operator.or_, edges) if edges else False


def _when_visible(visible, needs_mask, body):
    """Runs body(masked) on a visible block: the masked variant only where the block needs it."""
    if isinstance(needs_mask, bool):
        pl.when(visible)(functools.partial(body, needs_mask))
        return
    pl.when(visible & needs_mask)(functools.partial(body, True))
    pl.when(visible & jnp.logical_not(needs_mask))(functools.partial(body, False))


def _cost(cfg: Config, num_programs: int, visited: int, matmuls: int, nbytes: int, d: int):
    """Cost estimate for XLA's scheduler: `matmuls` [bq, bk, K] matmuls and one exp (+ tanh with
    a soft cap) per score of each visited block."""
    scores = num_programs * visited * cfg.block_q * cfg.block_kv
    return pl.CostEstimate(
        flops=2 * d * matmuls * scores,
        transcendentals=scores * (1 if cfg.soft_cap is None else 2),
        bytes_accessed=nbytes,
    )


def _split_ids(refs, cfg: Config):
    """(q_ids_ref, kv_ids_ref, rest): segment-id refs come first when the call has them."""
    if cfg.has_segments:
        return refs[0], refs[1], refs[2:]
    return None, None, refs


# ----------------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: Config, num_kv_blocks: int, num_steps: int):
    qid_ref, kvid_ref, (o_ref, lse_ref, m_scr, l_scr, acc_scr) = _split_ids(refs, cfg)
    q_block, step = pl.program_id(2), pl.program_id(3)
    bq, bk, d = cfg.block_q, cfg.block_kv, q_ref.shape[-1]
    kv_block, visible = _visited(kv_block_range, q_block, step, cfg, num_kv_blocks)
    q_start, k_start = q_block * bq, kv_block * bk

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def body(masked: bool):
        v = v_ref[...]
        s, _ = block_scores(q_ref[...], k_ref[...], cfg)
        if masked:
            q_ids, kv_ids = (qid_ref[...], kvid_ref[...]) if cfg.has_segments else (None, None)
            mask = block_mask(q_start, k_start, q_ids, kv_ids, cfg, bq, pad_q=False)
            s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_scr[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - _lanes(m_next, bk))
        if masked:  # a row with no visible key so far has m_next == MASK_VALUE: p would be 1
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_scr[...] = m_next
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[...] = _lanes(alpha, d) * acc_scr[...] + dot_nn(p.astype(v.dtype), v)

    _when_visible(visible, _needs_mask(q_start, k_start, cfg, pad_q=False), body)

    @pl.when(step == num_steps - 1)
    def _finish():
        l = l_scr[...]
        l_safe = jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: out 0, no NaN
        o_ref[...] = (acc_scr[...] * _lanes(1.0 / l_safe, d)).astype(o_ref.dtype)
        lse_ref[...] = (m_scr[...] + jnp.log(l_safe))[:, :1]  # MASK_VALUE for empty rows


def forward(q, k, v, q_ids, kv_ids, cfg: Config):
    """q [B, H, Lp, K], k/v [B, G, Sp, K] -> (out [B, H, Lp, K], lse [B, H, Lp, 1] f32)."""
    b, h, lp, d = q.shape
    g, sp = k.shape[1], k.shape[2]
    r = h // g
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = lp // bq, sp // bk
    num_steps, visited = _schedule(kv_block_range, nq, nk, cfg)

    def kv_block(qi, j):
        return _visited(kv_block_range, qi, j, cfg, nk)[0]

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec(
        (None, None, bk, d), lambda bi, hi, qi, j: (bi, lax.div(hi, r), kv_block(qi, j), 0)
    )
    lse_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    ids = []
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda bi, hi, qi, j: (bi, qi, 0)),
            pl.BlockSpec((None, 1, bk), lambda bi, hi, qi, j: (bi, 0, kv_block(qi, j))),
        ]
        ids = [q_ids, kv_ids]
    item = q.dtype.itemsize
    nbytes = b * h * (2 * lp * d * item + lp * 4 + visited * 2 * bk * d * item)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, num_kv_blocks=nk, num_steps=num_steps),
        grid=(b, h, nq, num_steps),
        in_specs=in_specs,
        out_specs=[q_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, lp, 1), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # running max m
            pltpu.VMEM((bq, NUM_LANES), jnp.float32),  # running sum l
            pltpu.VMEM((bq, d), jnp.float32),  # unnormalised output
        ],
        compiler_params=_compiler_params(3, 1),
        cost_estimate=_cost(cfg, b * h, visited, 2, nbytes, d),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(q, k, v, *ids)


# ---------------------------------------------------------------------------------- backward


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    cfg: Config,
    num_kv_blocks: int,
    num_steps: int,
):
    qid_ref, kvid_ref, (dq_ref, dq_scr) = _split_ids(refs, cfg)
    q_block, step = pl.program_id(2), pl.program_id(3)
    bq, bk = cfg.block_q, cfg.block_kv
    kv_block, visible = _visited(kv_block_range, q_block, step, cfg, num_kv_blocks)
    q_start, k_start = q_block * bq, kv_block * bk

    @pl.when(step == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def body(masked: bool):
        k = k_ref[...]
        s, t = block_scores(q_ref[...], k, cfg)
        p = jnp.exp(s - lse_ref[...])
        if masked:
            q_ids, kv_ids = (qid_ref[...], kvid_ref[...]) if cfg.has_segments else (None, None)
            p = jnp.where(block_mask(q_start, k_start, q_ids, kv_ids, cfg, bq, pad_q=False), p, 0.0)
        ds = p * (dot_nt(do_ref[...], v_ref[...]) - delta_ref[...])
        if t is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        dq_scr[...] += dot_nn(ds.astype(k.dtype), k)

    _when_visible(visible, _needs_mask(q_start, k_start, cfg, pad_q=False), body)

    @pl.when(step == num_steps - 1)
    def _finish():
        dq_ref[...] = (dq_scr[...] * jnp.float32(cfg.sm_scale)).astype(dq_ref.dtype)


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    cfg: Config,
    num_q_blocks: int,
    num_heads_per_kv: int,
    num_steps: int,
):
    qid_ref, kvid_ref, (dk_ref, dv_ref, dk_scr, dv_scr) = _split_ids(refs, cfg)
    kv_block, head, step = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    bq, bk = cfg.block_q, cfg.block_kv
    q_block, visible = _visited(q_block_range, kv_block, step, cfg, num_q_blocks)
    q_start, k_start = q_block * bq, kv_block * bk

    @pl.when((head == 0) & (step == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def body(masked: bool):
        q, do = q_ref[...], do_ref[...]
        s, t = block_scores(q, k_ref[...], cfg)
        p = jnp.exp(s - lse_ref[...])
        if masked:
            q_ids, kv_ids = (qid_ref[...], kvid_ref[...]) if cfg.has_segments else (None, None)
            p = jnp.where(block_mask(q_start, k_start, q_ids, kv_ids, cfg, bq, pad_q=True), p, 0.0)
        dv_scr[...] += dot_tn(p.astype(do.dtype), do)
        ds = p * (dot_nt(do, v_ref[...]) - delta_ref[...])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk_scr[...] += dot_tn(ds.astype(q.dtype), q)

    _when_visible(visible, _needs_mask(q_start, k_start, cfg, pad_q=True), body)

    @pl.when((head == num_heads_per_kv - 1) & (step == num_steps - 1))
    def _finish():
        dk_ref[...] = (dk_scr[...] * jnp.float32(cfg.sm_scale)).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


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
    nq, nk = lp // bq, sp // bk
    item = q.dtype.itemsize
    delta = backward_delta(out, do, dlse)

    # dq: one q block of head h per program, kv blocks of kv head h // R on the inner axis.
    dq_steps, dq_visited = _schedule(kv_block_range, nq, nk, cfg)

    def kv_block(qi, j):
        return _visited(kv_block_range, qi, j, cfg, nk)[0]

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda bi, hi, qi, j: (bi, hi, qi, 0))
    kv_spec = pl.BlockSpec(
        (None, None, bk, d), lambda bi, hi, qi, j: (bi, lax.div(hi, r), kv_block(qi, j), 0)
    )
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    ids = []
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda bi, hi, qi, j: (bi, qi, 0)),
            pl.BlockSpec((None, 1, bk), lambda bi, hi, qi, j: (bi, 0, kv_block(qi, j))),
        ]
        ids = [q_ids, kv_ids]
    nbytes = b * h * (3 * lp * d * item + 2 * lp * 4 + dq_visited * 2 * bk * d * item)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, num_kv_blocks=nk, num_steps=dq_steps),
        grid=(b, h, nq, dq_steps),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=_compiler_params(3, 1),
        cost_estimate=_cost(cfg, b * h, dq_visited, 3, nbytes, d),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, *ids)

    # dk/dv: one kv block of kv head g per program; its R query heads, then their q blocks, on
    # the two inner axes.
    kv_steps, kv_visited = _schedule(q_block_range, nk, nq, cfg)

    def q_block(ki, i):
        return _visited(q_block_range, ki, i, cfg, nq)[0]

    def q_index(bi, gi, ki, ri, i):
        return (bi, gi * r + ri, q_block(ki, i), 0)

    q_rows_spec = pl.BlockSpec((None, None, bq, d), q_index)
    stat_spec = pl.BlockSpec((None, None, bq, 1), q_index)
    kv_block_spec = pl.BlockSpec((None, None, bk, d), lambda bi, gi, ki, ri, i: (bi, gi, ki, 0))
    in_specs = [q_rows_spec, kv_block_spec, kv_block_spec, q_rows_spec, stat_spec, stat_spec]
    ids = []
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda bi, gi, ki, ri, i: (bi, q_block(ki, i), 0)),
            pl.BlockSpec((None, 1, bk), lambda bi, gi, ki, ri, i: (bi, 0, ki)),
        ]
        ids = [q_ids, kv_ids]
    nbytes = b * g * (4 * sp * d * item + r * kv_visited * 2 * bq * (d * item + 4))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkdv_kernel, cfg=cfg, num_q_blocks=nq, num_heads_per_kv=r, num_steps=kv_steps
        ),
        grid=(b, g, nk, r, kv_steps),
        in_specs=in_specs,
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)],
        compiler_params=_compiler_params(3, 2),
        cost_estimate=_cost(cfg, b * h, kv_visited, 4, nbytes, d),
        interpret=cfg.interpret,
        name="flash_attention_dkdv",
    )(q, k, v, do, lse, delta, *ids)
    return dq, dk, dv
