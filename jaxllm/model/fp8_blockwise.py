"""FP8 matmuls with DeepSeek-V3's fine-grained (blockwise) scaling (`model.fp8_scaling=blockwise`).

DeepSeek-V3 §3.3 (Liu et al. 2024): an activation gets one scale per 1x128 tile (per token, per
128 channels of the contracted dim), a weight one per 128x128 block, so one outlier spoils the
range of 128 values, not of the whole tensor. Every operand is float8_e4m3fn, in the forward and
in the backward (the paper's choice: with fine-grained scales e4m3's precision beats e5m2's
range), and every product is accumulated in float32 per tile, then multiplied by the tiles' two
scales and summed over the tiles in float32 (the paper's promotion to CUDA cores every 128
elements of the contraction).

The backward follows the paper too: dgrad (g W^T) quantizes the output gradient in 1x128 tiles
along the output channels and reuses the forward's e4m3 weight blocks (a 128x128 block is a
block of W^T too); wgrad (x^T g) contracts over tokens, so the activations, kept from the
forward in e4m3 with their 1x128 scales, are dequantized and quantized again in 128x1 tiles
(along tokens), as is the output gradient.

Choices:
- Scales are powers of two (`fp8.pow2_scale`: the smallest keeping the tile's amax within
  e4m3's 448), not DeepSeek's amax / 448: dividing and multiplying by them is exact, so the cast
  is the only rounding (and dequantized e4m3 values are exact in bfloat16); they are the e8m0
  scales of the MX formats. The cost is at most one binade of range at the small end, which
  within a 128-value tile is rarely used.
- Dims that are not multiples of 128 are padded with zeros (a zero changes no amax and adds
  nothing to a sum), and the output is sliced back: exact, at the price of the padding's compute.
- The matmul is written as a dot over the scaled tiles (the contracted dim reshaped to
  [K/128, 128], one dot per tile with float32 output, times the two scales, summed over tiles),
  which any XLA backend compiles. Unless XLA fuses the tile sum into the dot it writes the
  per-tile partial sums ([M, K/128, N] float32, 64 flops per byte): memory-bound where a fused
  kernel (DeepGEMM) keeps them in registers.

The einsum is brought to [batch, M, K] x [batch, K, N] (batch: indices of all three terms, as an
expert dim; M, K, N: the flattened free, contracted and output indices), so several contracted
dims (the attention output projection's heads and head dim) form one contracted dim K.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.model.fp8 import E4M3, pow2_scale

BLOCK = 128
_TOP = float(jnp.finfo(E4M3).max)


def _pad_to_block(a: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    pads = [(0, -a.shape[i] % BLOCK if i in axes else 0) for i in range(a.ndim)]
    return jnp.pad(a, pads) if any(p for _, p in pads) else a


def quantize_tiles(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q [..., C/128, 128] e4m3, scale [..., C/128] float32): one power-of-two scale per 128
    consecutive values of the last dim (zero-padded to a multiple of 128)."""
    a = _pad_to_block(a.astype(jnp.float32), (a.ndim - 1,))
    a = a.reshape(*a.shape[:-1], -1, BLOCK)
    s = pow2_scale(jnp.max(jnp.abs(a), axis=-1), _TOP)
    return jnp.clip(a / s[..., None], -_TOP, _TOP).astype(E4M3), s


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [G, R, C] -> (q [G, R/128, 128, C/128, 128] e4m3, scale [G, R/128, C/128]): one
    power-of-two scale per 128x128 block (zero-padded to multiples of 128)."""
    w = _pad_to_block(w.astype(jnp.float32), (1, 2))
    g, r, c = w.shape
    w = w.reshape(g, r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    s = pow2_scale(jnp.max(jnp.abs(w), axis=(2, 4)), _TOP)
    return jnp.clip(w / s[:, :, None, :, None], -_TOP, _TOP).astype(E4M3), s


def block_dot(qa, sa, qw, sw) -> jax.Array:
    """a [G, M, T, 128] in tiles (scales [G, M, T]) times w [G, T, 128, S, 128] in blocks
    (scales [G, T, S]) -> [G, M, S * 128] float32."""
    p = jnp.einsum("gmti,gtisj->gmtsj", qa, qw, preferred_element_type=jnp.float32)
    y = jnp.sum(p * sa[:, :, :, None, None] * sw[:, None, :, :, None], axis=2)
    return y.reshape(*y.shape[:2], -1)


def tile_dot(qa, sa, qb, sb) -> jax.Array:
    """a [G, M, T, 128] times b [G, N, T, 128], both in tiles along the contracted dim (scales
    [G, M, T], [G, N, T]) -> [G, M, N] float32."""
    p = jnp.einsum("gmti,gnti->gmtn", qa, qb, preferred_element_type=jnp.float32)
    return jnp.sum(p * sa[..., None] * jnp.swapaxes(sb, 1, 2)[:, None], axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul3(x_GxMxK: jax.Array, w_GxKxN: jax.Array, dtype) -> jax.Array:
    """Batched x w with blockwise e4m3 scaling, float32 output; gradients in `dtype`."""
    return _fwd(x_GxMxK, w_GxKxN, dtype)[0]


def _fwd(x, w, dtype):
    qx, sx = quantize_tiles(x)
    qw, sw = quantize_blocks(w)
    y = block_dot(qx, sx, qw, sw)[..., : w.shape[2]]
    # fp8 residuals (a byte per element) plus the float32 scales; the zero-size array carries K.
    return y, (qx, sx, qw, sw, jnp.zeros((0, x.shape[2]), dtype))


def _bwd(dtype, res, g):
    qx, sx, qw, sw, k_carrier = res
    k = k_carrier.shape[1]
    qg, sg = quantize_tiles(g)  # dgrad: 1x128 tiles along the output channels
    dx = block_dot(qg, sg, jnp.transpose(qw, (0, 3, 4, 1, 2)), jnp.swapaxes(sw, 1, 2))
    # wgrad contracts over tokens: both operands again in tiles of 128 tokens (128x1).
    x_hat = (qx.astype(jnp.float32) * sx[..., None]).reshape(*qx.shape[:2], -1)
    qxt, sxt = quantize_tiles(jnp.swapaxes(x_hat, 1, 2))
    qgt, sgt = quantize_tiles(jnp.swapaxes(g, 1, 2))
    dw = tile_dot(qxt, sxt, qgt, sgt)
    return dx[..., :k].astype(dtype), dw[:, :k].astype(dtype)


matmul3.defvjp(_fwd, _bwd)


def einsum(spec: str, x: jax.Array, kernel: jax.Array, dtype, out_dtype) -> jax.Array:
    """`jnp.einsum(spec, x, kernel)` through `matmul3` (`fp8.einsum`'s contract: every index in
    two of the three terms); `x` and `kernel` in `dtype`, the output in `out_dtype`."""
    ins, out = spec.split("->")
    lhs, rhs = ins.split(",")
    batch = [c for c in lhs if c in rhs and c in out]
    summed = [c for c in lhs if c in rhs and c not in out]
    free_x = [c for c in lhs if c not in rhs]
    free_k = [c for c in rhs if c not in lhs]
    size = dict(zip(lhs, x.shape)) | dict(zip(rhs, kernel.shape))

    def flat(a, letters, groups):
        a = jnp.transpose(a, [letters.index(c) for grp in groups for c in grp])
        return a.reshape([math.prod(size[c] for c in grp) for grp in groups])

    y = matmul3(
        flat(x, lhs, (batch, free_x, summed)), flat(kernel, rhs, (batch, summed, free_k)), dtype
    )
    order = batch + free_x + free_k
    y = y.reshape([size[c] for c in order])
    return jnp.transpose(y, [order.index(c) for c in out]).astype(out_dtype)
