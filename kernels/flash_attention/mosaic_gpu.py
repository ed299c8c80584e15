"""FlashAttention forward and backward as Mosaic GPU kernels for Hopper (sm_90).

Same contract as `kernel.forward` / `kernel.backward` (q/out/dout [B, H, Lp, K], k/v
[B, G, Sp, K], lse [B, H, Lp, 1] float32, q segment ids [B, Lp, 1], kv segment ids [B, 1, Sp],
lengths padded to the blocks by `ops.py`), and the same masks, rows-with-no-key convention and
FlashAttention-2 backward (Dao 2023, arXiv:2307.08691): softmax statistics and accumulators in
float32, p and ds rounded to the input dtype for the second matmul of each pair.

Written in the Mosaic GPU style (`plgpu.kernel`): each program is one warpgroup that owns one
block of rows, keeps that block in shared memory (SMEM) and streams the blocks of the other
sequence through a two-slot software pipeline: TMA copies GMEM -> SMEM signal one barrier per
slot, and the copies of step t + 2 are issued as soon as step t has finished reading its slot, so
one step of loads is always in flight behind the compute. Every matmul is a wgmma with both
operands in SMEM and a float32 register accumulator.

- forward, grid (H, L/bq, B): online softmax over the kv blocks of kv head h // R.
- dq, grid (H, L/bq, B): recomputes p = exp(s - lse) per kv block, dq = sum_j ds_j k_j.
- dk/dv, grid (G, S/bk, B): loops over the R query heads of kv head g and their q blocks, so GQA
  gradients are summed in the kernel and K/V are never repeated in memory.

Static masks (causal, sliding window) shrink the loop bounds exactly as in `kernel.py`; inside
the visited blocks, padded keys, padded queries (dk/dv), causal / window edges and segment ids are
masked per element.

Two choices are dictated by the Mosaic GPU interpreter of jax 0.10 (the CPU tests run every line
of these kernels in it), which cannot read a transposed SMEM view (`plgpu.transpose_ref`) in a
wgmma nor take a wgmma operand from registers:
- The operand that a matmul needs transposed (k in q k^T, v in do v^T, q and do in the dk/dv
  kernel) is transposed once by XLA in GMEM ([.., K, L] copies), and its blocks are loaded by TMA
  as [K, block] tiles, so every wgmma reads plain row-major SMEM tiles.
- p and ds go registers -> SMEM before their wgmma (FlashAttention-3 keeps p in registers).
Both cost bandwidth, not correctness; they are the first things to revisit when tuning on H100.
It has no rule for `layout_cast` either, so register layout hints are skipped when interpreting
(`_layout`, `_iota`, `_load_vector`): they change no value.

Inputs must be bfloat16 or float16 with head dim 64 or 128, and block sizes multiples of 64 (one
wgmma row tile per warpgroup); `supported` says why a call cannot run here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxllm.kernels.flash_attention.kernel import Config, _kv_block_range, _q_block_range
from jaxllm.kernels.flash_attention.kernel import mask_from_positions as _mask
from jaxllm.kernels.flash_attention.reference import MASK_VALUE

try:  # the interpreter that runs these kernels on CPU; not re-exported by jax 0.10
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - older or newer jax without it at this path
    InterpretGPUParams = None

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
BLOCK_MULTIPLE = 64  # rows of one wgmma tile of a warpgroup
_NUM_SLOTS = 2  # pipeline depth: the slot being computed on + the slot being filled
_SWIZZLE_BYTES = 128

# Register layouts of Lane semantics: [M, N] wgmma tiles and the per-row / per-column vectors
# that broadcast against them.
_TILE = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # indexed by the rows of a tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # indexed by the columns of a tile


def runs_on(device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.x). wgmma exists only there:
    Blackwell's tensor cores take tcgen05 instead, and older GPUs have neither TMA nor wgmma."""
    capability = getattr(device, "compute_capability", None)
    return capability is not None and str(capability).split(".")[0] == "9"


def supported(dtype, head_dim: int, blocks: tuple[int, int] | None = None) -> str | None:
    """Why these kernels cannot run a call, or None when they can."""
    if jnp.dtype(dtype) not in map(jnp.dtype, DTYPES):
        return f"dtype {jnp.dtype(dtype).name} (wgmma here takes bfloat16 or float16)"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (supported: {HEAD_DIMS})"
    if blocks is not None and any(size % BLOCK_MULTIPLE for size in blocks):
        return f"blocks {blocks[0]}/{blocks[1]} (need multiples of {BLOCK_MULTIPLE})"
    return None


def _check(dtype, head_dim: int, cfg: Config):
    reason = supported(dtype, head_dim, (cfg.block_q, cfg.block_kv))
    if reason is not None:
        raise ValueError(f"mosaic_gpu flash attention does not support {reason}")


# ----------------------------------------------------------------------- in-kernel helpers


def _layout(x, layout, cfg: Config):
    """Register layout hint (a no-op in value); the interpreter has no rule for layout_cast."""
    return x if cfg.interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim: int, cfg: Config):
    if cfg.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_TILE)


def _load_vector(ref, layout, cfg: Config):
    """A 1-D SMEM vector into registers, laid out to broadcast against wgmma tiles."""
    return ref[...] if cfg.interpret else plgpu.load(ref, (), layout=layout)


def _tile_smem(shape, dtype):
    """SMEM for a 2-D operand tile (optionally with leading slot dims): tiled and swizzled as TMA
    writes it and wgmma reads it."""
    elems = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _matmul(a_smem, b_smem, m: int, n: int):
    """a [m, k] @ b [k, n], both in SMEM, as one wgmma into a fresh float32 accumulator."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem)
        return acc_ref[...]  # waits for the wgmma

    return pl.run_scoped(body, plgpu.ACC((m, n), jnp.float32))


def _stage(x, smem):
    """Registers -> SMEM, fenced so that the next wgmma or TMA store sees the writes."""
    smem[...] = x.astype(smem.dtype)
    plgpu.commit_smem()


def _rows(v, shape):  # per-row vector -> [rows, cols]
    return lax.broadcast_in_dim(v, shape, [0])


def _cols(v, shape):  # per-column vector -> [rows, cols]
    return lax.broadcast_in_dim(v, shape, [1])


def _pipeline(lo, hi, issue, step, carry):
    """carry = step(t, slot, carry) for t in [lo, hi), double-buffered.

    `issue(t, slot)` starts the TMA copies of step t into `slot`; `step` waits for them. Slot s is
    refilled with step t + 2 only after step t returned, i.e. after its wgmmas were waited for.
    """
    for d in range(_NUM_SLOTS):
        pl.when(lo + d < hi)(functools.partial(issue, lo + d, d))

    def body(t, carry):
        slot = lax.rem(t - lo, _NUM_SLOTS)
        carry = step(t, slot, carry)
        pl.when(t + _NUM_SLOTS < hi)(functools.partial(issue, t + _NUM_SLOTS, slot))
        return carry

    return lax.fori_loop(lo, hi, body, carry)


def _scores(a_smem, b_smem, m: int, n: int, cfg: Config):
    """Scaled (and soft-capped) logits of one block, plus tanh(s / cap) for the backward."""
    s = _matmul(a_smem, b_smem, m, n) * jnp.float32(cfg.sm_scale)
    if cfg.soft_cap is None:
        return s, None
    t = jnp.tanh(s / jnp.float32(cfg.soft_cap))
    return jnp.float32(cfg.soft_cap) * t, t


def _barriers(streamed: bool = True):
    """One barrier per pipeline slot for a streamed buffer, a single one for a resident buffer."""
    return plgpu.Barrier(num_barriers=_NUM_SLOTS if streamed else 1)


def _ids_scratch(cfg: Config, q_streamed: bool) -> dict:
    """SMEM and barriers of the segment ids: the resident side's block and the streamed side's
    slots (kv ids stream in the forward and dq kernels, q ids in the dk/dv kernel)."""
    if not cfg.has_segments:
        return {}
    q_shape, kv_shape = (cfg.block_q,), (cfg.block_kv,)
    if q_streamed:
        q_shape = (_NUM_SLOTS, *q_shape)
    else:
        kv_shape = (_NUM_SLOTS, *kv_shape)
    return dict(
        qid=plgpu.SMEM(q_shape, jnp.int32),
        kvid=plgpu.SMEM(kv_shape, jnp.int32),
        qid_bar=_barriers(q_streamed),
        kvid_bar=_barriers(not q_streamed),
    )


def _split_ids(refs, cfg: Config):
    """(q ids ref, kv ids ref) and the output refs: the id inputs exist only with segments."""
    return (refs[:2], refs[2:]) if cfg.has_segments else ((None, None), refs)


def _ids_inputs(q_ids, kv_ids, cfg: Config):  # [B, Lp, 1], [B, 1, Sp] -> [B, Lp], [B, Sp]
    return (q_ids[:, :, 0], kv_ids[:, 0, :]) if cfg.has_segments else ()


def _compiler_params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def _interpret(cfg: Config):
    if not cfg.interpret:
        return None
    if InterpretGPUParams is None:  # pragma: no cover
        raise NotImplementedError("this jax has no Mosaic GPU interpreter")
    return InterpretGPUParams()


# ----------------------------------------------------------------------------------- forward


def _fwd_kernel(
    q_ref, kt_ref, v_ref, qid_ref, kvid_ref, o_ref, lse_ref, *, cfg: Config, r: int, s
):  # fmt: skip
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
    q_pos = q_start + _iota(shape, 0, cfg)
    q_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["qid_bar"])
        q_ids = _rows(_load_vector(s["qid"], _ROW, cfg), shape)

    def step(j, slot, carry):
        m, l, acc = carry
        plgpu.barrier_wait(s["kt_bar"].at[slot])
        sc, _ = _scores(s["q"], s["kt"].at[slot], bq, bk, cfg)
        kv_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["kvid_bar"].at[slot])
            kv_ids = _cols(_load_vector(s["kvid"].at[slot], _COL, cfg), shape)
        mask = _mask(q_pos, j * bk + _iota(shape, 1, cfg), q_ids, kv_ids, cfg, pad_q=False)
        if mask is not None:
            sc = jnp.where(mask, sc, MASK_VALUE)
        m_new = jnp.maximum(m, sc.max(axis=1))
        p = jnp.exp(sc - _rows(m_new, shape))
        if mask is not None:  # a row with no visible key so far has m_new == MASK_VALUE
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=1)
        _stage(p, s["p"])
        plgpu.barrier_wait(s["v_bar"].at[slot])
        pv = _matmul(s["p"], s["v"].at[slot], bq, d)
        return m_new, l, _rows(alpha, acc.shape) * acc + pv

    m0 = _layout(jnp.full((bq,), MASK_VALUE, jnp.float32), _ROW, cfg)
    l0 = _layout(jnp.zeros((bq,), jnp.float32), _ROW, cfg)
    acc0 = _layout(jnp.zeros((bq, d), jnp.float32), _TILE, cfg)
    lo, hi = _kv_block_range(qi, cfg, kt_ref.shape[-1] // bk)
    m, l, acc = _pipeline(lo, hi, issue, step, (m0, l0, acc0))

    l_safe = jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: out 0, no NaN
    _stage(acc / _rows(l_safe, acc.shape), s["q"])  # q is dead: its SMEM holds the output
    s["lse"][...] = m + jnp.log(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s["q"], o_ref.at[b, h, q_rows])
    plgpu.copy_smem_to_gmem(s["lse"], lse_ref.at[b, h, q_rows])
    plgpu.wait_smem_to_gmem(0)


def forward(q, k, v, q_ids, kv_ids, cfg: Config):
    """q [B, H, Lp, K], k/v [B, G, Sp, K] -> (out [B, H, Lp, K], lse [B, H, Lp, 1] f32)."""
    b, h, lp, d = q.shape
    g = k.shape[1]
    _check(q.dtype, d, cfg)
    bq, bk = cfg.block_q, cfg.block_kv
    scratch = dict(
        q=_tile_smem((bq, d), q.dtype),
        kt=_tile_smem((_NUM_SLOTS, d, bk), k.dtype),
        v=_tile_smem((_NUM_SLOTS, bk, d), v.dtype),
        p=_tile_smem((bq, bk), v.dtype),
        lse=plgpu.SMEM((bq,), jnp.float32),
        q_bar=_barriers(streamed=False),
        kt_bar=_barriers(),
        v_bar=_barriers(),
        **_ids_scratch(cfg, q_streamed=False),
    )

    def body(q_ref, kt_ref, v_ref, *refs, **s):
        ids_refs, (o_ref, lse_ref) = _split_ids(refs, cfg)
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
        compiler_params=_compiler_params(),
        interpret=_interpret(cfg),
        kernel_name="flash_attention_fwd_mgpu",
    )(q, jnp.swapaxes(k, 2, 3), v, *_ids_inputs(q_ids, kv_ids, cfg))
    return out, lse[..., None]


# ---------------------------------------------------------------------------------- backward


def _dq_kernel(
    q_ref, k_ref, kt_ref, vt_ref, do_ref, lse_ref, delta_ref, qid_ref, kvid_ref, dq_ref,
    *, cfg: Config, r: int, s,
):  # fmt: skip
    bq, bk, d = cfg.block_q, cfg.block_kv, q_ref.shape[-1]
    b, h, qi = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    g = lax.div(h, jnp.int32(r))
    q_start = qi * bq
    q_rows = pl.ds(q_start, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, q_rows], s["q"], s["q_bar"])
    plgpu.copy_gmem_to_smem(do_ref.at[b, h, q_rows], s["do"], s["do_bar"])
    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, q_rows], s["lse"], s["lse_bar"])
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, q_rows], s["delta"], s["delta_bar"])
    if cfg.has_segments:
        plgpu.copy_gmem_to_smem(qid_ref.at[b, q_rows], s["qid"], s["qid_bar"])

    def issue(j, slot):
        cols = pl.ds(j * bk, bk)
        plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, cols], s["kt"].at[slot], s["kt_bar"].at[slot])
        plgpu.copy_gmem_to_smem(vt_ref.at[b, g, :, cols], s["vt"].at[slot], s["vt_bar"].at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[b, g, cols], s["k"].at[slot], s["k_bar"].at[slot])
        if cfg.has_segments:
            plgpu.copy_gmem_to_smem(
                kvid_ref.at[b, cols], s["kvid"].at[slot], s["kvid_bar"].at[slot]
            )

    for name in ("q_bar", "do_bar", "lse_bar", "delta_bar"):
        plgpu.barrier_wait(s[name])
    shape = (bq, bk)
    lse = _rows(_load_vector(s["lse"], _ROW, cfg), shape)
    delta = _rows(_load_vector(s["delta"], _ROW, cfg), shape)
    q_pos = q_start + _iota(shape, 0, cfg)
    q_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["qid_bar"])
        q_ids = _rows(_load_vector(s["qid"], _ROW, cfg), shape)

    def step(j, slot, dq):
        plgpu.barrier_wait(s["kt_bar"].at[slot])
        sc, t = _scores(s["q"], s["kt"].at[slot], bq, bk, cfg)
        p = jnp.exp(sc - lse)
        kv_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["kvid_bar"].at[slot])
            kv_ids = _cols(_load_vector(s["kvid"].at[slot], _COL, cfg), shape)
        mask = _mask(q_pos, j * bk + _iota(shape, 1, cfg), q_ids, kv_ids, cfg, pad_q=False)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        plgpu.barrier_wait(s["vt_bar"].at[slot])
        ds = p * (_matmul(s["do"], s["vt"].at[slot], bq, bk) - delta)
        if t is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        _stage(ds, s["ds"])
        plgpu.barrier_wait(s["k_bar"].at[slot])
        return dq + _matmul(s["ds"], s["k"].at[slot], bq, d)

    dq0 = _layout(jnp.zeros((bq, d), jnp.float32), _TILE, cfg)
    lo, hi = _kv_block_range(qi, cfg, k_ref.shape[2] // bk)
    dq = _pipeline(lo, hi, issue, step, dq0)
    _stage(dq * jnp.float32(cfg.sm_scale), s["q"])
    plgpu.copy_smem_to_gmem(s["q"], dq_ref.at[b, h, q_rows])
    plgpu.wait_smem_to_gmem(0)


def _dkdv_kernel(
    q_ref, qt_ref, k_ref, v_ref, do_ref, dot_ref, lse_ref, delta_ref, qid_ref, kvid_ref,
    dk_ref, dv_ref, *, cfg: Config, r: int, s,
):  # fmt: skip
    bq, bk, d = cfg.block_q, cfg.block_kv, k_ref.shape[-1]
    b, g, kj = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_seq")
    k_start = kj * bk
    k_rows = pl.ds(k_start, bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, g, k_rows], s["k"], s["k_bar"])
    plgpu.copy_gmem_to_smem(v_ref.at[b, g, k_rows], s["v"], s["v_bar"])
    if cfg.has_segments:
        plgpu.copy_gmem_to_smem(kvid_ref.at[b, k_rows], s["kvid"], s["kvid_bar"])

    # Steps t = (query head g * R + t // n, q block lo + t % n) over the visible q blocks.
    lo, hi = _q_block_range(kj, cfg, q_ref.shape[2] // bq)
    n = jnp.maximum(hi - lo, 0)
    n_safe = jnp.maximum(n, 1)

    def head_and_rows(t):
        qi = lo + lax.rem(t, n_safe)
        return g * r + lax.div(t, n_safe), qi, pl.ds(qi * bq, bq)

    def issue(t, slot):
        h, _, rows = head_and_rows(t)
        for name, ref in (("q", q_ref), ("do", do_ref), ("lse", lse_ref), ("delta", delta_ref)):
            plgpu.copy_gmem_to_smem(ref.at[b, h, rows], s[name].at[slot], s[name + "_bar"].at[slot])
        for name, ref in (("qt", qt_ref), ("dot", dot_ref)):
            dst, bar = s[name].at[slot], s[name + "_bar"].at[slot]
            plgpu.copy_gmem_to_smem(ref.at[b, h, :, rows], dst, bar)
        if cfg.has_segments:
            plgpu.copy_gmem_to_smem(qid_ref.at[b, rows], s["qid"].at[slot], s["qid_bar"].at[slot])

    plgpu.barrier_wait(s["k_bar"])
    plgpu.barrier_wait(s["v_bar"])
    shape = (bk, bq)  # transposed blocks: rows are keys, columns are queries
    k_pos = k_start + _iota(shape, 0, cfg)
    kv_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["kvid_bar"])
        kv_ids = _rows(_load_vector(s["kvid"], _ROW, cfg), shape)

    def step(t, slot, carry):
        dk, dv = carry
        _, qi, _ = head_and_rows(t)
        plgpu.barrier_wait(s["qt_bar"].at[slot])
        plgpu.barrier_wait(s["lse_bar"].at[slot])
        st, tt = _scores(s["k"], s["qt"].at[slot], bk, bq, cfg)
        pt = jnp.exp(st - _cols(_load_vector(s["lse"].at[slot], _COL, cfg), shape))
        q_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["qid_bar"].at[slot])
            q_ids = _cols(_load_vector(s["qid"].at[slot], _COL, cfg), shape)
        q_pos = qi * bq + _iota(shape, 1, cfg)
        mask = _mask(q_pos, k_pos, q_ids, kv_ids, cfg, pad_q=True)
        if mask is not None:
            pt = jnp.where(mask, pt, 0.0)
        _stage(pt, s["pt"])
        plgpu.barrier_wait(s["do_bar"].at[slot])
        dv = dv + _matmul(s["pt"], s["do"].at[slot], bk, d)
        plgpu.barrier_wait(s["dot_bar"].at[slot])
        plgpu.barrier_wait(s["delta_bar"].at[slot])
        delta = _cols(_load_vector(s["delta"].at[slot], _COL, cfg), shape)
        dst = pt * (_matmul(s["v"], s["dot"].at[slot], bk, bq) - delta)
        if tt is not None:
            dst = dst * (1.0 - tt * tt)
        _stage(dst, s["pt"])  # p^T is dead: its wgmma was waited for
        plgpu.barrier_wait(s["q_bar"].at[slot])
        dk = dk + _matmul(s["pt"], s["q"].at[slot], bk, d)
        return dk, dv

    zeros = _layout(jnp.zeros((bk, d), jnp.float32), _TILE, cfg)
    dk, dv = _pipeline(0, r * n, issue, step, (zeros, zeros))
    _stage(dk * jnp.float32(cfg.sm_scale), s["k"])  # k, v are dead: their SMEM holds dk, dv
    _stage(dv, s["v"])
    plgpu.copy_smem_to_gmem(s["k"], dk_ref.at[b, g, k_rows])
    plgpu.copy_smem_to_gmem(s["v"], dv_ref.at[b, g, k_rows])
    plgpu.wait_smem_to_gmem(0)


def backward(q, k, v, out, lse, do, q_ids, kv_ids, cfg: Config, dlse=None):
    """Gradients (dq, dk, dv) of `forward` given the cotangents `do` of its output and, optionally,
    `dlse` [B, H, Lp, 1] float32 of its logsumexp. As `kernel.backward`, `out` / `lse` may be the
    statistics of a longer attention whose keys include these (ring attention)."""
    b, h, lp, d = q.shape
    g, sp = k.shape[1], k.shape[2]
    _check(q.dtype, d, cfg)
    r = h // g
    bq, bk = cfg.block_q, cfg.block_kv
    # delta_i = sum_k do_ik out_ik = sum_j p_ij dp_ij (the FlashAttention-2 preprocessing step).
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, H, Lp]
    if dlse is not None:  # d lse_i / d s_ij = p_ij: ds = p * (dp - delta) + p * dlse
        delta = delta - dlse[..., 0]
    lse = lse[..., 0]
    ids = _ids_inputs(q_ids, kv_ids, cfg)

    def dq_body(q_ref, k_ref, kt_ref, vt_ref, do_ref, lse_ref, delta_ref, *refs, **s):
        ids_refs, (dq_ref,) = _split_ids(refs, cfg)
        _dq_kernel(
            q_ref, k_ref, kt_ref, vt_ref, do_ref, lse_ref, delta_ref, *ids_refs, dq_ref,
            cfg=cfg, r=r, s=s,
        )  # fmt: skip

    dq = plgpu.kernel(
        dq_body,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=dict(
            q=_tile_smem((bq, d), q.dtype),
            do=_tile_smem((bq, d), do.dtype),
            lse=plgpu.SMEM((bq,), jnp.float32),
            delta=plgpu.SMEM((bq,), jnp.float32),
            kt=_tile_smem((_NUM_SLOTS, d, bk), k.dtype),
            vt=_tile_smem((_NUM_SLOTS, d, bk), v.dtype),
            k=_tile_smem((_NUM_SLOTS, bk, d), k.dtype),
            ds=_tile_smem((bq, bk), k.dtype),
            **{name + "_bar": _barriers(streamed=False) for name in ("q", "do", "lse", "delta")},
            **{name + "_bar": _barriers() for name in ("kt", "vt", "k")},
            **_ids_scratch(cfg, q_streamed=False),
        ),
        grid=(h, lp // bq, b),
        grid_names=("heads", "q_seq", "batch"),
        compiler_params=_compiler_params(),
        interpret=_interpret(cfg),
        kernel_name="flash_attention_dq_mgpu",
    )(q, k, jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3), do, lse, delta, *ids)

    def dkdv_body(q_ref, qt_ref, k_ref, v_ref, do_ref, dot_ref, lse_ref, delta_ref, *refs, **s):
        ids_refs, (dk_ref, dv_ref) = _split_ids(refs, cfg)
        _dkdv_kernel(
            q_ref, qt_ref, k_ref, v_ref, do_ref, dot_ref, lse_ref, delta_ref, *ids_refs,
            dk_ref, dv_ref, cfg=cfg, r=r, s=s,
        )  # fmt: skip

    dk, dv = plgpu.kernel(
        dkdv_body,
        out_type=(
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ),
        scratch_types=dict(
            k=_tile_smem((bk, d), k.dtype),
            v=_tile_smem((bk, d), v.dtype),
            q=_tile_smem((_NUM_SLOTS, bq, d), q.dtype),
            qt=_tile_smem((_NUM_SLOTS, d, bq), q.dtype),
            do=_tile_smem((_NUM_SLOTS, bq, d), do.dtype),
            dot=_tile_smem((_NUM_SLOTS, d, bq), do.dtype),
            lse=plgpu.SMEM((_NUM_SLOTS, bq), jnp.float32),
            delta=plgpu.SMEM((_NUM_SLOTS, bq), jnp.float32),
            pt=_tile_smem((bk, bq), q.dtype),
            k_bar=_barriers(streamed=False),
            v_bar=_barriers(streamed=False),
            **{name + "_bar": _barriers() for name in ("q", "qt", "do", "dot", "lse", "delta")},
            **_ids_scratch(cfg, q_streamed=True),
        ),
        grid=(g, sp // bk, b),
        grid_names=("kv_heads", "kv_seq", "batch"),
        compiler_params=_compiler_params(),
        interpret=_interpret(cfg),
        kernel_name="flash_attention_dkdv_mgpu",
    )(q, jnp.swapaxes(q, 2, 3), k, v, do, jnp.swapaxes(do, 2, 3), lse, delta, *ids)
    return dq, dk, dv
