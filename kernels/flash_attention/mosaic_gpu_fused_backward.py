"""Fused FlashAttention backward as one Mosaic GPU kernel for Hopper (sm_90), after
FlashAttention-3's backward (Shah et al. 2024, arXiv:2407.08608, Algorithm 2).

Chosen by `BlockSizes(fused_backward=True)` (`Config.fused_backward`); the default backward is
the FlashAttention-2 pair of kernels of `mosaic_gpu_backward.py`, which recomputes p twice (once
for dq, once for dk/dv). Here each program, grid (G, Sp/bk, B), owns one block of keys of one kv
head, keeps k, k^T and v resident in SMEM and dk, dv in float32 registers, and streams the q
blocks of its R query heads (q, q^T, do, do^T, lse, delta and the q segment ids) through the
double-buffered TMA pipeline of `mosaic_gpu.py`. Per q block it runs five wgmmas:

    s^T = k q^T      dv += p^T do      dp^T = v do^T      dk += ds^T q      dq^T = k^T ds^T

and adds the float32 dq^T partial of the block to a float32 [B, H, K, Lp] buffer in GMEM with a
TMA reduce-add store (`copy_smem_to_gmem(..., reduction_op="add")`), so every program that sees
a q block adds to it and no program owns it. Computing dq transposed keeps every wgmma operand
a plain row-major SMEM tile (ds^T is already staged for dk); XLA transposes the buffer back,
scales it by sm_scale and casts it to q's dtype. The buffer starts as zeros (a GMEM `Ref` of
the kernel, so rows that no program sees keep gradient 0).

This is the single-warpgroup first step of the FlashAttention-3 backward: no producer
warpgroup and no ping-pong between consumers; the overlap comes from the TMA pipeline (the loads
of the next q block and the reduce-add of the previous dq^T run behind the current block's
wgmmas). Every mask of the FlashAttention-2 backward is supported the same way (causal, sliding
window, segment ids, soft cap, GQA / MQA, padded rows and keys, the lse cotangent).

At K = 128 and 64 / 64 blocks the kernel takes 216 KiB of SMEM (the FlashAttention-2 dk/dv
kernel's 168 KiB, plus k^T and the float32 dq^T staging tile): 128-row blocks do not fit.

The buffer being a `Ref` argument, the kernel is launched by `pl.kernel` (`plgpu.kernel`'s
batching wrapper refuses a `Ref`), so `jax.vmap` of this backward takes a batch of 1 only;
no jaxllm caller vmaps attention.

The Mosaic GPU interpreter of jax 0.10 (the CPU tests) has no TMA reductions. When interpreting,
the add is a read-modify-write of the dq^T block (TMA load, add in registers, TMA store); it is
exact there because the interpreter runs the programs of a grid one after another. Everything
else, the zero-initialised GMEM buffer included, runs the same code in both forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxllm.kernels.flash_attention import mosaic_gpu as mg
from jaxllm.kernels.flash_attention.common import (
    Config,
    backward_delta,
    mask_from_positions,
    q_block_range,
)


def _add_dq(dqt, dqt_gmem, cfg: Config, s):
    """dqt_gmem += dqt ([K, bq] float32 registers) through the SMEM staging tile `s["dq"]`."""
    if cfg.interpret:  # no TMA reductions: read, add, write back (programs run one at a time)
        plgpu.copy_gmem_to_smem(dqt_gmem, s["dq"], s["dq_bar"])
        plgpu.barrier_wait(s["dq_bar"])
        mg.stage(s["dq"][...] + dqt, s["dq"])
        plgpu.copy_smem_to_gmem(s["dq"], dqt_gmem)
        plgpu.wait_smem_to_gmem(0)
        return
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous add has read the tile
    mg.stage(dqt, s["dq"])
    plgpu.copy_smem_to_gmem(s["dq"], dqt_gmem, reduction_op="add")


def _kernel(
    q_ref,
    qt_ref,
    k_ref,
    kt_ref,
    v_ref,
    do_ref,
    dot_ref,
    lse_ref,
    delta_ref,
    qid_ref,
    kvid_ref,
    dk_ref,
    dv_ref,
    dqt_ref,
    *,
    cfg: Config,
    r: int,
    s,
):
    bq, bk, d = cfg.block_q, cfg.block_kv, k_ref.shape[-1]
    b, g, kj = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_seq")
    k_start = kj * bk
    k_rows = pl.ds(k_start, bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, g, k_rows], s["k"], s["k_bar"])
    plgpu.copy_gmem_to_smem(kt_ref.at[b, g, :, k_rows], s["kt"], s["kt_bar"])
    plgpu.copy_gmem_to_smem(v_ref.at[b, g, k_rows], s["v"], s["v_bar"])
    if cfg.has_segments:
        plgpu.copy_gmem_to_smem(kvid_ref.at[b, k_rows], s["kvid"], s["kvid_bar"])

    # Steps t = (query head g * R + t // n, q block lo + t % n) over the visible q blocks.
    lo, hi = q_block_range(kj, cfg, q_ref.shape[2] // bq)
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

    for name in ("k_bar", "kt_bar", "v_bar"):
        plgpu.barrier_wait(s[name])
    shape = (bk, bq)  # transposed blocks: rows are keys, columns are queries
    k_pos = k_start + mg.iota(shape, 0, cfg)
    kv_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["kvid_bar"])
        kv_ids = mg.row_broadcast(mg.load_vector(s["kvid"], mg.ROW, cfg), shape)

    def step(t, slot, carry):
        dk, dv = carry
        h, qi, rows = head_and_rows(t)
        plgpu.barrier_wait(s["qt_bar"].at[slot])
        plgpu.barrier_wait(s["lse_bar"].at[slot])
        st, tt = mg.smem_scores(s["k"], s["qt"].at[slot], bk, bq, cfg)
        lse = mg.col_broadcast(mg.load_vector(s["lse"].at[slot], mg.COL, cfg), shape)
        pt = jnp.exp(st - lse)
        q_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["qid_bar"].at[slot])
            q_ids = mg.col_broadcast(mg.load_vector(s["qid"].at[slot], mg.COL, cfg), shape)
        q_pos = qi * bq + mg.iota(shape, 1, cfg)
        mask = mask_from_positions(q_pos, k_pos, q_ids, kv_ids, cfg, pad_q=True)
        if mask is not None:
            pt = jnp.where(mask, pt, 0.0)
        mg.stage(pt, s["pt"])
        plgpu.barrier_wait(s["do_bar"].at[slot])
        dv = dv + mg.matmul(s["pt"], s["do"].at[slot], bk, d)
        plgpu.barrier_wait(s["dot_bar"].at[slot])
        plgpu.barrier_wait(s["delta_bar"].at[slot])
        delta = mg.col_broadcast(mg.load_vector(s["delta"].at[slot], mg.COL, cfg), shape)
        dst = pt * (mg.matmul(s["v"], s["dot"].at[slot], bk, bq) - delta)
        if tt is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            dst = dst * (1.0 - tt * tt)
        mg.stage(dst, s["pt"])  # p^T is dead: its wgmma was waited for
        plgpu.barrier_wait(s["q_bar"].at[slot])
        dk = dk + mg.matmul(s["pt"], s["q"].at[slot], bk, d)
        _add_dq(mg.matmul(s["kt"], s["pt"], d, bq), dqt_ref.at[b, h, :, rows], cfg, s)
        return dk, dv

    zeros = mg.layout_hint(jnp.zeros((bk, d), jnp.float32), mg.TILE, cfg)
    dk, dv = mg.pipeline(0, r * n, issue, step, (zeros, zeros))
    mg.stage(dk * jnp.float32(cfg.sm_scale), s["k"])  # k, v are dead: their SMEM holds dk, dv
    mg.stage(dv, s["v"])
    plgpu.copy_smem_to_gmem(s["k"], dk_ref.at[b, g, k_rows])
    plgpu.copy_smem_to_gmem(s["v"], dv_ref.at[b, g, k_rows])
    plgpu.wait_smem_to_gmem(0)  # the dq^T adds too


def _scratch(q, k, cfg: Config) -> dict:
    bq, bk, d = cfg.block_q, cfg.block_kv, q.shape[-1]
    slots, one = mg.NUM_SLOTS, mg.barriers(streamed=False)
    scratch = dict(
        k=mg.tile_smem((bk, d), k.dtype),
        kt=mg.tile_smem((d, bk), k.dtype),
        v=mg.tile_smem((bk, d), k.dtype),
        q=mg.tile_smem((slots, bq, d), q.dtype),
        qt=mg.tile_smem((slots, d, bq), q.dtype),
        do=mg.tile_smem((slots, bq, d), q.dtype),
        dot=mg.tile_smem((slots, d, bq), q.dtype),
        lse=plgpu.SMEM((slots, bq), jnp.float32),
        delta=plgpu.SMEM((slots, bq), jnp.float32),
        pt=mg.tile_smem((bk, bq), q.dtype),
        dq=mg.tile_smem((d, bq), jnp.float32),
        k_bar=one,
        kt_bar=one,
        v_bar=one,
        **{name + "_bar": mg.barriers() for name in ("q", "qt", "do", "dot", "lse", "delta")},
        **mg.ids_scratch(cfg, q_streamed=True),
    )
    if cfg.interpret:
        scratch["dq_bar"] = one
    return scratch


def backward(q, k, v, out, lse, do, q_ids, kv_ids, cfg: Config, dlse=None):
    """(dq, dk, dv) as `mosaic_gpu_backward.backward`, from one fused kernel."""
    b, h, lp, d = q.shape
    g, sp = k.shape[1], k.shape[2]
    mg.check(q.dtype, d, cfg)
    delta = backward_delta(out, do, dlse)[..., 0]  # [B, H, Lp]: 1-D rows, as lse
    # zeros that the kernel adds into: a GMEM Ref, aliased in and out of the kernel
    dqt = jax.new_ref(jnp.zeros((b, h, d, lp), jnp.float32), memory_space=plgpu.GMEM)

    def body(q_ref, qt_ref, k_ref, kt_ref, v_ref, do_ref, dot_ref, lse_ref, delta_ref, *refs):
        ids_refs, (dqt_ref, dk_ref, dv_ref) = mg.split_ids(refs, cfg)  # the Ref, then outputs

        def scoped(**s):
            _kernel(
                q_ref,
                qt_ref,
                k_ref,
                kt_ref,
                v_ref,
                do_ref,
                dot_ref,
                lse_ref,
                delta_ref,
                *ids_refs,
                dk_ref,
                dv_ref,
                dqt_ref,
                cfg=cfg,
                r=h // g,
                s=s,
            )

        pl.run_scoped(scoped, **_scratch(q, k, cfg))

    # `pl.kernel`, not `plgpu.kernel`: only it takes a Ref argument
    dk, dv = pl.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ),
        mesh=plgpu.Mesh(
            grid=(g, sp // cfg.block_kv, b), grid_names=("kv_heads", "kv_seq", "batch")
        ),
        compiler_params=mg.compiler_params(),
        interpret=mg.interpret_params(cfg),
        name="flash_attention_bwd_fused_mgpu",
    )(
        q,
        jnp.swapaxes(q, 2, 3),
        k,
        jnp.swapaxes(k, 2, 3),
        v,
        do,
        jnp.swapaxes(do, 2, 3),
        lse[..., 0],
        delta,
        *mg.ids_inputs(q_ids, kv_ids, cfg),
        dqt,
    )
    dq = jnp.swapaxes(jax.freeze(dqt), 2, 3) * jnp.float32(cfg.sm_scale)
    return dq.astype(q.dtype), dk, dv
