"""The ground truth of the int4 weight-only matmul, in plain jnp.

Layout (that of `jaxllm.model.quantized.QuantizedTensor` for a 2-D weight [K, N] at 4 bits):
- codes_PxN uint8 [K / 2, N]: code k of column n in the low nibble of byte k // 2 when k is
  even, the high nibble when odd; codes are unsigned, q in [0, 15];
- scales_GxN [K / group, N] (G = 1: one scale per output channel), in any float dtype;
- zeros_GxN uint8 like scales, or None for symmetric codes (offset binary, z = 8).
w[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n], computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SYMMETRIC_ZERO = 8  # offset binary: signed code c is stored as c + 8


def unpack_codes(codes_PxN: jax.Array) -> jax.Array:
    """uint8 [K / 2, N] -> the codes [K, N] as int32, low nibble first."""
    c = codes_PxN.astype(jnp.int32)
    lo, hi = c & 0xF, c >> 4
    return jnp.stack([lo, hi], axis=1).reshape(-1, c.shape[-1])


def dequantize_int4(codes_PxN, scales_GxN, zeros_GxN=None) -> jax.Array:
    """The float32 weight [K, N] the packed codes stand for."""
    q = unpack_codes(codes_PxN).astype(jnp.float32)
    k, g = q.shape[0], scales_GxN.shape[0]
    z = SYMMETRIC_ZERO if zeros_GxN is None else zeros_GxN.astype(jnp.float32)
    z = jnp.broadcast_to(z, scales_GxN.shape)
    q = q.reshape(g, k // g, -1)
    w = (q - z[:, None]) * scales_GxN.astype(jnp.float32)[:, None]
    return w.reshape(k, -1)


def int4_matmul_reference(x_MxK, codes_PxN, scales_GxN, zeros_GxN=None, out_dtype=None):
    """x [M, K] @ the dequantized weight, both in x's dtype, accumulated in float32."""
    w = dequantize_int4(codes_PxN, scales_GxN, zeros_GxN).astype(x_MxK.dtype)
    y = jnp.dot(x_MxK, w, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x_MxK.dtype)
