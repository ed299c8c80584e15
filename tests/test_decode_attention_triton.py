"""The Triton decode kernel's KIVI block math (interpret mode on CPU): scales folded into q and p
rather than applied to dequantized tiles, checked against the float32 reference at head dim
128 with two token groups per kv block (`test_decode_attention.py` covers one group per block
at head dim 64), and checked structurally on the kernel's jaxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jaxllm.kernels.decode_attention import decode_attention
from jaxllm.kernels.decode_attention.ops import triton_supported
from test_decode_attention import LENGTHS, TOL, _cache, _paginate, _reference, f32

D = 128


def _run(q, cache, lengths, **kw):
    kw = dict(block_kv=64, num_splits=2, interpret=True, backend="triton", soft_cap=20.0) | kw
    return jax.jit(lambda q, cache, lengths: decode_attention(q, cache, lengths, **kw))(
        q, cache, lengths
    )


@pytest.mark.parametrize(
    "kind,dtype,paged",
    [
        ("int4", jnp.bfloat16, True),  # value scales on p per value group (4 chunks)
        ("int4", jnp.float32, False),
        ("int2", jnp.float32, True),  # value groups of 8 channels a part: dequantized values
    ],
)
def test_folded_kivi_matches_reference(kind, dtype, paged):
    """Ragged lengths (0, 37, 100, 128), NaN past each sequence's last full group, GQA 2, two
    32-token groups per 64-row block: one group of a block live and the other dead for the
    sequence of length 37 (its codes stop at 32)."""
    cache = _cache(kind, 2, D, 1, dtype)
    cache = _paginate(cache, 64, 11, seed=2) if paged else cache
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(3), (len(LENGTHS), 1, 4, D), jnp.float32).astype(dtype)
    out = _run(q, cache, lengths)
    ref = _reference(q.astype(jnp.float32), cache, lengths, soft_cap=20.0)
    assert np.all(np.isfinite(f32(out)))
    np.testing.assert_array_equal(f32(out)[0], 0.0)
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("q_scale", [1.0, 1e5])  # 1e5: beyond float16's range before scaling
def test_int8_float16_codes_match_reference(q_scale):
    """bfloat16 queries: the int8 kernel's dots take float16 operands (codes by bits, q and
    p * value scale row-normalized by powers of 2), so queries past float16's range work."""
    cache = _cache("int8", 2, D, 5, jnp.bfloat16)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(4), (len(LENGTHS), 2, 4, D), jnp.float32) * q_scale
    q = q.astype(jnp.bfloat16)
    out = _run(q, cache, lengths, soft_cap=None)
    ref = _reference(q.astype(jnp.float32), cache, lengths)
    assert np.all(np.isfinite(f32(out)))
    np.testing.assert_allclose(f32(out), f32(ref), atol=TOL[jnp.bfloat16], rtol=0)


def _kernel_eqns(jaxpr):
    """Every equation of a pallas_call kernel jaxpr, nested loops included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _kernel_eqns(sub)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_kernel_scales_no_token_channel_tile(kind):
    """The int4 / int8 kernel keeps every value 2-D (no lane interleave, no [rows, C, r] scale
    expansion), every float multiply is on query rows ([M, *], M = 16 padded rows) or a
    scalar / row vector (no [tokens, channels] tile is dequantized), and no integer becomes a
    float by conversion (codes are bitcast)."""
    cache = _cache(kind, 2, D, 1, jnp.bfloat16)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jnp.zeros((len(LENGTHS), 1, 4, D), jnp.bfloat16)
    outer = jax.make_jaxpr(lambda q, c, n: _run(q, c, n))(q, cache, lengths)
    calls = [e for e in _kernel_eqns(outer.jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    eqns = list(_kernel_eqns(calls[0].params["jaxpr"]))
    assert any(e.primitive.name == "dot_general" for e in eqns)
    for e in eqns:
        for v in e.outvars:
            shape = getattr(v.aval, "shape", ())
            assert len(shape) <= 2 or e.primitive.name in ("get", "swap"), (e, shape)
            floats = jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.floating)
            if e.primitive.name == "mul" and floats and len(shape) == 2:
                assert shape[0] in (1, 16), e
            if e.primitive.name == "convert_element_type" and floats:  # codes: bitcast only
                assert not jnp.issubdtype(e.invars[0].aval.dtype, jnp.integer), e


def test_triton_refuses_kivi_shapes_its_dots_cannot_take():
    assert triton_supported("int4", 128, 1024, 32) is None
    assert "group" in triton_supported("int4", 128, 1024, 8)
    assert "K >= 64" in triton_supported("int2", 32, 1024, 32)
    cache = _cache("int2", 1, 32, 0, jnp.float32)
    q = jnp.zeros((len(LENGTHS), 1, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match="triton decode attention does not support int2"):
        _run(q, cache, jnp.asarray(LENGTHS, jnp.int32), block_kv=32)
