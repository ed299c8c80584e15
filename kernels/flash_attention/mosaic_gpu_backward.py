"""FlashAttention-2 backward as Mosaic GPU kernels for Hopper (sm_90): the dq kernel (one block
of query rows, the kv blocks streamed) and the dk/dv kernel (one block of keys, the q blocks of
its R query heads streamed), built from the SMEM / pipeline helpers of `mosaic_gpu.py`, whose
docstring describes the design.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxllm.kernels.flash_attention.common import (
    Config,
    backward_delta,
    kv_block_range,
    mask_from_positions,
    q_block_range,
)
from jaxllm.kernels.flash_attention.mosaic_gpu import (
    COL,
    NUM_SLOTS,
    ROW,
    TILE,
    barriers,
    check,
    col_broadcast,
    compiler_params,
    ids_inputs,
    ids_scratch,
    interpret_params,
    iota,
    layout_hint,
    load_vector,
    matmul,
    pipeline,
    row_broadcast,
    smem_scores,
    split_ids,
    stage,
    tile_smem,
)


def _dq_kernel(
    q_ref,
    k_ref,
    kt_ref,
    vt_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qid_ref,
    kvid_ref,
    dq_ref,
    *,
    cfg: Config,
    r: int,
    s,
):
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
    lse = row_broadcast(load_vector(s["lse"], ROW, cfg), shape)
    delta = row_broadcast(load_vector(s["delta"], ROW, cfg), shape)
    q_pos = q_start + iota(shape, 0, cfg)
    q_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["qid_bar"])
        q_ids = row_broadcast(load_vector(s["qid"], ROW, cfg), shape)

    def step(j, slot, dq):
        plgpu.barrier_wait(s["kt_bar"].at[slot])
        sc, t = smem_scores(s["q"], s["kt"].at[slot], bq, bk, cfg)
        p = jnp.exp(sc - lse)
        kv_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["kvid_bar"].at[slot])
            kv_ids = col_broadcast(load_vector(s["kvid"].at[slot], COL, cfg), shape)
        mask = mask_from_positions(
            q_pos, j * bk + iota(shape, 1, cfg), q_ids, kv_ids, cfg, pad_q=False
        )
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        plgpu.barrier_wait(s["vt_bar"].at[slot])
        ds = p * (matmul(s["do"], s["vt"].at[slot], bq, bk) - delta)
        if t is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        stage(ds, s["ds"])
        plgpu.barrier_wait(s["k_bar"].at[slot])
        return dq + matmul(s["ds"], s["k"].at[slot], bq, d)

    dq0 = layout_hint(jnp.zeros((bq, d), jnp.float32), TILE, cfg)
    lo, hi = kv_block_range(qi, cfg, k_ref.shape[2] // bk)
    dq = pipeline(lo, hi, issue, step, dq0)
    stage(dq * jnp.float32(cfg.sm_scale), s["q"])
    plgpu.copy_smem_to_gmem(s["q"], dq_ref.at[b, h, q_rows])
    plgpu.wait_smem_to_gmem(0)


def _dkdv_kernel(
    q_ref,
    qt_ref,
    k_ref,
    v_ref,
    do_ref,
    dot_ref,
    lse_ref,
    delta_ref,
    qid_ref,
    kvid_ref,
    dk_ref,
    dv_ref,
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

    plgpu.barrier_wait(s["k_bar"])
    plgpu.barrier_wait(s["v_bar"])
    shape = (bk, bq)  # transposed blocks: rows are keys, columns are queries
    k_pos = k_start + iota(shape, 0, cfg)
    kv_ids = None
    if cfg.has_segments:
        plgpu.barrier_wait(s["kvid_bar"])
        kv_ids = row_broadcast(load_vector(s["kvid"], ROW, cfg), shape)

    def step(t, slot, carry):
        dk, dv = carry
        _, qi, _ = head_and_rows(t)
        plgpu.barrier_wait(s["qt_bar"].at[slot])
        plgpu.barrier_wait(s["lse_bar"].at[slot])
        st, tt = smem_scores(s["k"], s["qt"].at[slot], bk, bq, cfg)
        pt = jnp.exp(st - col_broadcast(load_vector(s["lse"].at[slot], COL, cfg), shape))
        q_ids = None
        if cfg.has_segments:
            plgpu.barrier_wait(s["qid_bar"].at[slot])
            q_ids = col_broadcast(load_vector(s["qid"].at[slot], COL, cfg), shape)
        q_pos = qi * bq + iota(shape, 1, cfg)
        mask = mask_from_positions(q_pos, k_pos, q_ids, kv_ids, cfg, pad_q=True)
        if mask is not None:
            pt = jnp.where(mask, pt, 0.0)
        stage(pt, s["pt"])
        plgpu.barrier_wait(s["do_bar"].at[slot])
        dv = dv + matmul(s["pt"], s["do"].at[slot], bk, d)
        plgpu.barrier_wait(s["dot_bar"].at[slot])
        plgpu.barrier_wait(s["delta_bar"].at[slot])
        delta = col_broadcast(load_vector(s["delta"].at[slot], COL, cfg), shape)
        dst = pt * (matmul(s["v"], s["dot"].at[slot], bk, bq) - delta)
        if tt is not None:
            dst = dst * (1.0 - tt * tt)
        stage(dst, s["pt"])  # p^T is dead: its wgmma was waited for
        plgpu.barrier_wait(s["q_bar"].at[slot])
        dk = dk + matmul(s["pt"], s["q"].at[slot], bk, d)
        return dk, dv

    zeros = layout_hint(jnp.zeros((bk, d), jnp.float32), TILE, cfg)
    dk, dv = pipeline(0, r * n, issue, step, (zeros, zeros))
    stage(dk * jnp.float32(cfg.sm_scale), s["k"])  # k, v are dead: their SMEM holds dk, dv
    stage(dv, s["v"])
    plgpu.copy_smem_to_gmem(s["k"], dk_ref.at[b, g, k_rows])
    plgpu.copy_smem_to_gmem(s["v"], dv_ref.at[b, g, k_rows])
    plgpu.wait_smem_to_gmem(0)


def backward(q, k, v, out, lse, do, q_ids, kv_ids, cfg: Config, dlse=None):
    """Gradients (dq, dk, dv) of `forward` given the cotangents `do` of its output and, optionally,
    `dlse` [B, H, Lp, 1] float32 of its logsumexp. As in the other backends, `out` / `lse` may be the
    statistics of a longer attention whose keys include these (ring attention)."""
    b, h, lp, d = q.shape
    g, sp = k.shape[1], k.shape[2]
    check(q.dtype, d, cfg)
    r = h // g
    bq, bk = cfg.block_q, cfg.block_kv
    delta = backward_delta(out, do, dlse)[..., 0]  # [B, H, Lp]: 1-D rows, as lse
    lse = lse[..., 0]
    ids = ids_inputs(q_ids, kv_ids, cfg)

    def dq_body(q_ref, k_ref, kt_ref, vt_ref, do_ref, lse_ref, delta_ref, *refs, **s):
        ids_refs, (dq_ref,) = split_ids(refs, cfg)
        _dq_kernel(
            q_ref,
            k_ref,
            kt_ref,
            vt_ref,
            do_ref,
            lse_ref,
            delta_ref,
            *ids_refs,
            dq_ref,
            cfg=cfg,
            r=r,
            s=s,
        )

    dq = plgpu.kernel(
        dq_body,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=dict(
            q=tile_smem((bq, d), q.dtype),
            do=tile_smem((bq, d), do.dtype),
            lse=plgpu.SMEM((bq,), jnp.float32),
            delta=plgpu.SMEM((bq,), jnp.float32),
            kt=tile_smem((NUM_SLOTS, d, bk), k.dtype),
            vt=tile_smem((NUM_SLOTS, d, bk), v.dtype),
            k=tile_smem((NUM_SLOTS, bk, d), k.dtype),
            ds=tile_smem((bq, bk), k.dtype),
            **{name + "_bar": barriers(streamed=False) for name in ("q", "do", "lse", "delta")},
            **{name + "_bar": barriers() for name in ("kt", "vt", "k")},
            **ids_scratch(cfg, q_streamed=False),
        ),
        grid=(h, lp // bq, b),
        grid_names=("heads", "q_seq", "batch"),
        compiler_params=compiler_params(),
        interpret=interpret_params(cfg),
        kernel_name="flash_attention_dq_mgpu",
    )(q, k, jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3), do, lse, delta, *ids)

    def dkdv_body(q_ref, qt_ref, k_ref, v_ref, do_ref, dot_ref, lse_ref, delta_ref, *refs, **s):
        ids_refs, (dk_ref, dv_ref) = split_ids(refs, cfg)
        _dkdv_kernel(
            q_ref,
            qt_ref,
            k_ref,
            v_ref,
            do_ref,
            dot_ref,
            lse_ref,
            delta_ref,
            *ids_refs,
            dk_ref,
            dv_ref,
            cfg=cfg,
            r=r,
            s=s,
        )

    dk, dv = plgpu.kernel(
        dkdv_body,
        out_type=(
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ),
        scratch_types=dict(
            k=tile_smem((bk, d), k.dtype),
            v=tile_smem((bk, d), v.dtype),
            q=tile_smem((NUM_SLOTS, bq, d), q.dtype),
            qt=tile_smem((NUM_SLOTS, d, bq), q.dtype),
            do=tile_smem((NUM_SLOTS, bq, d), do.dtype),
            dot=tile_smem((NUM_SLOTS, d, bq), do.dtype),
            lse=plgpu.SMEM((NUM_SLOTS, bq), jnp.float32),
            delta=plgpu.SMEM((NUM_SLOTS, bq), jnp.float32),
            pt=tile_smem((bk, bq), q.dtype),
            k_bar=barriers(streamed=False),
            v_bar=barriers(streamed=False),
            **{name + "_bar": barriers() for name in ("q", "qt", "do", "dot", "lse", "delta")},
            **ids_scratch(cfg, q_streamed=True),
        ),
        grid=(g, sp // bk, b),
        grid_names=("kv_heads", "kv_seq", "batch"),
        compiler_params=compiler_params(),
        interpret=interpret_params(cfg),
        kernel_name="flash_attention_dkdv_mgpu",
    )(q, jnp.swapaxes(q, 2, 3), k, v, do, jnp.swapaxes(do, 2, 3), lse, delta, *ids)
    return dq, dk, dv
