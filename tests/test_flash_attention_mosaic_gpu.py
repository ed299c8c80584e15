"""The Mosaic GPU (Hopper) flash-attention kernels vs the pure-JAX reference, on CPU.

Numerics run every line of the three kernels (forward, dq, dk/dv) in the Mosaic GPU interpreter:
TMA copies, barriers, wgmma and the two-slot pipeline, with the interpreter's barrier bookkeeping
(a slot refilled before its previous fill was waited for is an error) and, in one test, its race
detector. Lowering for CUDA is checked from the CPU jaxlib with `lower(lowering_platforms=...)`,
which runs the Mosaic GPU compiler up to the kernel module (layouts, shared-memory budget); only
PTX generation and the hardware itself are left to a GPU run.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs as _inputs
from attention_inputs import packed_ids as _packed_ids
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax._src.pallas.mosaic_gpu.interpret.params import (
    InterpretGPUParams,
    force_gpu_interpret_mode,
)
from jaxllm.kernels import (
    BlockSizes,
    flash_attention,
    flash_attention_backward,
    flash_attention_reference,
    flash_attention_reference_with_lse,
    flash_attention_with_lse,
)
from jaxllm.kernels.flash_attention import ops as flash_ops
from lowering import lower

from jaxllm.config.errors import JaxllmWarning

# Max abs / rel error vs the float32 reference on the same (rounded) inputs: p and ds are rounded
# to the input dtype before the second matmul of each pair and results are stored in it.
TOL = {jnp.bfloat16: dict(out=2e-2, grad=5e-2), jnp.float16: dict(out=5e-3, grad=1e-2)}
MGPU = dict(backend="mosaic_gpu", interpret=True)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """The interpreter keeps global state that an exception in a previous test leaves dirty."""
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _check(dtype, b, l, h, g, k, *, s=None, blocks=(64, 64), **kw):
    s = l if s is None else s
    q, k_, v, do = _inputs(b, l, s, h, g, k, dtype)
    sizes = BlockSizes(*blocks)

    def kern(q, k_, v):
        return flash_attention(q, k_, v, block_sizes=sizes, **MGPU, **kw)

    def ref(q, k_, v):
        return flash_attention_reference(q, k_, v, **kw)

    @jax.jit  # one program: the interpreted kernels and the reference, forward and backward
    def outputs_and_grads(q, k_, v, do):
        out, vjp = jax.vjp(kern, q, k_, v)
        out_ref, vjp_ref = jax.vjp(ref, q, k_, v)
        return out, out_ref, vjp(do), vjp_ref(do)

    out, out_ref, grads, grads_ref = outputs_and_grads(q, k_, v, do)
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


# (id, dtype, B, L, H, G, K, kwargs): small enough for the interpreter (a few seconds each), each
# with several blocks per program so the pipeline refills its slots.
CASES = [
    ("causal_gqa2_odd", jnp.bfloat16, 1, 100, 4, 2, 64, dict(causal=True)),
    ("causal_mqa_k128_kv128", jnp.bfloat16, 1, 128, 2, 1, 128, dict(causal=True, blocks=(64, 128))),
    (
        "f16_window_q128_odd",
        jnp.float16,
        1,
        130,
        2,
        1,
        64,
        dict(sliding_window=40, blocks=(128, 64)),
    ),
    (
        "all_masks_odd",
        jnp.bfloat16,
        1,
        100,
        2,
        1,
        64,
        dict(causal=True, segment_ids="packed", sliding_window=30, soft_cap=3.0),
    ),
]


@pytest.mark.parametrize("dtype,b,l,h,g,k,kw", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_matches_reference(dtype, b, l, h, g, k, kw):
    kw = dict(kw)
    if kw.get("segment_ids") == "packed":
        kw["segment_ids"] = _packed_ids(b, l, [17, 50, 51, 90])
    _check(dtype, b, l, h, g, k, **kw)


def test_cross_attention_empty_rows_give_zero_not_nan():
    """Full-mask MHA, L != S with a (q_ids, kv_ids) pair and a padded kv tail: queries of segment
    9 see no key."""
    b, l, s = 1, 64, 150
    q_ids = jnp.concatenate([jnp.zeros((b, 40), jnp.int32), jnp.full((b, 24), 9, jnp.int32)], 1)
    kv_ids = _packed_ids(b, s, [30])  # segments 0 and 1 only
    out = _check(jnp.float16, b, l, 2, 2, 64, s=s, segment_ids=(q_ids, kv_ids))
    np.testing.assert_array_equal(np.asarray(out[:, 40:], np.float32), 0.0)


def test_lse_and_standalone_backward():
    """`flash_attention_with_lse`: the logsumexp matches the reference and its cotangent reaches
    the backward (delta - dlse); `flash_attention_backward` given the reference's statistics
    returns the reference's gradients."""
    b, l, h, g, k = 1, 100, 2, 1, 64
    q, k_, v, do = _inputs(b, l, l, h, g, k, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (b, h, l), jnp.float32)
    masks = dict(causal=True, sliding_window=48)
    mgpu = dict(block_sizes=BlockSizes(64, 64), **MGPU, **masks)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731

    def loss_and_grads(fn, **kw):
        def loss(q, k_, v):
            out, lse = fn(q, k_, v, **kw)
            return jnp.sum(f32(do) * out.astype(jnp.float32)) + jnp.sum(w * lse), lse

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k_, v)

    (_, lse), grads = loss_and_grads(flash_attention_with_lse, **mgpu)
    (_, lse_ref), grads_ref = loss_and_grads(flash_attention_reference_with_lse, **masks)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-4, rtol=1e-4)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        np.testing.assert_allclose(f32(got), f32(want), atol=5e-2, rtol=5e-2, err_msg=name)

    out_ref, lse_ref = flash_attention_reference_with_lse(q, k_, v, **masks)
    stats = (q, k_, v, out_ref, lse_ref, do)
    got = jax.jit(lambda *a: flash_attention_backward(*a, **mgpu))(*stats)
    want = flash_attention_backward(*stats, backend="xla", **masks)
    for name, got_, want_ in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(f32(got_), f32(want_), atol=5e-2, rtol=5e-2, err_msg=name)


def test_pipeline_has_no_races():
    """The race detector sees every SMEM read against the TMA writes into the same slot."""
    with force_gpu_interpret_mode(InterpretGPUParams(detect_races=True)):
        _check(jnp.bfloat16, 1, 128, 2, 1, 64, causal=True, segment_ids=_packed_ids(1, 128, [70]))
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.slow
def test_matches_reference_large():
    """Two batch rows, GQA, three blocks of 128 per sequence, every mask."""
    _check(
        jnp.bfloat16,
        2,
        384,
        4,
        2,
        64,
        blocks=(128, 128),
        causal=True,
        segment_ids=_packed_ids(2, 384, [100, 250]),
        sliding_window=200,
        soft_cap=20.0,
    )


# ----------------------------------------------------------------------------- dispatch


class _FakeDevice:
    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


def _lowered_text(fn, *avals):
    return lower(fn, *avals, platform="cuda").as_text()


@pytest.mark.parametrize(
    "capability,dtype,uses_kernel",
    [
        ("9.0", jnp.bfloat16, True),
        ("9.0", jnp.float16, True),
        ("8.0", jnp.bfloat16, False),
        ("10.0", jnp.bfloat16, False),
        ("9.0", jnp.float32, False),
    ],
)
def test_default_backend_on_gpu(monkeypatch, capability, dtype, uses_kernel):
    """Hopper defaults to these kernels for the inputs they support; float32 inputs, pre-Hopper
    GPUs and Blackwell (no wgmma: its tensor cores take tcgen05) get the XLA reference, with a
    warning (O(L^2) memory)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *_: [_FakeDevice(capability)])
    monkeypatch.setattr(flash_ops, "_warned_gpu_fallback", False)
    x = jax.ShapeDtypeStruct((1, 128, 2, 64), dtype)

    def lowered():
        return _lowered_text(lambda q, k, v: flash_attention(q, k, v, causal=True), x, x, x)

    if uses_kernel:
        text = lowered()  # warnings are errors: none here
    else:
        with pytest.warns(JaxllmWarning, match="no kernel for .* XLA reference"):
            text = lowered()
    assert ("mosaic_gpu_v2" in text) == uses_kernel


def test_gpu_fallback_warns_once_per_process(monkeypatch):
    """The first call that falls back to the reference on a GPU warns; later ones (other shapes,
    other calls) do not, nor does a call that asks for the reference with backend="xla"."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *_: [_FakeDevice("8.0")])
    monkeypatch.setattr(flash_ops, "_warned_gpu_fallback", False)
    q, k, v, _ = _inputs(1, 64, 64, 2, 1, 64, jnp.bfloat16)
    want = flash_attention_reference(q, k, v, causal=True)
    flash_attention(q, k, v, causal=True, backend="xla")  # asked for: no warning
    with pytest.warns(JaxllmWarning, match="compute capability 8.0"):
        got = flash_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attention(q[:, :32], k, v, segment_ids=None)
        flash_attention_with_lse(q, k, v, causal=True)


def test_rejects_unsupported_inputs():
    q, k, v, _ = _inputs(1, 64, 64, 2, 1, 64, jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        flash_attention(q, k, v, **MGPU)
    q, k, v, _ = _inputs(1, 64, 64, 2, 1, 96, jnp.bfloat16)
    with pytest.raises(ValueError, match="head dim 96"):
        flash_attention(q, k, v, **MGPU)
    q, k, v, _ = _inputs(1, 200, 200, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples of 64"):
        flash_attention(q, k, v, block_sizes=BlockSizes(96, 64), **MGPU)


# ------------------------------------------------------------------ lowering (CPU jaxlib)


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
        (jnp.float16, 200, 8, 64, dict(causal=True)),
    ],
    ids=["bf16-all_masks-k128", "f16-odd_len"],
)
def test_lowers_for_cuda(dtype, l, g, k, kw):
    """Forward and backward with the default block sizes: 1 and 3 Mosaic GPU kernels, within
    Hopper's shared memory."""
    q = jax.ShapeDtypeStruct((2, l, 8, k), dtype)
    kv = jax.ShapeDtypeStruct((2, l, g, k), dtype)
    ids = jax.ShapeDtypeStruct((2, l), jnp.int32)
    kw = dict(kw, backend="mosaic_gpu")
    use_ids = kw.pop("segment_ids", False)

    def fwd(q, k, v, ids):
        return flash_attention(q, k, v, segment_ids=ids if use_ids else None, **kw)

    def loss(q, k, v, ids):
        return fwd(q, k, v, ids).astype(jnp.float32).sum()

    for fn, calls in ((fwd, 1), (jax.value_and_grad(loss, argnums=(0, 1, 2)), 3)):
        assert _lowered_text(fn, q, kv, kv, ids).count("mosaic_gpu_v2") == calls
