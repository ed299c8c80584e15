"""Warp-specialised FlashAttention forward for Hopper (sm_90) in Mosaic GPU, after
FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) and JAX's Pallas example
`jax.experimental.pallas.ops.gpu.attention_mgpu`.

Chosen by `BlockSizes(warp_specialized=True)` (`Config.warp_specialized`); the backward is the
one of `mosaic_gpu_backward.py` (or, with `fused_backward=True`, of `mosaic_gpu_fused_backward.py`)
with its default 64 / 64 blocks (`ops.py`). The contract (layouts,
masks, empty rows, float32 statistics, p rounded to the input dtype) is that of `common.py`, and
every mask of `mosaic_gpu.py` is supported: causal, sliding window, segment ids (packed
documents, cross attention), soft cap, GQA / MQA; sinks are applied outside the kernels by
`ops.py`.

Each program owns a tile of `block_q` query rows of one head and runs three warpgroups
(`plgpu.kernel(num_threads=3, thread_name="wg")`):
- two consumers, wg 0 and 1, each with `block_q / 2` rows of q resident in SMEM, its own float32
  online-softmax state and accumulator in registers;
- one producer, wg 2, that gives its registers to the consumers (`set_max_registers`) and only
  streams the kv blocks [lo, hi) of the tile (`common.kv_block_range`) through NUM_SLOTS SMEM
  slots with TMA: it refills a slot once both consumers have arrived on that slot's "consumed"
  barrier (k^T after the q k^T wgmma, v and the kv segment ids after the p v wgmma).
- Ping-pong: a two-arrival schedule barrier orders the consumers so that one's softmax runs
  while the other's wgmmas hold the tensor cores (wg 1 starts one phase behind, wg 0 catches up
  at the end, so both pass the barrier equally often).
- p stays in registers: the p v wgmma takes its left operand from registers.
- Each consumer splits its kv loop: the blocks all of its rows see whole (`_unmasked_blocks`)
  skip the per-element mask; only the blocks at the causal diagonal, the window's edges and the
  padded kv tail (every block with segment ids) compute it.

As in `mosaic_gpu.py`, k is transposed once by XLA ([.., K, S] in GMEM) so that every SMEM operand
is a plain row-major tile. The Mosaic GPU interpreter of jax 0.10 (the CPU tests) takes wgmma
operands only from SMEM and has no `layout_cast` rule, so when interpreting p goes registers ->
the consumer's SMEM tile before its wgmma, the accumulator is a fresh one added to the rescaled
carry, and layout hints are skipped; each changes no value. Compiled, p and the carried
accumulator feed the wgmma directly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxllm.kernels.flash_attention import mosaic_gpu as mg
from jaxllm.kernels.flash_attention.common import (
    MOSAIC_GPU_BLOCK_MULTIPLE,
    Config,
    kv_block_range,
    mask_from_positions,
    scale_and_cap,
)
from jaxllm.kernels.reference import MASK_VALUE

CONSUMERS = 2  # compute warpgroups per program; the producer is warpgroup CONSUMERS
NUM_SLOTS = 2  # kv slots in flight (2 x [128, 128] k^T and v tiles at K = 128: 128 KiB)
TILE_MULTIPLE = CONSUMERS * MOSAIC_GPU_BLOCK_MULTIPLE
# Register budgets (per thread) after the split, as in FlashAttention-3: the producer only
# issues copies.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


def check(dtype, head_dim: int, cfg: Config):
    mg.check(dtype, head_dim, cfg)
    if cfg.block_q % TILE_MULTIPLE:
        raise ValueError(
            f"warp-specialised mosaic_gpu flash attention needs block_q a multiple of "
            f"{TILE_MULTIPLE} ({CONSUMERS} warpgroups of {MOSAIC_GPU_BLOCK_MULTIPLE} rows), "
            f"got {cfg.block_q}"
        )


def _schedule(s):
    """One round on the two-consumer schedule barrier: arrive, then wait for the other one."""
    plgpu.barrier_arrive(s["schedule"])
    plgpu.barrier_wait(s["schedule"])


def _produce(kt_ref, v_ref, kvid_ref, b, g, lo, hi, cfg: Config, s):
    bk = cfg.block_kv

    def issue_kt(t, slot):
        cols = pl.ds(t * bk, bk)
        plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, cols], s["kt"].at[slot], s["kt_bar"].at[slot])

    def issue_v(t, slot):
        cols = pl.ds(t * bk, bk)
        plgpu.copy_gmem_to_smem(v_ref.at[b, g, cols], s["v"].at[slot], s["v_bar"].at[slot])
        if cfg.has_segments:
            plgpu.copy_gmem_to_smem(
                kvid_ref.at[b, cols], s["kvid"].at[slot], s["kvid_bar"].at[slot]
            )

    def issue(t, slot):
        issue_kt(t, slot)
        issue_v(t, slot)

    for d in range(NUM_SLOTS):
        pl.when(lo + d < hi)(functools.partial(issue, lo + d, d))

    def refill(t, _):
        slot = lax.rem(t - lo, NUM_SLOTS)
        plgpu.barrier_wait(s["kt_done"].at[slot])
        issue_kt(t, slot)
        plgpu.barrier_wait(s["v_done"].at[slot])
        issue_v(t, slot)

    lax.fori_loop(lo + NUM_SLOTS, hi, refill, None)

    def drain(t, _):  # the last consumption of each slot: no copy is left to issue
        slot = lax.rem(t - lo, NUM_SLOTS)
        plgpu.barrier_wait(s["kt_done"].at[slot])
        plgpu.barrier_wait(s["v_done"].at[slot])

    # Every phase of a barrier is observed by the warpgroups that wait on it (the interpreter
    # checks it when the barrier is freed); on the GPU this costs the idle producer nothing.
    lax.fori_loop(jnp.maximum(lo, hi - NUM_SLOTS), hi, drain, None)


def _pv(p, acc, alpha, slot, c, cfg: Config, s):
    """acc * alpha + p v for this consumer's rows, p [hq, bk] float32."""
    v_smem = s["v"].at[slot]
    if cfg.interpret:  # wgmma operands from SMEM only; a fresh accumulator
        mg.stage(p, s["p"].at[c])
        pv = mg.matmul(s["p"].at[c], v_smem, p.shape[0], acc.shape[1])
        return mg.row_broadcast(alpha, acc.shape) * acc + pv
    p16 = p.astype(s["v"].dtype)
    acc = mg.row_broadcast(alpha, acc.shape) * acc

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem)  # p from registers into the carried accumulator

    return pl.run_state(body)(plgpu.ACC.init(acc))


def _unmasked_blocks(q_start, rows: int, lo, hi, cfg: Config):
    """[a, b) within [lo, hi): the kv blocks that rows [q_start, q_start + rows) see whole under
    the static masks and the kv padding (empty with segment ids, which mask any block)."""
    bk, w = cfg.block_kv, cfg.sliding_window
    if cfg.has_segments:
        return hi, hi
    first, last = q_start, q_start + rows - 1
    a, b = lo, hi
    if cfg.kv_len % bk:  # the block holding the padded keys
        b = jnp.minimum(b, cfg.kv_len // bk)
    if cfg.causal:  # (t + 1) bk - 1 <= first
        b = jnp.minimum(b, lax.div(first + 1, bk))
    if w is not None:  # last - w < t bk (and (t + 1) bk <= first + w without causality)
        a = jnp.maximum(a, lax.div(jnp.maximum(last - w + 1, 0) + bk - 1, bk))
        if not cfg.causal:
            b = jnp.minimum(b, lax.div(first + w, bk))
    a = jnp.minimum(a, hi)
    return a, jnp.maximum(a, b)


def _consume(c, q_ref, qid_ref, o_ref, lse_ref, b, h, qi, lo, hi, cfg: Config, s):
    hq, bk, d = cfg.block_q // CONSUMERS, cfg.block_kv, q_ref.shape[-1]
    q_start = qi * cfg.block_q + c * hq
    rows = pl.ds(q_start, hq)
    q_smem = s["q"].at[c]
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, s["q_bar"].at[c])
    if cfg.has_segments:
        plgpu.copy_gmem_to_smem(qid_ref.at[b, rows], s["qid"].at[c], s["qid_bar"].at[c])
    shape = (hq, bk)
    q_pos = q_start + mg.iota(shape, 0, cfg)
    plgpu.barrier_wait(s["q_bar"].at[c])
    q_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["qid_bar"].at[c])
        q_ids = mg.row_broadcast(mg.load_vector(s["qid"].at[c], mg.ROW, cfg), shape)
    pl.when(c == 1)(functools.partial(_schedule, s))  # wg 1 starts one phase behind

    def step(t, carry, masked: bool = True):
        m, l, acc = carry
        slot = lax.rem(t - lo, NUM_SLOTS)
        plgpu.barrier_wait(s["kt_bar"].at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, s["kt"].at[slot])
            _schedule(s)  # the other consumer's p v wgmma goes next
            return acc_ref[...]

        sc = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(s["kt_done"].at[slot])
        sc, _ = scale_and_cap(sc, cfg)
        kv_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["kvid_bar"].at[slot])
            kv_ids = mg.col_broadcast(mg.load_vector(s["kvid"].at[slot], mg.COL, cfg), shape)
        k_pos = t * bk + mg.iota(shape, 1, cfg)
        mask = (
            mask_from_positions(q_pos, k_pos, q_ids, kv_ids, cfg, pad_q=False) if masked else None
        )
        if mask is not None:
            sc = jnp.where(mask, sc, MASK_VALUE)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.exp(sc - mg.row_broadcast(m_new, shape))
        if mask is not None:  # a row with no visible key so far has m_new == MASK_VALUE
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=1)
        plgpu.barrier_arrive(s["schedule"])  # softmax done
        plgpu.barrier_wait(s["v_bar"].at[slot])
        plgpu.barrier_wait(s["schedule"])  # the tensor cores are ours
        acc = _pv(p, acc, alpha, slot, c, cfg, s)
        plgpu.barrier_arrive(s["v_done"].at[slot])
        return m_new, l, acc

    m0 = mg.layout_hint(jnp.full((hq,), MASK_VALUE, jnp.float32), mg.ROW, cfg)
    l0 = mg.layout_hint(jnp.zeros((hq,), jnp.float32), mg.ROW, cfg)
    acc0 = mg.layout_hint(jnp.zeros((hq, d), jnp.float32), mg.TILE, cfg)
    # Blocks every row of this consumer sees whole skip the per-element mask (FlashAttention-3's
    # split of the kv loop): masked steps before, unmasked in [a, b), masked after.
    full_lo, full_hi = _unmasked_blocks(q_start, hq, lo, hi, cfg)
    carry = lax.fori_loop(lo, full_lo, step, (m0, l0, acc0))
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    m, l, acc = lax.fori_loop(full_hi, hi, step, carry)
    pl.when(c == 0)(functools.partial(_schedule, s))  # wg 0 catches up

    l_safe = jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: out 0, no NaN
    q_smem[...] = (acc / mg.row_broadcast(l_safe, acc.shape)).astype(q_smem.dtype)
    s["lse"].at[c][...] = m + jnp.log(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, rows])
    plgpu.copy_smem_to_gmem(s["lse"].at[c], lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def _kernel(q_ref, kt_ref, v_ref, qid_ref, kvid_ref, o_ref, lse_ref, *, cfg: Config, r: int, s):
    wg = lax.axis_index("wg")
    b, h, qi = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    lo, hi = kv_block_range(qi, cfg, kt_ref.shape[-1] // cfg.block_kv)

    @pl.when(wg < CONSUMERS)
    def _():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        _consume(wg, q_ref, qid_ref, o_ref, lse_ref, b, h, qi, lo, hi, cfg, s)

    @pl.when(wg == CONSUMERS)
    def _():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        _produce(kt_ref, v_ref, kvid_ref, b, lax.div(h, jnp.int32(r)), lo, hi, cfg, s)


def forward(q, k, v, q_ids, kv_ids, cfg: Config):
    """q [B, H, Lp, K], k/v [B, G, Sp, K] -> (out [B, H, Lp, K], lse [B, H, Lp, 1] f32)."""
    b, h, lp, d = q.shape
    g = k.shape[1]
    check(q.dtype, d, cfg)
    hq, bk = cfg.block_q // CONSUMERS, cfg.block_kv
    consumed = functools.partial(plgpu.Barrier, num_arrivals=CONSUMERS, num_barriers=NUM_SLOTS)
    scratch = dict(
        q=mg.tile_smem((CONSUMERS, hq, d), q.dtype),  # q in, then the output out
        kt=mg.tile_smem((NUM_SLOTS, d, bk), k.dtype),
        v=mg.tile_smem((NUM_SLOTS, bk, d), v.dtype),
        lse=plgpu.SMEM((CONSUMERS, hq), jnp.float32),
        q_bar=plgpu.Barrier(num_barriers=CONSUMERS),
        kt_bar=plgpu.Barrier(num_barriers=NUM_SLOTS),
        v_bar=plgpu.Barrier(num_barriers=NUM_SLOTS),
        kt_done=consumed(),
        v_done=consumed(),
        schedule=plgpu.Barrier(num_arrivals=CONSUMERS),
    )
    if cfg.interpret:
        scratch["p"] = mg.tile_smem((CONSUMERS, hq, bk), v.dtype)
    if cfg.has_segments:
        scratch.update(
            qid=plgpu.SMEM((CONSUMERS, hq), jnp.int32),
            kvid=plgpu.SMEM((NUM_SLOTS, bk), jnp.int32),
            qid_bar=plgpu.Barrier(num_barriers=CONSUMERS),
            kvid_bar=plgpu.Barrier(num_barriers=NUM_SLOTS),
        )

    def body(q_ref, kt_ref, v_ref, *refs, **s):
        ids_refs, (o_ref, lse_ref) = mg.split_ids(refs, cfg)
        _kernel(q_ref, kt_ref, v_ref, *ids_refs, o_ref, lse_ref, cfg=cfg, r=h // g, s=s)

    out, lse = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, lp), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(h, lp // cfg.block_q, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        # exp as ex2.approx, as FlashAttention-3 and JAX's example do: its error is far below
        # the input dtype's rounding of p
        compiler_params=dataclasses.replace(mg.compiler_params(), approx_math=True),
        interpret=mg.interpret_params(cfg),
        kernel_name="flash_attention_fwd_ws_mgpu",
    )(q, jnp.swapaxes(k, 2, 3), v, *mg.ids_inputs(q_ids, kv_ids, cfg))
    return out, lse[..., None]
