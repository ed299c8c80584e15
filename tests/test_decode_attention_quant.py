"""Decode-attention cache quantizers: int8 and KIVI int4 / int2 (keys per channel in token
groups, values per token in channel groups) round trips, code packing (int2 against a NumPy
re-derivation), bytes per cached token."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jaxllm.kernels.decode_attention import (
    cache_bytes_per_token,
    dequantize_int4_keys,
    dequantize_int4_values,
    dequantize_int8,
    dequantize_kivi_keys,
    dequantize_kivi_values,
    pack_codes,
    pack_int4,
    quantize_cache,
    quantize_int4_keys,
    quantize_int4_values,
    quantize_int8,
    quantize_kivi_keys,
    quantize_kivi_values,
    unpack_codes,
    unpack_int4,
)

GROUP = 32
f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731


def test_int8_round_trip_and_zero_vectors():
    x = jax.random.normal(jax.random.key(0), (4, 3, 64), jnp.float32) * 3.0
    x = x.at[1, 2].set(0.0)  # an all-zero vector: scale 0, decodes to exactly 0
    codes, scale = jax.jit(quantize_int8)(x)
    assert codes.dtype == jnp.int8 and scale.dtype == jnp.bfloat16 and scale.shape == (4, 3)
    err = np.abs(f32(x) - f32(dequantize_int8(codes, scale)))
    bound = f32(scale)[..., None] / 2 + 1e-6
    assert np.all(err <= bound)
    assert float(scale[1, 2]) == 0.0 and np.all(f32(dequantize_int8(codes, scale))[1, 2] == 0.0)
    assert np.max(np.abs(f32(codes))) == 127  # the max-magnitude entry uses the full range


def test_int4_packing_layout_and_round_trip():
    codes = jax.random.randint(jax.random.key(1), (2, 5, 64), 0, 16).astype(jnp.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 5, 32)
    np.testing.assert_array_equal(np.asarray(unpack_int4(packed)), np.asarray(codes))
    # byte i: channel 2i in the low nibble, channel 2i + 1 in the high nibble
    assert int(pack_int4(jnp.array([1, 2, 15, 0], jnp.uint8))[0]) == 0x21
    assert int(pack_int4(jnp.array([1, 2, 15, 0], jnp.uint8))[1]) == 0x0F


def _int4_bound(scale, zero):
    """Half a step, plus the bf16 rounding of zero and of the 15-step range."""
    s, z = f32(scale), f32(zero)
    return s / 2 + 2.0**-8 * (np.abs(z) + 15 * s) + 1e-6


def test_int4_keys_round_trip_per_channel_groups():
    k = jax.random.normal(jax.random.key(2), (2, 3, 128, 64), jnp.float32)
    k = k.at[0, 0, :GROUP].set(0.0).at[0, 1, GROUP : 2 * GROUP].set(1.5)  # zero / constant
    packed, scale, zero = jax.jit(quantize_int4_keys, static_argnums=1)(k, GROUP)
    assert packed.shape == (2, 3, 128, 32) and scale.shape == zero.shape == (2, 3, 4, 64)
    deq = jax.jit(dequantize_int4_keys, static_argnums=3)(packed, scale, zero, GROUP)
    bound = np.repeat(_int4_bound(scale, zero), GROUP, axis=-2)  # per (group, channel)
    assert np.all(np.abs(f32(k) - f32(deq)) <= bound)
    assert np.all(f32(deq)[0, 0, :GROUP] == 0.0) and float(scale[0, 0, 0, 0]) == 0.0
    np.testing.assert_allclose(f32(deq)[0, 1, GROUP : 2 * GROUP], 1.5)


@pytest.mark.parametrize("head_dim", [64, 16])  # 16 < group: one group per head
def test_int4_values_round_trip_per_token_groups(head_dim):
    v = jax.random.normal(jax.random.key(3), (2, 3, 40, head_dim), jnp.float32) * 2.0
    v = v.at[1, 1, 7].set(0.0)
    packed, scale, zero = jax.jit(quantize_int4_values, static_argnums=1)(v, GROUP)
    gv = min(GROUP, head_dim)
    assert packed.shape == (2, 3, 40, head_dim // 2) and scale.shape == (2, 3, 40, head_dim // gv)
    deq = jax.jit(dequantize_int4_values, static_argnums=3)(packed, scale, zero, GROUP)
    bound = np.repeat(_int4_bound(scale, zero), gv, axis=-1)
    assert np.all(np.abs(f32(v) - f32(deq)) <= bound)
    assert np.all(f32(deq)[1, 1, 7] == 0.0)


def test_bytes_per_token():
    assert cache_bytes_per_token("bfloat16", 8, 64) == 8 * 256
    assert cache_bytes_per_token("int8", 8, 64) == 8 * 132
    assert cache_bytes_per_token("int4", 8, 64, 32) == 8 * (64 + 8 + 8)
    assert cache_bytes_per_token("int2", 8, 64, 32) == 8 * (32 + 8 + 8)
    kv = jnp.zeros((1, 8, 64, 64))
    for kind in ("int4", "int2"):
        cache = jax.eval_shape(lambda kind=kind: quantize_cache(kv, kv, kind))
        assert cache.bytes_per_token() == cache_bytes_per_token(kind, 8, 64, 32)
    with pytest.raises(ValueError, match="latent"):
        cache_bytes_per_token("int2", 1, 64, 32, latent=True)


# ------------------------------------------------------------------------ int2 (KIVI-2)


def _np_int2(x, axis):
    """NumPy KIVI-2 of x over `axis`: codes 0..3 against the bf16-rounded zero and scale."""
    bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    zero = bf16(x.min(axis=axis, keepdims=True))
    scale = bf16((x.max(axis=axis, keepdims=True) - zero) / np.float32(3.0))
    q = np.where(scale == 0, 0.0, (x - zero) / np.where(scale == 0, 1.0, scale))
    return np.clip(np.round(q), 0, 3).astype(np.uint8), scale, zero


def _np_pack2(codes):
    """Four codes a byte: channel 4i + j at bits 2j .. 2j + 1 of byte i."""
    c = codes.astype(np.uint32)
    return (c[..., 0::4] | c[..., 1::4] << 2 | c[..., 2::4] << 4 | c[..., 3::4] << 6).astype(
        np.uint8
    )


def test_int2_packing_layout_and_round_trip():
    codes = jax.random.randint(jax.random.key(4), (2, 5, 64), 0, 4).astype(jnp.uint8)
    packed = pack_codes(codes, 2)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 5, 16)
    np.testing.assert_array_equal(np.asarray(packed), _np_pack2(np.asarray(codes)))
    np.testing.assert_array_equal(np.asarray(unpack_codes(packed, 2)), np.asarray(codes))
    assert int(pack_codes(jnp.array([1, 2, 3, 0], jnp.uint8), 2)[0]) == 0b00111001
    with pytest.raises(ValueError, match="divisible by 4"):
        pack_codes(jnp.zeros((6,), jnp.uint8), 2)


def test_int2_keys_and_values_match_numpy():
    """Codes, scales, zeros and dequantized values of KIVI-2 keys (per channel over 32-token
    groups) and values (per token over 32-channel groups) equal a NumPy re-derivation."""
    kk, kv = jax.random.split(jax.random.key(5))
    k = jax.random.normal(kk, (2, 3, 64, 64), jnp.float32) * 2.0
    k = k.at[0, 0, :GROUP].set(0.0)  # an all-zero group: scale 0, decodes to 0
    v = jax.random.normal(kv, (2, 3, 40, 64), jnp.float32)
    nk, nv = f32(k), f32(v)

    packed, scale, zero = jax.jit(quantize_kivi_keys, static_argnums=(1, 2))(k, GROUP, 2)
    codes, s, z = _np_int2(nk.reshape(2, 3, 2, GROUP, 64), axis=-2)
    assert packed.shape == (2, 3, 64, 16) and scale.shape == zero.shape == (2, 3, 2, 64)
    np.testing.assert_array_equal(np.asarray(packed), _np_pack2(codes.reshape(nk.shape)))
    np.testing.assert_array_equal(f32(scale), s[..., 0, :])
    np.testing.assert_array_equal(f32(zero), z[..., 0, :])
    deq = dequantize_kivi_keys(packed, scale, zero, GROUP, 2)
    np.testing.assert_allclose(f32(deq), (codes * s + z).reshape(nk.shape), rtol=1e-6)
    assert np.all(f32(deq)[0, 0, :GROUP] == 0.0)

    packed, scale, zero = jax.jit(quantize_kivi_values, static_argnums=(1, 2))(v, GROUP, 2)
    codes, s, z = _np_int2(nv.reshape(2, 3, 40, 2, GROUP), axis=-1)
    assert packed.shape == (2, 3, 40, 16) and scale.shape == (2, 3, 40, 2)
    np.testing.assert_array_equal(np.asarray(packed), _np_pack2(codes.reshape(nv.shape)))
    np.testing.assert_array_equal(f32(scale), s[..., 0])
    deq = dequantize_kivi_values(packed, scale, zero, GROUP, 2)
    np.testing.assert_allclose(f32(deq), (codes * s + z).reshape(nv.shape), rtol=1e-6)
    # within half a step plus the bf16 rounding of zero and of the 3-step range
    bound = np.repeat(f32(scale) / 2 + 2.0**-8 * (np.abs(f32(zero)) + 3 * f32(scale)), GROUP, -1)
    assert np.all(np.abs(nv - f32(deq)) <= bound + 1e-6)
