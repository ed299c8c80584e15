"""The Mosaic GPU (Hopper) decode-attention kernel vs the pure-JAX reference, on CPU.

Numerics run every line of the kernel in the Mosaic GPU interpreter (TMA copies, barriers, the
two-slot pipeline, wgmma, the per-query extraction of p), on the poisoned ragged caches of
`test_decode_attention.py` (a length-0 row, lengths off the block and group grid, NaN past each
sequence's end). Lowering for CUDA runs the Mosaic GPU compiler from the CPU jaxlib up to the
kernel module (layouts, shared memory); PTX and the hardware are left to a GPU run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jaxllm.kernels.decode_attention import decode_attention, mosaic_gpu
from jaxllm.kernels.decode_attention import ops as dk_ops
from jaxllm.kernels.reference import MASK_VALUE
from lowering import lower
from test_decode_attention import LENGTHS, _build, _reference, f32
from test_decode_attention_lowering import _abstract_cache

from jaxllm.config.errors import JaxllmWarning
from jaxllm.infer.generate import resolve_decode_impl

# bf16 operands (q, dequantized k / v and p are rounded to bfloat16), float32 accumulation.
TOL = 3e-2
MGPU = dict(backend="mosaic_gpu", interpret=True, block_kv=64, num_splits=2)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """The interpreter keeps global state that an exception in a previous test leaves dirty."""
    interpret_pallas_call.reset_gpu_interpret_mode_state()


# (id, kind, G, R, Q, layers, paged, q dtype, head dim, soft cap): T = 128 (two blocks of 64),
# pages of 64, two splits, lengths (0, 37, 100, 128).
CASES = [
    ("bf16-gqa2-q1", "bfloat16", 2, 2, 1, None, False, jnp.bfloat16, 64, None),
    ("bf16-mqa-q4-paged-cap", "bfloat16", 1, 4, 4, None, True, jnp.float32, 64, 5.0),
    ("int8-gqa2-q2-layer", "int8", 2, 2, 2, 2, False, jnp.bfloat16, 64, None),
    ("int8-mha-q1-paged-k128", "int8", 2, 1, 1, None, True, jnp.float32, 128, None),
    ("int4-gqa2-q1", "int4", 2, 2, 1, None, False, jnp.float32, 128, None),
    ("int4-mqa-q3-paged-layer-cap", "int4", 1, 4, 3, 2, True, jnp.bfloat16, 128, 20.0),
]


@pytest.mark.parametrize(
    "kind,g,r,nq,layers,paged,dtype,d,cap", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_kernel_matches_reference(kind, g, r, nq, layers, paged, dtype, d, cap):
    cache, layer = _build(kind, g, layers, paged, dtype, d=d)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(7), (len(LENGTHS), nq, g * r, d), jnp.float32)
    q = q.astype(dtype)

    @jax.jit
    def run(q, cache, lengths, layer):
        return decode_attention(q, cache, lengths, layer=layer, soft_cap=cap, **MGPU)

    out = run(q, cache, lengths, layer)
    ref = _reference(q.astype(jnp.float32), cache, lengths, layer=layer, soft_cap=cap)
    assert out.shape == q.shape and out.dtype == dtype
    assert np.all(np.isfinite(f32(out)))
    np.testing.assert_array_equal(f32(out)[0], 0.0)  # length-0 row
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL, rtol=0)


def test_partials_of_empty_rows_and_splits():
    """The kernel's own (out, lse): a length-0 row and splits past a sequence's end give out 0
    and lse MASK_VALUE; padded query rows (past M) are returned for the caller to drop."""
    cache, _ = _build("bfloat16", 1, None, False, jnp.bfloat16)
    lengths = jnp.asarray([0, 37, 100, 128], jnp.int32)
    cfg = dk_ops.Config(
        kind="bfloat16",
        group=32,
        head_dim=64,
        num_kv_heads=1,
        seq_len=128,
        block_kv=64,
        num_splits=2,
        blocks_per_split=1,
        num_queries=1,
        num_rows=2,
        sm_scale=0.125,
        soft_cap=None,
        page_size=None,
        num_pages=None,
        has_layer=False,
        backend="mosaic_gpu",
        interpret=True,
    )
    q = jnp.ones((4, 1, 2, 64), jnp.bfloat16)
    zero = jnp.zeros((1,), jnp.int32)
    out, lse = jax.jit(mosaic_gpu.forward, static_argnums=5)(
        (q,), [cache.k, cache.v], lengths, zero, zero, cfg
    )
    assert out.shape == (4, 1, 2, mosaic_gpu.ROWS, 64) and lse.shape[-1] == 1
    empty = [(0, 0), (0, 1), (1, 1)]  # (row, split): length 0; 37 tokens end in split 0
    for b, s in empty:
        np.testing.assert_array_equal(f32(out[b, 0, s, :2]), 0.0)
        np.testing.assert_array_equal(f32(lse[b, 0, s, :2]), np.float32(MASK_VALUE))
    assert np.all(f32(lse[3, 0, :, :2]) > MASK_VALUE / 2)


# ----------------------------------------------------------------------------- dispatch


class _FakeDevice:
    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


def _fwd(backend=None):
    def fwd(q, cache, lengths, layer):
        return decode_attention(q, cache, lengths, layer=layer, soft_cap=30.0, backend=backend)

    return fwd


def _avals(kind, page=None, d=128, nq=2):
    cache = _abstract_cache(kind, page=page, d=d)
    q = jax.ShapeDtypeStruct((2, nq, 8, d), jnp.bfloat16)  # R = 4: M = 4 * nq rows per kv head
    return q, cache, jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)


@pytest.mark.parametrize(
    "capability,kind,d,expect",
    [
        ("9.0", "bfloat16", 128, "triton"),
        ("9.0", "int4", 64, "triton"),
        ("8.0", "int8", 128, "triton"),
        ("10.0", "int8", 128, "triton"),
        ("9.0", "bfloat16", 96, "xla"),  # Triton needs a power-of-2 head dim
    ],
)
def test_default_backend_on_gpu(monkeypatch, capability, kind, d, expect):
    """CUDA GPUs default to the Triton kernel (the fastest measured on an H100) for the calls it
    takes, and `generate.decode_impl=auto` to the kernel path on Hopper; other calls get the
    XLA reference with one warning. The Mosaic GPU kernel runs only when asked for."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *_: [_FakeDevice(capability)])
    monkeypatch.setattr(dk_ops, "_warned_gpu_fallback", False)
    avals = _avals(kind, d=d)
    if expect == "triton":
        text = lower(_fwd(), *avals, platform="cuda").as_text()  # warnings are errors: none
    else:
        with pytest.warns(JaxllmWarning, match="no kernel for .* XLA reference"):
            text = lower(_fwd(), *avals, platform="cuda").as_text()
    assert ("__gpu$xla.gpu.triton" in text) == (expect == "triton")
    assert "mosaic_gpu" not in text
    hopper = capability.startswith("9.")
    assert resolve_decode_impl("auto") == ("kernel" if hopper else "xla", False)


def test_rejects_unsupported_calls():
    q, cache, lengths, layer = _avals("bfloat16", d=128)
    paged_96 = _abstract_cache("bfloat16", page=96)
    with pytest.raises(ValueError, match="multiple of 64"):
        lower(_fwd("mosaic_gpu"), q, paged_96, lengths, layer, platform="cuda")
    q_many = jax.ShapeDtypeStruct((2, 9, 8, 128), jnp.bfloat16)  # 4 * 9 = 36 rows: fine
    lower(_fwd("mosaic_gpu"), q_many, cache, lengths, layer, platform="cuda")
    q_too_many = jax.ShapeDtypeStruct((2, 17, 8, 128), jnp.bfloat16)  # 68 rows
    with pytest.raises(ValueError, match="query rows"):
        lower(_fwd("mosaic_gpu"), q_too_many, cache, lengths, layer, platform="cuda")
    q32, cache32, *_ = _avals("float32")
    with pytest.raises(ValueError, match="float32 caches"):
        lower(_fwd("mosaic_gpu"), q32, cache32, lengths, layer, platform="cuda")


# ------------------------------------------------------------------ lowering (CPU jaxlib)


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("page", [None, 256], ids=["contiguous", "paged"])
def test_lowers_for_cuda(kind, page):
    """Stacked layers, GQA with two new queries, soft cap: one Mosaic GPU kernel, within
    Hopper's shared memory."""
    text = lower(_fwd("mosaic_gpu"), *_avals(kind, page=page), platform="cuda").as_text()
    assert text.count("mosaic_gpu") >= 1
