"""Round-to-nearest against a NumPy re-derivation (and Qwix's rounding), and the packed
format's sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quantize import np_dequantize, np_rtn

from jaxllm.model import quantized


def np_pack(q, bits, axis):
    """Codes as a little-endian bit stream along `axis`, b bits each, in bytes."""
    q = np.moveaxis(q, axis, -1)
    stream = ((q[..., None] >> np.arange(bits)) & 1).astype(np.uint8)
    packed = np.packbits(stream.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")
    return np.moveaxis(packed, -1, axis)


SHAPES = {  # name -> (shape, contracted dims, output dims)
    "mlp": ((2, 64, 24), 1, 1),  # a stacked [layers, in, out]
    "o_proj": ((2, 4, 16, 24), 2, 1),  # [layers, heads, head_dim, out]: groups span heads
}


@pytest.mark.parametrize("group, shape", [(0, "mlp"), (32, "mlp"), (32, "o_proj")])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_rtn_matches_numpy(bits, symmetric, group, shape):
    shape, n_in, n_out = SHAPES[shape]
    w = np.random.default_rng(bits).normal(0, 0.05, shape).astype(np.float32)
    w[0, 0] = 0.0  # an all-zero channel has scale 1 and code z
    t = jax.jit(
        lambda w: quantized.quantize(
            w, bits=bits, group=group, symmetric=symmetric, n_in=n_in, n_out=n_out
        )
    )(w)
    q, s, z = np_rtn(w, bits, group, symmetric, n_in, n_out)
    lead = len(shape) - n_in - n_out
    np.testing.assert_array_equal(np.asarray(t.codes), np_pack(q, bits, lead + n_in - 1))
    assert t.codes.nbytes * 8 == w.size * bits
    np.testing.assert_array_equal(np.asarray(t.scales), s.squeeze(lead + 1))
    if symmetric:
        assert t.zeros is None
    else:
        np.testing.assert_array_equal(np.asarray(t.zeros), z.squeeze(lead + 1))
    deq = np.asarray(quantized.dequantize(t))
    np.testing.assert_array_equal(deq, np_dequantize(q, s, z, n_in, n_out))
    step = np_dequantize(np.ones_like(q), s, np.zeros_like(z), n_in, n_out)  # s per value
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-4))  # half a step, float32 rounding
    assert t.shape == shape


@pytest.mark.parametrize("bits, group", [(8, 0), (4, 32), (3, 16), (2, 32)])
def test_rtn_symmetric_codes_are_qwix_codes(bits, group):
    """Qwix (the JAX quantization library) rounds symmetric integers with the same bound,
    absmax / (qmax + 1/2): its codes are ours minus the offset 2^(b-1)."""
    from qwix._src.core import qarray  # test-core installs qwix: a missing one fails

    w = np.random.default_rng(1).normal(0, 0.05, (64, 24)).astype(np.float32)
    qtype = {8: jnp.int8, 4: jnp.int4}.get(bits, f"int{bits}")
    how = qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=(1,), tiled_axes={0: group} if group else {}
    )
    theirs = qarray.quantize(jnp.asarray(w), how)
    ours = quantized.quantize(w, bits=bits, group=group, symmetric=True, n_in=1, n_out=1)
    codes = np.asarray(quantized._unpack(ours.codes, bits, 0)).astype(np.int32)
    np.testing.assert_array_equal(codes - 2 ** (bits - 1), np.asarray(theirs.qvalue, np.int32))
    np.testing.assert_allclose(
        np.asarray(ours.scales), np.asarray(theirs.scale).reshape(ours.scales.shape), rtol=1e-6
    )


@pytest.mark.parametrize(
    "bits, group, symmetric, per_value",
    [
        (8, 0, True, 1),
        (4, 32, True, 0.5),
        (4, 32, False, 0.5),
        (3, 64, True, 3 / 8),
        (2, 0, True, 1 / 4),
    ],
)
def test_packed_sizes(bits, group, symmetric, per_value):
    """Codes take bits / 8 bytes a value; each group adds a bfloat16 scale (and a uint8 zero
    point when asymmetric)."""
    shape, k, out = (512, 256), 512, 256
    groups = k // (group or k)
    want = int(k * out * per_value) + groups * out * (2 + (0 if symmetric else 1))
    how = dict(bits=bits, group=group, symmetric=symmetric, n_in=1, n_out=1)
    t = quantized.quantize(jnp.ones(shape, jnp.bfloat16), **how)
    assert t.nbytes == want == quantized.packed_nbytes(shape, jnp.bfloat16, **how)
