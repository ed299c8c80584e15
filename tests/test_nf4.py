"""NF4 storage (`jaxllm.model.nf4`): the code books, agreement with bitsandbytes and with a numpy
quantizer, the round trip, the layout and its sharding.

References: bitsandbytes (`quantize_4bit` / `dequantize_4bit` with quant_type "nf4",
blocksize 64, compress_statistics=True; tests marked `torch`, left out by --without-torch where it does not
install), and without it a numpy quantizer here (nearest code by argmin, float64) built on the
code book re-derived from normal quantiles. bitsandbytes' CPU kernel picks an 8-bit absmax code
from a 65536-entry table, so for about 0.15% of the absmax values (those within ~1.5e-5 of a
midpoint) it takes a neighbour of the nearest code; the bitsandbytes test checks that those
are the only differences. For N(0, 1) weights both give a mean absolute error of ~0.073."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.model import nf4

# QLoRA, Appendix E ("NormalFloat 4-bit data type").
PAPER_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
SHAPES = [(64, 4, 32), (4, 64, 96), (96, 320)]  # [D, H, K]-like, an expert stack, a kernel
LUT_STEP = 2 / 65535  # the resolution of bitsandbytes' CPU code-lookup table


def _normal(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _np_nf4(x: np.ndarray, code4: np.ndarray, code8: np.ndarray):
    """Reference: (4-bit indices, 8-bit absmax indices, dequantized) of x, flattened, in
    float64 with argmin rounding and the 64 / 256 blocks of the flattened tensor."""
    x_Nx64 = x.astype(np.float64).reshape(-1, 64)
    absmax = np.abs(x_Nx64).max(axis=1)
    idx4 = np.abs(x_Nx64[:, :, None] / absmax[:, None, None] - code4).argmin(-1)
    centred = absmax - absmax.mean()
    blocks = np.pad(centred, (0, -len(centred) % 256)).reshape(-1, 256)
    scale = np.abs(blocks).max(axis=1)
    idx8 = np.abs(blocks[:, :, None] / scale[:, None, None] - code8).argmin(-1).reshape(-1)
    idx8 = idx8[: len(absmax)]
    absmax_dq = code8[idx8] * np.repeat(scale, 256)[: len(absmax)] + absmax.mean()
    return idx4.reshape(-1), idx8, (code4[idx4] * absmax_dq[:, None]).reshape(-1)


def _indices(q: nf4.NF4Tensor) -> np.ndarray:
    """The 4-bit indices of q, flattened (high nibble first)."""
    codes = np.asarray(q.codes).reshape(-1)
    return np.stack([codes >> 4, codes & 15], axis=-1).reshape(-1)


# ---------------------------------------------------------------------------------- code books


def test_nf4_code_is_the_papers_and_the_normal_quantiles():
    np.testing.assert_array_equal(nf4.NF4_CODE, np.array(PAPER_NF4, np.float32))
    derived = nf4.nf4_code_from_normal_quantiles()
    np.testing.assert_allclose(derived, PAPER_NF4, rtol=0, atol=1e-6)
    assert (derived > 0).sum() == 8 and (derived < 0).sum() == 7 and derived[7] == 0.0
    assert derived[0] == -1.0 and derived[-1] == 1.0


def test_dynamic_code_structure():
    """Signed dynamic map: 7 decades of 1, 2, 4, .. 64 evenly split values of each sign,
    mirrored, plus 0 and 1 (bitsandbytes `create_dynamic_map(signed=True)`)."""
    code = nf4.DYNAMIC_CODE
    assert code.shape == (256,) and code.dtype == np.float32 and np.all(np.diff(code) > 0)
    assert code[127] == 0.0 and code[-1] == 1.0
    np.testing.assert_array_equal(code[:127], -code[128:255][::-1])
    positive = code[128:255]
    for i in range(7):
        top = 10.0 ** (i - 6)
        in_decade = positive[(positive > top / 10) & (positive < top)]
        assert len(in_decade) == 2**i, (i, in_decade)
        bounds = np.linspace(0.1, 1.0, 2**i + 1)
        np.testing.assert_allclose(in_decade, top * (bounds[:-1] + bounds[1:]) / 2, rtol=1e-6)


@pytest.mark.torch
def test_code_books_equal_bitsandbytes():
    from bitsandbytes import functional  # the `torch` extra; --without-torch leaves it out

    bnb_nf4 = functional.get_4bit_type("nf4", device="cpu").numpy()
    np.testing.assert_array_equal(nf4.NF4_CODE, bnb_nf4)
    # bitsandbytes builds the map with float32 torch.linspace, whose boundaries can be off by
    # an ulp (on the machine this was written on, 22 of 256 values, by up to 1.3e-7 of one).
    bnb_dynamic = functional.create_dynamic_map(signed=True).numpy()
    np.testing.assert_allclose(nf4.DYNAMIC_CODE, bnb_dynamic, rtol=2e-7, atol=0)


# ------------------------------------------------------------------------------- references


def _bnb_dequantize(packed, state, shape):
    """bitsandbytes' dequantization of its own NF4 tensor. Its native CPU kernel (on AVX-512
    hosts) cuts 64-blocks along each row of the last dimension, which disagrees with its
    quantize's blocks of the flat tensor when that dimension is not a multiple of 64, so those
    shapes go through its generic path, which blocks the flat tensor as quantize does."""
    import torch
    from bitsandbytes import functional

    if shape[-1] % 64 == 0:
        return functional.dequantize_4bit(packed, state, quant_type="nf4").numpy()
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    absmax = functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    code = _get_4bit_code("nf4", packed.device)
    flat = packed.reshape(-1)
    return _dequantize_4bit_compute(flat, absmax, code, 64, shape, torch.float32).numpy()


@pytest.mark.torch
@pytest.mark.parametrize("shape", SHAPES + [(1024, 1024)], ids=str)
def test_matches_bitsandbytes(shape):
    import torch
    from bitsandbytes import functional

    x = _normal(shape)
    q = jax.jit(nf4.quantize)(jnp.asarray(x))
    y = np.asarray(jax.jit(nf4.dequantize)(q))
    packed, state = functional.quantize_4bit(
        torch.from_numpy(x), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    y_bnb = _bnb_dequantize(packed, state, shape)
    assert y.shape == y_bnb.shape == shape

    # Same 64-blocks and absmax, same 4-bit codes and nibble order.
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_allclose(float(q.absmax_offset), state.offset.item(), rtol=1e-6)
    np.testing.assert_allclose(q.absmax_scale, state.state2.absmax.numpy(), rtol=1e-6)

    # 8-bit absmax codes: ours is the nearest; where bitsandbytes' table picked another, that
    # one is no farther from the value than the table's resolution.
    ours = np.asarray(q.absmax_codes).reshape(-1).astype(int)
    theirs = state.absmax.numpy().astype(int)
    differ = ours != theirs
    assert differ.mean() < 0.005, differ.mean()
    scale = np.repeat(np.asarray(q.absmax_scale), 256)[: len(ours)]
    absmax = np.abs(x.reshape(-1, 64)).max(axis=1)
    normed = (absmax - float(q.absmax_offset)) / scale
    d_ours = np.abs(normed - nf4.DYNAMIC_CODE[ours])
    d_theirs = np.abs(normed - nf4.DYNAMIC_CODE[theirs])
    assert np.all(d_ours <= d_theirs + 1e-7)
    assert np.all(d_theirs[differ] - d_ours[differ] <= LUT_STEP)

    # Dequantized: equal to float32 rounding where the absmax codes agree; the same error.
    same = ~np.repeat(differ, 64)
    np.testing.assert_allclose(y.reshape(-1)[same], y_bnb.reshape(-1)[same], rtol=0, atol=1e-6)
    mae, mae_bnb = np.abs(y - x).mean(), np.abs(y_bnb - x).mean()
    assert abs(mae - mae_bnb) <= 0.01 * mae_bnb, (mae, mae_bnb)

    # bitsandbytes' own codes dequantized here: the same formula, to float32 rounding.
    lead = shape[: nf4.kept_ndim(shape)]
    q_bnb = nf4.NF4Tensor(
        codes=jnp.asarray(packed.numpy().reshape(q.codes.shape)),
        absmax_codes=jnp.asarray(state.absmax.numpy().reshape(*lead, -1)),
        absmax_scale=jnp.asarray(state.state2.absmax.numpy()),
        absmax_offset=jnp.asarray(state.offset.numpy()),
        shape=shape,
        dtype=np.dtype(np.float32),
    )
    np.testing.assert_allclose(np.asarray(nf4.dequantize(q_bnb)), y_bnb, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_numpy_reference(shape):
    x = _normal(shape, seed=1)
    q = jax.jit(nf4.quantize)(jnp.asarray(x))
    y = np.asarray(jax.jit(nf4.dequantize, static_argnums=1)(q, jnp.float32)).reshape(-1)
    idx4, idx8, y_ref = _np_nf4(
        x, nf4.nf4_code_from_normal_quantiles(), nf4.DYNAMIC_CODE.astype(np.float64)
    )
    np.testing.assert_array_equal(_indices(q), idx4)
    np.testing.assert_array_equal(np.asarray(q.absmax_codes).reshape(-1), idx8)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-6)
    mae, mae_ref = np.abs(y - x.reshape(-1)).mean(), np.abs(y_ref - x.reshape(-1)).mean()
    assert abs(mae - mae_ref) <= 0.01 * mae_ref and 0.070 < mae < 0.076, (mae, mae_ref)
    # The double quantization costs little: the absmax is off by well under one 4-bit step.
    absmax = np.abs(x.reshape(-1, 64)).max(axis=1)
    absmax_dq = np.asarray(nf4.dequantize_absmax(q)).reshape(-1)
    assert np.abs(absmax_dq / absmax - 1).max() < 0.01


# ---------------------------------------------------------------------------- round trip, layout


def test_round_trip_jit_and_bytes():
    x = jnp.asarray(_normal((4, 64, 96)), jnp.bfloat16)
    q = nf4.quantize(x)
    assert q.shape == (4, 64, 96) and q.dtype == jnp.bfloat16 and q.size == x.size
    assert q.codes.shape == (4, 3072) and q.codes.dtype == jnp.uint8
    assert q.absmax_codes.shape == (4, 96) and q.absmax_codes.dtype == jnp.uint8
    assert q.absmax_scale.shape == (2,) and q.absmax_offset.shape == ()
    y = nf4.dequantize(q)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert nf4.dequantize(q, np.dtype(np.float32)).dtype == jnp.float32

    q_jit = jax.jit(nf4.quantize)(x)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(q_jit)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.jit(nf4.dequantize)(q_jit), y)

    assert q.nbytes == sum(leaf.nbytes for leaf in jax.tree.leaves(q))
    assert q.nbytes / q.size < 0.52
    big = jax.eval_shape(nf4.quantize, jax.ShapeDtypeStruct((4096, 11008), jnp.bfloat16))
    assert big.codes.shape == (4096, 5504) and big.absmax_codes.shape == (4096, 172)
    assert abs(big.nbytes / big.size - (0.5 + 1 / 64 + 4 / (64 * 256))) < 1e-6


def test_exact_values_round_trip():
    """Values that are codes times a shared absmax come back exactly: every absmax equals the
    offset (the zero-scale blocks of the double quantization stay finite) and each value is
    its own nearest code. All-zero tensors give zeros."""
    perm = np.random.default_rng(2).permuted(np.tile(nf4.NF4_CODE, (32, 4)), axis=1)
    x = jnp.asarray(0.75 * perm)
    q = jax.jit(nf4.quantize)(x)
    np.testing.assert_array_equal(jax.jit(nf4.dequantize)(q), x)
    assert float(q.absmax_offset) == 0.75 and np.all(np.asarray(q.absmax_scale) == 0)
    zeros = jnp.zeros((2, 128), jnp.bfloat16)
    np.testing.assert_array_equal(jax.jit(nf4.dequantize)(jax.jit(nf4.quantize)(zeros)), zeros)


def test_layout_and_axes():
    assert nf4.kept_ndim((4096, 11008)) == 1  # a kernel: rows kept
    assert nf4.kept_ndim((64, 4, 32)) == 1  # [D, H, K]: H * K = 128 blocked
    assert nf4.kept_ndim((8, 96, 2, 48)) == 1  # 2 * 48 = 96 is no multiple, 96 * 96 is
    assert nf4.kept_ndim((8, 5, 2, 32)) == 2
    assert nf4.kept_ndim((1024,)) == 0
    assert nf4.nf4_axes(("experts", "embed", "mlp"), (4, 64, 96)) == ("experts", None)
    assert nf4.nf4_axes(("embed", "mlp"), (4096, 11008)) == ("embed", None)
    assert nf4.nf4_nbytes((1024, 1024)) == 2**19 + 2**14 + 4 * 64 + 4
    assert nf4.nf4_nbytes((3, 64)) == 96 + 3 + 4 + 4  # one padded 256-block


@pytest.mark.parametrize("shape", [(3, 5, 7), (100,), (), (48, 2)], ids=str)
def test_impossible_shape_raises(shape):
    with pytest.raises(ValueError, match="64-value blocks"):
        nf4.quantize(jnp.ones(shape))
    with pytest.raises(ValueError, match="64-value blocks"):
        nf4.nf4_axes((None,) * len(shape), shape)


def test_sharded_dequantize_is_shard_local():
    """Codes sharded along their kept leading dim dequantize on each device without
    communication, to the same values as on one device."""
    shape = (64, 4, 32)
    q = nf4.quantize(jnp.asarray(_normal(shape, seed=3)))
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x", None))
    replicated = NamedSharding(mesh, PartitionSpec())
    q_sharded = jax.device_put(
        q, nf4.NF4Tensor(rows, rows, replicated, replicated, q.shape, q.dtype)
    )
    out = NamedSharding(mesh, PartitionSpec("x", None, None))
    fn = jax.jit(nf4.dequantize, out_shardings=out)
    hlo = fn.lower(q_sharded).compile().as_text()
    collectives = ("all-gather", "all-to-all", "collective-permute", "all-reduce")
    assert not any(op in hlo for op in collectives)  # flattening the absmax would permute
    y = fn(q_sharded)
    np.testing.assert_array_equal(y, jax.jit(nf4.dequantize)(q))
    assert y.sharding.is_equivalent_to(out, 3)
    assert math.prod(y.addressable_shards[0].data.shape) == math.prod(shape) // 8
