"""Float weight codes: FP8 (E4M3) per output channel, W8A8-FP8, and OCP Microscaling MXFP4.

Both act on a weight of shape [*in, *out] viewed as a matrix [K, N]: K the contracted (input)
channels flattened row-major, N the output channels flattened.

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433). One float32
scale per output channel, s_n = max_k |W_kn| / 448 (448 the largest finite E4M3 value), and

    q_kn = E4M3(W_kn / s_n)   (round to nearest even, as ml_dtypes' cast),   W_kn ~ q_kn * s_n.

A column of zeros gets s = 1. One byte a weight plus 4 bytes a column. W8A8-FP8 quantizes each
token's activation row the same way at run time (s_x = max |x| / 448) and takes an E4M3 x E4M3
dot accumulated in float32, rescaled by s_x * s_w (`fp8_act_matmul`).

MXFP4 (OCP Microscaling Formats (MX) v1.0 Specification, 2023; Rouhani et al. 2023,
arXiv:2310.10537). The input channels are cut into blocks of 32; each block of a column shares
one E8M0 scale X = 2^e, stored as the uint8 biased exponent e + 127, with

    e = clamp(floor(log2(max |W|)) - 2, -127, 127)

(2 = emax of E2M1), and each element is the E2M1 value P = RNE(W / X) on the grid
±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, rounded to nearest with ties to the even code and saturating at
±6. An all-zero block has e = -127 (byte 0). An E2M1 code is 4 bits: sign (bit 3), exponent
(bits 2-1), mantissa (bit 0); its 3 low bits index the grid above. Two codes pack into a byte
along K, the first in the low nibble (gpt-oss's `blocks` layout): codes [K / 2, N], scales
[K / 32, N], 4.25 bits a weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0
MX_BLOCK = 32
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_EMAX = 2
E8M0_BIAS = 127


def fp8_quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(codes float8_e4m3fn [K, N], scales float32 [N]) of a weight [K, N] (module docstring)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
    s = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (w / s).astype(jnp.float8_e4m3fn), s[0]


def fp8_dequantize(q: jax.Array, s: jax.Array, dtype=jnp.float32) -> jax.Array:
    """W ~ q * s, in `dtype`."""
    return (q.astype(jnp.float32) * s[None, :]).astype(dtype)


def e2m1_index(v: jax.Array) -> jax.Array:
    """The grid index (0..7) of |v| rounded to the E2M1 grid, nearest with ties to the even
    index (the code whose mantissa bit is 0), saturating at 6."""
    a = jnp.abs(v)
    idx = jnp.zeros(a.shape, jnp.uint8)
    for i in range(len(E2M1_GRID) - 1):
        mid = (E2M1_GRID[i] + E2M1_GRID[i + 1]) / 2
        up = a >= mid if (i + 1) % 2 == 0 else a > mid  # a tie goes to the even index
        idx = idx + up.astype(jnp.uint8)
    return idx


def mxfp4_quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(codes uint8 [K / 2, N], scales uint8 [K / 32, N]) of a weight [K, N], K a multiple
    of 32 (module docstring)."""
    k, n = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs input channels in blocks of {MX_BLOCK}, got {k}")
    b = w.astype(jnp.float32).reshape(k // MX_BLOCK, MX_BLOCK, n)
    amax = jnp.max(jnp.abs(b), axis=1)
    safe = jnp.where(amax > 0, amax, 1.0)
    # floor(log2) exactly: frexp gives amax = m * 2^x with m in [0.5, 1), so floor(log2) = x - 1
    e = jnp.frexp(safe)[1] - 1 - E2M1_EMAX
    e = jnp.where(amax > 0, jnp.clip(e, -E8M0_BIAS, E8M0_BIAS), -E8M0_BIAS)
    v = b / jnp.ldexp(jnp.ones_like(amax), e)[:, None, :]
    # the sign from the weight itself: an all-zero block's X = 2^-127 may flush to zero, and
    # the sign of 0 / 0 is no sign of the weight (its codes are +0, as compressed-tensors packs)
    q = e2m1_index(v) | jnp.where(jnp.signbit(b), 8, 0).astype(jnp.uint8)
    q = q.reshape(k // 2, 2, n)
    codes = q[:, 0, :] | (q[:, 1, :] << 4)
    return codes.astype(jnp.uint8), (e + E8M0_BIAS).astype(jnp.uint8)


def mxfp4_dequantize(codes: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """W [K, N] from MXFP4 `codes` [K / 2, N] and E8M0 `scales` [K / 32, N], in `dtype`."""
    k2, n = codes.shape
    q = jnp.stack([codes & 0xF, codes >> 4], axis=1).reshape(2 * k2, n)
    mag = jnp.asarray(E2M1_GRID)[(q & 7).astype(jnp.int32)]
    val = jnp.where(q & 8, -mag, mag).reshape(-1, MX_BLOCK, n)
    x = jnp.ldexp(jnp.ones(scales.shape, jnp.float32), scales.astype(jnp.int32) - E8M0_BIAS)
    return (val * x[:, None, :]).reshape(2 * k2, n).astype(dtype)


def fp8_act_matmul(x: jax.Array, q_w: jax.Array, s_w: jax.Array, dtype=None) -> jax.Array:
    """W8A8-FP8: each token's row of `x` [..., K] in E4M3 with s_x = max_k |x_k| / 448 (a zero
    row s_x = 1), an E4M3 x E4M3 dot against `q_w` [K, N] accumulated in float32, rescaled by
    s_x * s_w (`s_w` [N] from `fp8_quantize`)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    s_x = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q_x = (xf / s_x).astype(jnp.float8_e4m3fn)
    acc = jnp.einsum("...k,kn->...n", q_x, q_w, preferred_element_type=jnp.float32)
    s_w = s_w.reshape((1,) * (acc.ndim - 1) + s_w.shape[-1:])
    return (acc * s_x * s_w).astype(dtype or x.dtype)
