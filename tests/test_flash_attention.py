"""FlashAttention Pallas kernels vs the pure-JAX reference, in interpret mode on CPU.

Every feature (GQA ratios, head dims, odd lengths, packed segments, sliding windows, soft cap)
is checked forward and backward (dq, dk, dv) in float32 and bfloat16, also on grids with
unequal q / kv blocks and several blocks per row and column. Lowering for TPU (Mosaic) and CUDA
(Triton) is checked from the CPU jaxlib with `lower(lowering_platforms=...)`; for the Mosaic TPU
kernels also their block schedule (masked blocks skipped without a new DMA) and that their
per-step VMEM blocks do not grow with the sequence length (32k tokens).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.kernels import (
    MASK_VALUE,
    BlockSizes,
    flash_attention,
    flash_attention_backward,
    flash_attention_reference,
    flash_attention_reference_with_lse,
    flash_attention_with_lse,
)
from jaxllm.kernels.flash_attention import kernel, mosaic_tpu
from jaxllm.kernels.flash_attention.reference import attention_mask

# Max abs / rel error vs the float32 reference run on the same (rounded) inputs. float32: the
# kernels differ only by summation order. bfloat16: p and ds are rounded to bf16 before the
# second matmul of each pair and the results are stored in bf16.
TOL = {jnp.float32: dict(out=2e-5, grad=5e-5), jnp.bfloat16: dict(out=2e-2, grad=5e-2)}


def _inputs(b, l, s, h, g, k, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, l, h, k), jnp.float32).astype(dtype)
    kk_ = jax.random.normal(kk, (b, s, g, k), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, g, k), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (b, l, h, k), jnp.float32).astype(dtype)
    return q, kk_, v, do


def _packed_ids(b, length, cuts):
    """[B, L] segment ids with documents starting at `cuts` (shifted per batch row)."""
    pos = np.arange(length)
    ids = np.stack([np.searchsorted(np.asarray(cuts) + 3 * i, pos, side="right") for i in range(b)])
    return jnp.asarray(ids, jnp.int32)


def _check(dtype, b, l, h, g, k, *, block=32, s=None, **kw):
    """block: one size for q and kv, or a (block_q, block_kv) pair."""
    s = l if s is None else s
    q, k_, v, do = _inputs(b, l, s, h, g, k, dtype)
    bs = BlockSizes(*block) if isinstance(block, tuple) else BlockSizes(block, block)

    def kern(q, k_, v):
        return flash_attention(q, k_, v, block_sizes=bs, interpret=True, **kw)

    def ref(q, k_, v):
        return flash_attention_reference(q, k_, v, **kw)

    @jax.jit  # one compile of the three interpreted kernels and the glue around them
    def out_and_grads(q, k_, v, do):
        (out, vjp), (out_ref, vjp_ref) = jax.vjp(kern, q, k_, v), jax.vjp(ref, q, k_, v)
        return out, out_ref, vjp(do), vjp_ref(do)

    out, out_ref, grads, grads_ref = out_and_grads(q, k_, v, do)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=tol["out"], rtol=tol["out"])
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert got.dtype == dtype, name
        assert np.all(np.isfinite(f32(got))), name
        np.testing.assert_allclose(
            f32(got), f32(want), atol=tol["grad"], rtol=tol["grad"], err_msg=name
        )
    return out


# (id, B, L, H, G, K, kwargs): each feature forward + backward at least once per dtype.
CASES = [
    ("full_mha", 2, 64, 8, 8, 64, {}),
    ("causal_gqa2_k128", 1, 128, 8, 4, 128, dict(causal=True)),
    ("causal_gqa4_odd", 1, 100, 8, 2, 64, dict(causal=True)),
    ("causal_mqa8", 1, 64, 8, 1, 64, dict(causal=True)),
    ("full_odd_block64", 2, 100, 8, 2, 64, dict(block=64)),
    ("segments_causal_odd", 2, 100, 8, 4, 64, dict(causal=True, segment_ids="packed")),
    ("segments_full", 1, 64, 8, 2, 64, dict(segment_ids="packed")),
    ("window_causal", 1, 128, 8, 2, 64, dict(causal=True, sliding_window=40)),
    ("window_full_odd", 1, 100, 8, 8, 64, dict(sliding_window=24)),
    ("softcap_causal", 1, 64, 8, 2, 128, dict(causal=True, soft_cap=2.0)),
    ("all_masks_odd_k128", 1, 100, 8, 2, 128,
     dict(causal=True, segment_ids="packed", sliding_window=30, soft_cap=3.0)),
]  # fmt: skip
BF16_CASES = {"full_mha", "causal_gqa4_odd", "causal_mqa8", "segments_causal_odd",
              "window_causal", "softcap_causal", "all_masks_odd_k128"}  # fmt: skip


def _params():
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, *case in CASES:
            if dtype == jnp.float32 or name in BF16_CASES:
                yield pytest.param(dtype, *case, id=f"{jnp.dtype(dtype).name}-{name}")


@pytest.mark.parametrize("dtype,b,l,h,g,k,kw", list(_params()))
def test_matches_reference(dtype, b, l, h, g, k, kw):
    kw = dict(kw)
    if kw.get("segment_ids") == "packed":
        kw["segment_ids"] = _packed_ids(b, l, [17, 50, 51, 90])
    _check(dtype, b, l, h, g, k, **kw)


# (id, L, S, (block_q, block_kv), kwargs): every mask on grids with several kv blocks per q block
# and several q blocks per kv block, block_q both below and above block_kv, GQA 2, padded tails.
MULTI_BLOCK_CASES = [
    ("full", 88, 88, (16, 32), {}),
    ("causal", 88, 88, (32, 8), dict(causal=True)),
    ("window_causal", 88, 88, (16, 32), dict(causal=True, sliding_window=20)),
    ("window_bidirectional", 88, 88, (32, 8), dict(sliding_window=20)),
    ("segments_causal", 88, 88, (16, 32), dict(causal=True, segment_ids="packed")),
    ("causal_keys_past_queries", 56, 88, (8, 16), dict(causal=True)),  # keys 56.. seen by none
    ("window_queries_past_keys", 88, 40, (16, 8), dict(sliding_window=16)),  # rows 55.. see none
]  # fmt: skip


@pytest.mark.parametrize(
    "l,s,blocks,kw", [pytest.param(*case, id=name) for name, *case in MULTI_BLOCK_CASES]
)
def test_multi_block_grids_match_reference(l, s, blocks, kw):
    """The Mosaic TPU kernels carry their accumulators across the inner grid axis and skip
    masked blocks; here with unequal block sizes, blocks with no visible entry (skipped steps),
    kv blocks no query sees (dk = dv = 0) and q blocks that see no key (out 0)."""
    kw = dict(kw)
    if kw.get("segment_ids") == "packed":
        kw["segment_ids"] = _packed_ids(1, l, [17, 50, 51, 90])
    _check(jnp.float32, 1, l, 4, 2, 32, s=s, block=blocks, **kw)


def test_cross_attention_empty_rows_give_zero_not_nan():
    """L != S with a (q_ids, kv_ids) pair: queries of segment 9 see no key at all."""
    b, l, s = 1, 64, 100
    q_ids = jnp.concatenate([jnp.zeros((b, 40), jnp.int32), jnp.full((b, 24), 9, jnp.int32)], 1)
    kv_ids = _packed_ids(b, s, [30])  # segments 0 and 1 only
    out = _check(jnp.float32, b, l, 8, 2, 64, s=s, segment_ids=(q_ids, kv_ids))
    np.testing.assert_array_equal(np.asarray(out[:, 40:]), 0.0)


def test_causality_by_gradient():
    """d out[i] / d k[j] is zero for j > i and for keys outside the sliding window."""
    q, k, v, _ = _inputs(1, 64, 64, 8, 2, 64, jnp.float32)
    i = 40

    def row(k):
        out = flash_attention(q, k, v, causal=True, sliding_window=16, interpret=True,
                              block_sizes=BlockSizes(16, 16))  # fmt: skip
        return out[0, i].sum()

    dk_norm = np.abs(np.asarray(jax.grad(row)(k)[0])).sum(axis=(1, 2))
    visible = (np.arange(64) <= i) & (np.arange(64) > i - 16)
    assert np.all(dk_norm[~visible] == 0.0) and np.all(dk_norm[visible] > 0.0)


@pytest.mark.parametrize("backend", [None, "triton"])
def test_jit_interpret_and_xla_backend_agree(backend):
    """backend None interprets the Mosaic TPU kernels on CPU; "triton" the same kernels with the
    Triton block sizes and compiler params."""
    q, k, v, _ = _inputs(1, 64, 64, 8, 4, 64, jnp.float32)
    f = jax.jit(
        lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=True, backend=backend)
    )
    xla = flash_attention(q, k, v, causal=True, backend="xla")
    np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(xla), atol=2e-5, rtol=2e-5)


def test_rejects_bad_arguments():
    q, k, v, _ = _inputs(1, 64, 64, 8, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v, interpret=True)
    q, k, v, _ = _inputs(1, 64, 32, 8, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="L == S"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((1, 64), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q, k, v, backend="cuda")


# ------------------------------------------------------------------ logsumexp and backward


def _direct_lse(q, k, mask_BxLxS, soft_cap=None):
    """log sum_j exp(s_ij) over visible keys, straight from the definition (empty rows: -inf)."""
    b, l, h, d = q.shape
    g = k.shape[2]
    k_rep = jnp.repeat(k.astype(jnp.float32), h // g, axis=2)
    s = jnp.einsum("blhk,bshk->bhls", q.astype(jnp.float32), k_rep) * d**-0.5
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return jax.nn.logsumexp(jnp.where(mask_BxLxS[:, None], s, -jnp.inf), axis=-1)


# id -> (L, S, H, G, kwargs); segment ids are a (q_ids, kv_ids) pair in every case.
LSE_CASES = {
    "causal_gqa2_odd": (40, 40, 4, 2, dict(causal=True)),
    "softcap_window_mqa": (32, 32, 4, 1, dict(causal=True, sliding_window=9, soft_cap=2.0)),
    "cross_empty_rows": (24, 40, 4, 2, dict()),  # q segment 9 has no key
}  # fmt: skip


def _lse_case(name, dtype):
    """q, k, v and the keyword arguments (masks, segment id pair) of one LSE_CASES entry."""
    l, s, h, g, kw = LSE_CASES[name]
    q, k, v, _ = _inputs(2, l, s, h, g, 32, dtype)
    q_ids = _packed_ids(2, l, [11, 30])
    if name == "cross_empty_rows":
        q_ids = q_ids.at[:, 18:].set(9)
    return q, k, v, dict(kw, segment_ids=(q_ids, _packed_ids(2, s, [11, 30])))


def _mask_from_definition(l, s, kw):
    q_ids, kv_ids = kw["segment_ids"]
    mask = q_ids[:, :, None] == kv_ids[:, None, :]
    qi, ki = np.arange(l)[:, None], np.arange(s)[None, :]
    if kw.get("causal"):
        mask &= jnp.asarray(ki <= qi)[None]
    if kw.get("sliding_window") is not None:
        mask &= jnp.asarray(qi - kw["sliding_window"] < ki)[None]
    return mask


@pytest.mark.parametrize(
    "name, dtype",
    [pytest.param(name, jnp.float32, id=f"float32-{name}") for name in LSE_CASES]
    + [pytest.param("softcap_window_mqa", jnp.bfloat16, id="bfloat16-softcap_window_mqa")],
)
def test_with_lse_values_and_gradients_through_lse(name, dtype):
    """loss = sum(out * w1) + sum(lse * w2): the kernel's gradients, which reach the backward as
    delta - dlse, equal jax.grad of the jnp reference; lse equals its definition."""
    q, k, v, kw = _lse_case(name, dtype)
    b, l, h, _ = q.shape
    s = k.shape[1]
    w1 = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    w2 = jax.random.normal(jax.random.key(8), (b, h, l), jnp.float32)

    def loss_and_grads(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v, **kw)
            return jnp.sum(out.astype(jnp.float32) * w1) + jnp.sum(lse * w2), (out, lse)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    kern = functools.partial(
        flash_attention_with_lse, interpret=True, block_sizes=BlockSizes(16, 16)
    )
    (_, (out, lse)), grads = loss_and_grads(kern)
    (_, (out_ref, lse_ref)), grads_ref = loss_and_grads(flash_attention_reference_with_lse)
    assert lse.dtype == jnp.float32 and lse.shape == (b, h, l)
    tol = TOL[dtype]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=tol["out"], rtol=tol["out"])
    np.testing.assert_allclose(f32(lse), f32(lse_ref), atol=tol["out"], rtol=tol["out"])
    for name_, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert got.dtype == dtype and np.all(np.isfinite(f32(got))), name_
        np.testing.assert_allclose(
            f32(got), f32(want), atol=tol["grad"], rtol=tol["grad"], err_msg=name_
        )

    direct = np.asarray(_direct_lse(q, k, _mask_from_definition(l, s, kw), kw.get("soft_cap")))
    visible = np.isfinite(direct)
    np.testing.assert_allclose(f32(lse)[visible], direct[visible], atol=tol["out"], rtol=1e-5)
    # Empty rows: the finite MASK_VALUE (merges with weight 0), zero output and zero dq.
    assert (name == "cross_empty_rows") == bool(np.any(~visible))
    np.testing.assert_array_equal(f32(lse)[~visible], np.float32(MASK_VALUE))
    empty_BxL = ~visible.any(axis=1)
    assert np.all(f32(out)[empty_BxL] == 0) and np.all(f32(grads[0])[empty_BxL] == 0)


def test_xla_backend_returns_the_reference_out_and_lse():
    q, k, v, kw = _lse_case("causal_gqa2_odd", jnp.float32)
    out, lse = flash_attention_with_lse(q, k, v, backend="xla", **kw)
    out_k, lse_k = jax.jit(functools.partial(flash_attention_with_lse, interpret=True, **kw))(
        q, k, v
    )
    out_ref, lse_ref = flash_attention_reference_with_lse(q, k, v, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_ref))
    np.testing.assert_allclose(np.asarray(out_k), np.asarray(out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse_k), np.asarray(lse), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "xla"])
def test_backward_of_key_blocks_with_global_statistics_sums_to_full_gradient(backend):
    """Keys in two blocks (as ring attention sees them): `flash_attention_backward` on each block
    with the (out, lse) of the whole attention gives dq summing, and dk/dv concatenating, to the
    gradients of the whole attention."""
    l, s, cut = 24, 48, 28  # the cut is not a multiple of the block size: padded tails
    q, k, v, do = _inputs(2, l, s, 4, 2, 32, jnp.float32, seed=3)
    q_ids = _packed_ids(2, l, [10]).at[:, 20:].set(9)  # segment 9: rows with no key at all
    kv_ids = _packed_ids(2, s, [20])
    kw = dict(soft_cap=3.0, interpret=backend != "xla", backend=backend,
              block_sizes=BlockSizes(16, 16))  # fmt: skip

    @jax.jit
    def blockwise_and_full(q, k, v, do):
        full = functools.partial(flash_attention_reference_with_lse, soft_cap=3.0,
                                 segment_ids=(q_ids, kv_ids))  # fmt: skip
        (out, lse), vjp = jax.vjp(full, q, k, v)
        grads = [
            flash_attention_backward(
                q, k[:, blk], v[:, blk], out, lse, do, segment_ids=(q_ids, kv_ids[:, blk]), **kw
            )
            for blk in (slice(0, cut), slice(cut, s))
        ]
        dq = grads[0][0] + grads[1][0]
        dk, dv = (jnp.concatenate([grads[0][i], grads[1][i]], axis=1) for i in (1, 2))
        return (dq, dk, dv), vjp((do, jnp.zeros_like(lse)))

    got, want = blockwise_and_full(q, k, v, do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=name)
    assert np.all(np.asarray(got[0])[:, 20:] == 0)


# ------------------------------------------------------------------ lowering (CPU jaxlib)

LOWERINGS = [  # (platform, backend, custom call the kernels must lower to)
    ("tpu", "mosaic_tpu", "tpu_custom_call"),
    ("cuda", "triton", "__gpu$xla.gpu.triton"),
]


@pytest.mark.parametrize("platform,backend,target", LOWERINGS, ids=[p for p, *_ in LOWERINGS])
@pytest.mark.parametrize(
    "dtype,l,g,k,kw",
    [
        (
            jnp.bfloat16,
            256,
            2,
            128,
            dict(causal=True, segment_ids=True, sliding_window=100, soft_cap=30.0),
        ),
        (jnp.float32, 200, 8, 64, dict(causal=True)),
    ],  # fmt: skip
    ids=["bf16-all_masks", "f32-odd_len"],
)
def test_lowers(platform, backend, target, dtype, l, g, k, kw):
    q = jax.ShapeDtypeStruct((2, l, 8, k), dtype)
    kv = jax.ShapeDtypeStruct((2, l, g, k), dtype)
    ids = jax.ShapeDtypeStruct((2, l), jnp.int32)
    kw = dict(kw, backend=backend)
    use_ids = kw.pop("segment_ids", False)

    def fwd(q, k, v, ids):
        return flash_attention(q, k, v, segment_ids=ids if use_ids else None, **kw)

    def loss(q, k, v, ids):
        return fwd(q, k, v, ids).astype(jnp.float32).sum()

    def block_grads(q, k, v, ids):  # the ring's backward: statistics from outside the block
        lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
        return flash_attention_backward(
            q, k, v, q, lse, q, segment_ids=ids if use_ids else None, **kw
        )

    grads = jax.value_and_grad(loss, argnums=(0, 1, 2))
    for fn, calls in ((fwd, 1), (grads, 3), (block_grads, 2)):
        lowered = jax.jit(fn).trace(q, kv, kv, ids).lower(lowering_platforms=(platform,))
        assert lowered.as_text().count(target) >= calls


# ---------------------------------------------------- Mosaic TPU grid schedule and VMEM use

# (L, S, block_q, block_kv, causal, sliding_window)
SCHEDULES = [
    (88, 88, 16, 32, True, None),
    (88, 88, 32, 8, True, 20),
    (88, 88, 16, 8, False, 20),
    (100, 100, 32, 32, False, None),
    (56, 88, 16, 32, True, None),
    (88, 40, 8, 16, False, 16),
    (40, 88, 8, 16, False, 3),
]  # fmt: skip


@pytest.mark.parametrize("l,s,bq,bk,causal,window", SCHEDULES)
def test_mosaic_tpu_schedule_visits_each_visible_block_once(l, s, bq, bk, causal, window):
    """Each row block's inner steps visit exactly the blocks of the other sequence that hold a
    visible entry, each once, then repeat the last one (no compute, no new DMA); a visited block
    skips the per-element mask exactly when every entry of it is visible."""
    cfg = kernel.Config(
        block_q=bq, block_kv=bk, q_len=l, kv_len=s, causal=causal, sliding_window=window,
        soft_cap=None, sm_scale=1.0, has_segments=False, backend="mosaic_tpu", interpret=True,
    )  # fmt: skip
    lp, sp = -(-l // bq) * bq, -(-s // bk) * bk
    nq, nk = lp // bq, sp // bk
    band_LpxSp = np.asarray(
        attention_mask(lp, sp, causal=causal, q_ids_BxL=None, kv_ids_BxS=None,
                       sliding_window=window)[0]
    )  # fmt: skip
    real_q, real_k = np.arange(lp)[:, None] < l, np.arange(sp)[None, :] < s

    def per_block(mask_LpxSp, reduce):
        return reduce(mask_LpxSp.reshape(nq, bq, nk, bk), axis=(1, 3))  # [nq, nk]

    q_start, k_start = jnp.arange(nq)[:, None] * bq, jnp.arange(nk)[None, :] * bk
    # forward / dq: q blocks are the rows; dk/dv: kv blocks are, and padded queries are masked.
    for block_range, rows, cols, visible, full, needs_mask in (
        (kernel._kv_block_range, nq, nk, per_block(band_LpxSp, np.any),
         per_block(band_LpxSp & real_k, np.all),
         mosaic_tpu._needs_mask(q_start, k_start, cfg, pad_q=False)),
        (kernel._q_block_range, nk, nq, per_block(band_LpxSp, np.any).T,
         per_block(band_LpxSp & real_k & real_q, np.all).T,
         mosaic_tpu._needs_mask(q_start, k_start, cfg, pad_q=True).T),
    ):  # fmt: skip
        steps, num_visited = mosaic_tpu._schedule(block_range, rows, cols, cfg)
        index, vis = mosaic_tpu._visited(
            block_range, jnp.arange(rows)[:, None], jnp.arange(steps)[None, :], cfg, cols
        )
        index, vis = np.broadcast_to(index, (rows, steps)), np.broadcast_to(vis, (rows, steps))
        assert num_visited == visible.sum() and steps == max(1, visible.sum(axis=1).max())
        for i in range(rows):
            count = int(vis[i].sum())
            assert np.all(vis[i, :count]) and list(index[i, :count]) == list(
                np.flatnonzero(visible[i])
            )
            assert np.all(index[i, count:] == index[i, max(count - 1, 0)])  # no new block fetched
            assert 0 <= index[i].min() and index[i].max() < cols
        np.testing.assert_array_equal(np.broadcast_to(needs_mask, full.shape), ~full)


def _pallas_calls(jaxpr):
    """The pallas_call equations of a jaxpr, in its sub-jaxprs too (custom_vjp, pjit, cond)."""

    def subjaxprs(value):
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from subjaxprs(item)

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():
            for sub in subjaxprs(value):
                yield from _pallas_calls(sub)


def _step_bytes(eqn) -> int:
    """VMEM bytes of one grid step of a pallas_call: its input / output blocks and scratch."""
    grid_mapping = eqn.params["grid_mapping"]
    avals = [bm.transformed_block_aval for bm in grid_mapping.block_mappings]
    avals += list(grid_mapping.scratch_avals)
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)


@pytest.mark.parametrize("window", [None, 4096], ids=["causal", "causal_window"])
def test_long_sequence_lowers_for_tpu_with_vmem_independent_of_length(window):
    """32k tokens, head dim 128, bf16, GQA 4, packed segments: forward, dq and dk/dv lower for TPU
    with the same per-step blocks and scratch as at 1k tokens (only the grid grows), and a
    sliding window keeps the inner grid axis at about window / block_kv steps."""

    def kernels_at(length):
        q = jax.ShapeDtypeStruct((1, length, 16, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, length, 4, 128), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)

        def loss(q, k, v, ids):
            out = flash_attention(q, k, v, causal=True, segment_ids=ids, sliding_window=window,
                                  backend="mosaic_tpu")  # fmt: skip
            return out.astype(jnp.float32).sum()

        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, ids)
        assert traced.lower(lowering_platforms=("tpu",)).as_text().count("tpu_custom_call") >= 3
        calls = list(_pallas_calls(traced.jaxpr.jaxpr))
        assert len(calls) == 3  # forward, dq, dk/dv
        return [(eqn.params["grid_mapping"].grid, _step_bytes(eqn)) for eqn in calls]

    short, long = kernels_at(1024), kernels_at(32768)
    assert [b for _, b in long] == [b for _, b in short]
    assert all(b < 512 * 1024 for _, b in long)  # a few [128, 128] tiles, double-buffered or not
    fwd_grid, dq_grid, dkdv_grid = (grid for grid, _ in long)
    assert fwd_grid == dq_grid and fwd_grid[:3] == (1, 16, 256) and dkdv_grid[:4] == (1, 4, 256, 4)
    inner = 256 if window is None else window // 128 + 1
    assert fwd_grid[3] == inner and dkdv_grid[4] == inner


def test_bench_attention_script_runs_interpreted():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(
        "--impls flash,xla,cudnn --seqs 64 --tokens 64 --hidden 128 --head-dim 64 --kv-heads 1 "
        "--block-q 32 --block-kv 32 --dtype float32 --interpret --warmup 1 --iters 1".split()
    )
    ok = {r["impl"]: r for r in rows if "error" not in r}
    assert set(ok) >= {"flash", "xla"}
    assert all(ok[i]["fwd_tflops"] > 0 and ok[i]["fwd_bwd_tflops"] > 0 for i in ok)
    assert [r["impl"] for r in rows] == ["flash", "xla", "cudnn"]  # cudnn reported, not dropped
