"""FlashAttention Pallas kernels vs the pure-JAX reference, in interpret mode on CPU.

Every feature (GQA ratios, head dims, odd lengths, packed segments, sliding windows, soft cap)
is checked forward and backward (dq, dk, dv) in float32 and bfloat16. Lowering for TPU (Mosaic)
and CUDA (Triton) is checked from the CPU jaxlib with `lower(lowering_platforms=...)`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxllm.kernels import BlockSizes, flash_attention, flash_attention_reference

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
    s = l if s is None else s
    q, k_, v, do = _inputs(b, l, s, h, g, k, dtype)
    bs = BlockSizes(block, block)

    def kern(q, k_, v):
        return flash_attention(q, k_, v, block_sizes=bs, interpret=True, **kw)

    def ref(q, k_, v):
        return flash_attention_reference(q, k_, v, **kw)

    out, vjp = jax.vjp(kern, q, k_, v)
    out_ref, vjp_ref = jax.vjp(ref, q, k_, v)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOL[dtype]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=tol["out"], rtol=tol["out"])
    for name, got, want in zip(("dq", "dk", "dv"), vjp(do), vjp_ref(do)):
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

    for fn, calls in ((fwd, 1), (jax.value_and_grad(loss, argnums=(0, 1, 2)), 3)):
        lowered = jax.jit(fn).trace(q, kv, kv, ids).lower(lowering_platforms=(platform,))
        assert lowered.as_text().count(target) >= calls
