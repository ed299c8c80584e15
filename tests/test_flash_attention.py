"""FlashAttention Pallas kernels vs the pure-JAX reference, in interpret mode on CPU.

Every feature (GQA ratios, head dims, odd lengths, packed segments, sliding windows, soft cap)
is checked forward and backward (dq, dk, dv) in float32 and bfloat16, also on grids with
unequal q / kv blocks and several blocks per row and column. The logsumexp output and the
standalone backward are in `test_flash_attention_lse.py`, lowering for TPU / CUDA and the Mosaic
TPU block schedule in `test_flash_attention_lowering.py`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs as _inputs
from attention_inputs import packed_ids as _packed_ids
from jaxllm.kernels import (
    BlockSizes,
    flash_attention,
    flash_attention_reference,
)

# Max abs / rel error vs the float32 reference run on the same (rounded) inputs. float32: the
# kernels differ only by summation order. bfloat16: p and ds are rounded to bf16 before the
# second matmul of each pair and the results are stored in bf16.
TOL = {jnp.float32: dict(out=2e-5, grad=5e-5), jnp.bfloat16: dict(out=2e-2, grad=5e-2)}


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
    (
        "all_masks_odd_k128",
        1,
        100,
        8,
        2,
        128,
        dict(causal=True, segment_ids="packed", sliding_window=30, soft_cap=3.0),
    ),
]
BF16_CASES = {"full_mha", "causal_gqa4_odd", "all_masks_odd_k128"}  # all_masks: every mask at once
BF16_SLOW = {"causal_mqa8", "segments_causal_odd", "window_causal", "softcap_causal"}
# in all_masks_odd_k128 (window, soft cap, head dim 128) or the multi-block grids (block 64,
# bidirectional windows) by default
F32_SLOW = {"causal_gqa2_k128", "full_odd_block64", "window_causal", "window_full_odd"}
F32_SLOW |= {"softcap_causal"}


def _params():
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, *case in CASES:
            slow = name in (BF16_SLOW if dtype == jnp.bfloat16 else F32_SLOW)
            if dtype == jnp.float32 or name in BF16_CASES or slow:
                marks = [pytest.mark.slow] if slow else []
                yield pytest.param(dtype, *case, id=f"{jnp.dtype(dtype).name}-{name}", marks=marks)


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
]


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
        out = flash_attention(
            q, k, v, causal=True, sliding_window=16, interpret=True, block_sizes=BlockSizes(16, 16)
        )
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
