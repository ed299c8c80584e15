"""FlashAttention forward as a Mosaic GPU kernel for Hopper (sm_90), and the helpers that the
backward kernels (`mosaic_gpu_backward.py`) share with it.

The contract (layouts, masks, rows with no visible key, float32 statistics, p and ds rounded to
the input dtype for the second matmul of each pair) is that of every backend, in `common.py`.

(`mosaic_gpu_ws.py` is the warp-specialised alternative of this forward: three warpgroups per
program, FlashAttention-3's producer / consumer split and ping-pong; `mosaic_gpu_fused_backward.py`
the one-kernel alternative of the backward.)

Written in the Mosaic GPU style (`plgpu.kernel`): each program is one warpgroup that owns one
block of rows, keeps that block in shared memory (SMEM) and streams the blocks of the other
sequence through a two-slot software pipeline (`pipeline`): TMA copies GMEM -> SMEM signal one
barrier per slot, and the copies of step t + 2 are issued as soon as step t has finished reading
its slot, so one step of loads is always in flight behind the compute. Every matmul is a wgmma
with both operands in SMEM and a float32 register accumulator.

- forward, grid (H, L/bq, B): online softmax over the kv blocks of kv head h // R.
- dq, grid (H, L/bq, B): recomputes p = exp(s - lse) per kv block, dq = sum_j ds_j k_j.
- dk/dv, grid (G, S/bk, B): loops over the R query heads of kv head g and their q blocks, so GQA
  gradients are summed in the kernel and K/V are never repeated in memory.

Static masks (causal, sliding window) shrink the loop bounds exactly as in the other backends
(`common.kv_block_range` / `q_block_range`); inside the visited blocks, padded keys, padded
queries (dk/dv), causal / window edges and segment ids are masked per element.

Two choices are dictated by the Mosaic GPU interpreter of jax 0.10 (the CPU tests run every line
of these kernels in it), which cannot read a transposed SMEM view (`plgpu.transpose_ref`) in a
wgmma nor take a wgmma operand from registers:
- The operand that a matmul needs transposed (k in q k^T, v in do v^T, q and do in the dk/dv
  kernel) is transposed once by XLA in GMEM ([.., K, L] copies), and its blocks are loaded by TMA
  as [K, block] tiles, so every wgmma reads plain row-major SMEM tiles.
- p and ds go registers -> SMEM before their wgmma (FlashAttention-3 keeps p in registers).
Both cost bandwidth, not correctness; they are the first things to revisit when tuning on H100.
It has no rule for `layout_cast` either, so register layout hints are skipped when interpreting
(`layout_hint`, `iota`, `load_vector`): they change no value.

Inputs must be bfloat16 or float16 with head dim 64 or 128, and block sizes multiples of 64 (one
wgmma row tile per warpgroup); `common.mosaic_gpu_supported` says why a call cannot run here.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxllm.kernels.flash_attention.common import (
    Config,
    kv_block_range,
    mask_from_positions,
    mosaic_gpu_supported,
    scale_and_cap,
)
from jaxllm.kernels.reference import MASK_VALUE

try:  # the interpreter that runs these kernels on CPU; not re-exported by jax 0.10
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - older or newer jax without it at this path
    InterpretGPUParams = None

NUM_SLOTS = 2  # pipeline depth: the slot being computed on + the slot being filled
SWIZZLE_BYTES = 128

# Register layouts of Lane semantics: [M, N] wgmma tiles and the per-row / per-column vectors
# that broadcast against them.
TILE = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # indexed by the rows of a tile
COL = plgpu.Layout.WGMMA.reduce(0)  # indexed by the columns of a tile


def check(dtype, head_dim: int, cfg: Config):
    """Raises unless these kernels can run a call of this dtype, head dim and blocks."""
    reason = mosaic_gpu_supported(dtype, head_dim, (cfg.block_q, cfg.block_kv))
    if reason is not None:
        raise ValueError(f"mosaic_gpu flash attention does not support {reason}")


# ----------------------------------------------------------------------- in-kernel helpers


def layout_hint(x, layout, cfg: Config):
    """Register layout hint (a no-op in value); the interpreter has no rule for layout_cast."""
    return x if cfg.interpret else plgpu.layout_cast(x, layout)


def iota(shape, dim: int, cfg: Config):
    if cfg.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=TILE)


_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


def load(ref, layout, optimized: bool = True):
    """`plgpu.load` of a whole SMEM ref: jax 0.10 takes an index argument, newer jax none."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def load_vector(ref, layout, cfg: Config):
    """A 1-D SMEM vector into registers, laid out to broadcast against wgmma tiles."""
    return ref[...] if cfg.interpret else load(ref, layout)


def tile_smem(shape, dtype):
    """SMEM for a 2-D operand tile (optionally with leading slot dims): tiled and swizzled as TMA
    writes it and wgmma reads it."""
    elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def matmul(a_smem, b_smem, m: int, n: int):
    """a [m, k] @ b [k, n], both in SMEM, as one wgmma into a fresh float32 accumulator."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]  # waits for the wgmma

    return pl.run_scoped(body, plgpu.ACC((m, n), jnp.float32))


def stage(x, smem):
    """Registers -> SMEM, fenced so that the next wgmma or TMA store sees the writes."""
    smem[...] = x.astype(smem.dtype)
    plgpu.commit_smem()


def row_broadcast(v, shape):  # per-row vector -> [rows, cols]
    return lax.broadcast_in_dim(v, shape, [0])


def col_broadcast(v, shape):  # per-column vector -> [rows, cols]
    return lax.broadcast_in_dim(v, shape, [1])


def pipeline(lo, hi, issue, step, carry):
    """carry = step(t, slot, carry) for t in [lo, hi), double-buffered.

    `issue(t, slot)` starts the TMA copies of step t into `slot`; `step` waits for them. Slot s is
    refilled with step t + 2 only after step t returned, i.e. after its wgmmas were waited for.
    """
    for d in range(NUM_SLOTS):
        pl.when(lo + d < hi)(functools.partial(issue, lo + d, d))

    def body(t, carry):
        slot = lax.rem(t - lo, NUM_SLOTS)
        carry = step(t, slot, carry)
        pl.when(t + NUM_SLOTS < hi)(functools.partial(issue, t + NUM_SLOTS, slot))
        return carry

    return lax.fori_loop(lo, hi, body, carry)


def smem_scores(a_smem, b_smem, m: int, n: int, cfg: Config):
    """Scaled (and soft-capped) logits of one block from SMEM operands, plus tanh(s / cap) for the
    backward."""
    return scale_and_cap(matmul(a_smem, b_smem, m, n), cfg)


def barriers(streamed: bool = True):
    """One barrier per pipeline slot for a streamed buffer, a single one for a resident buffer."""
    return plgpu.Barrier(num_barriers=NUM_SLOTS if streamed else 1)


def ids_scratch(cfg: Config, q_streamed: bool) -> dict:
    """SMEM and barriers of the segment ids: the resident side's block and the streamed side's
    slots (kv ids stream in the forward and dq kernels, q ids in the dk/dv kernel)."""
    if not cfg.has_segments:
        return {}
    q_shape, kv_shape = (cfg.block_q,), (cfg.block_kv,)
    if q_streamed:
        q_shape = (NUM_SLOTS, *q_shape)
    else:
        kv_shape = (NUM_SLOTS, *kv_shape)
    return dict(
        qid=plgpu.SMEM(q_shape, jnp.int32),
        kvid=plgpu.SMEM(kv_shape, jnp.int32),
        qid_bar=barriers(q_streamed),
        kvid_bar=barriers(not q_streamed),
    )


def split_ids(refs, cfg: Config):
    """(q ids ref, kv ids ref) and the output refs: the id inputs exist only with segments."""
    return (refs[:2], refs[2:]) if cfg.has_segments else ((None, None), refs)


def ids_inputs(q_ids, kv_ids, cfg: Config):  # [B, Lp, 1], [B, 1, Sp] -> [B, Lp], [B, Sp]
    return (q_ids[:, :, 0], kv_ids[:, 0, :]) if cfg.has_segments else ()


def compiler_params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def interpret_params(cfg: Config):
    if not cfg.interpret:
        return None
    if InterpretGPUParams is None:  # pragma: no cover
        raise NotImplementedError("this jax has no Mosaic GPU interpreter")
    return InterpretGPUParams()


# ----------------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, kt_ref, v_ref, qid_ref, kvid_ref, o_ref, lse_ref, *, cfg: Config, r: int, s):
    bq, bk, d = cfg.block_q, cfg.block_kv, q_ref.shape[-1]
    b, h, qi = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    g = lax.div(h, jnp.int32(r))
    q_start = qi * bq
    q_rows = pl.ds(q_start, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, q_rows], s["q"], s["q_bar"])
    if cfg.has_segments:
        plgpu.copy_gmem_to_smem(qid_ref.at[b, q_rows], s["qid"], s["qid_bar"])

    def issue(j, slot):
        cols = pl.ds(j * bk, bk)
        plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, cols], s["kt"].at[slot], s["kt_bar"].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, g, cols], s["v"].at[slot], s["v_bar"].at[slot])
        if cfg.has_segments:
            plgpu.copy_gmem_to_smem(
                kvid_ref.at[b, cols], s["kvid"].at[slot], s["kvid_bar"].at[slot]
            )

    plgpu.barrier_wait(s["q_bar"])
    shape = (bq, bk)
    q_pos = q_start + iota(shape, 0, cfg)
    q_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["qid_bar"])
        q_ids = row_broadcast(load_vector(s["qid"], ROW, cfg), shape)

    def step(j, slot, carry):
        m, l, acc = carry
        plgpu.barrier_wait(s["kt_bar"].at[slot])
        sc, _ = smem_scores(s["q"], s["kt"].at[slot], bq, bk, cfg)
        kv_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["kvid_bar"].at[slot])
            kv_ids = col_broadcast(load_vector(s["kvid"].at[slot], COL, cfg), shape)
        mask = mask_from_positions(
            q_pos, j * bk + iota(shape, 1, cfg), q_ids, kv_ids, cfg, pad_q=False
        )
        if mask is not None:
            sc = jnp.where(mask, sc, MASK_VALUE)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.exp(sc - row_broadcast(m_new, shape))
        if mask is not None:  # a row with no visible key so far has m_new == MASK_VALUE
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=1)
        stage(p, s["p"])
        plgpu.barrier_wait(s["v_bar"].at[slot])
        pv = matmul(s["p"], s["v"].at[slot], bq, d)
        return m_new, l, row_broadcast(alpha, acc.shape) * acc + pv

    m0 = layout_hint(jnp.full((bq,), MASK_VALUE, jnp.float32), ROW, cfg)
    l0 = layout_hint(jnp.zeros((bq,), jnp.float32), ROW, cfg)
    acc0 = layout_hint(jnp.zeros((bq, d), jnp.float32), TILE, cfg)
    lo, hi = kv_block_range(qi, cfg, kt_ref.shape[-1] // bk)
    m, l, acc = pipeline(lo, hi, issue, step, (m0, l0, acc0))

    l_safe = jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: out 0, no NaN
    stage(acc / row_broadcast(l_safe, acc.shape), s["q"])  # q is dead: its SMEM holds the output
    s["lse"][...] = m + jnp.log(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s["q"], o_ref.at[b, h, q_rows])
    plgpu.copy_smem_to_gmem(s["lse"], lse_ref.at[b, h, q_rows])
    plgpu.wait_smem_to_gmem(0)


def forward(q, k, v, q_ids, kv_ids, cfg: Config):
    """q [B, H, Lp, K], k/v [B, G, Sp, K] -> (out [B, H, Lp, K], lse [B, H, Lp, 1] f32)."""
    b, h, lp, d = q.shape
    g = k.shape[1]
    check(q.dtype, d, cfg)
    bq, bk = cfg.block_q, cfg.block_kv
    scratch = dict(
        q=tile_smem((bq, d), q.dtype),
        kt=tile_smem((NUM_SLOTS, d, bk), k.dtype),
        v=tile_smem((NUM_SLOTS, bk, d), v.dtype),
        p=tile_smem((bq, bk), v.dtype),
        lse=plgpu.SMEM((bq,), jnp.float32),
        q_bar=barriers(streamed=False),
        kt_bar=barriers(),
        v_bar=barriers(),
        **ids_scratch(cfg, q_streamed=False),
    )

    def body(q_ref, kt_ref, v_ref, *refs, **s):
        ids_refs, (o_ref, lse_ref) = split_ids(refs, cfg)
        _fwd_kernel(q_ref, kt_ref, v_ref, *ids_refs, o_ref, lse_ref, cfg=cfg, r=h // g, s=s)

    out, lse = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, lp), jnp.float32),  # 1-D rows: TMA boxes >= 16 bytes
        ),
        scratch_types=scratch,
        grid=(h, lp // bq, b),
        grid_names=("heads", "q_seq", "batch"),
        compiler_params=compiler_params(),
        interpret=interpret_params(cfg),
        kernel_name="flash_attention_fwd_mgpu",
    )(q, jnp.swapaxes(k, 2, 3), v, *ids_inputs(q_ids, kv_ids, cfg))
    return out, lse[..., None]
