"""Blockwise 8-bit quantization of float arrays with a 256-value code book (bitsandbytes'
scheme): one uint8 code per element and one float32 absmax per block of up to `block_size`
elements along the last dim (a block never straddles rows), so codes and scales shard like the
array. The 8-bit optimizer (`jaxllm.optim.adamw_8bit`) keeps its moments this way, and
checkpoints store optimizer states this way (`jaxllm.checkpoint.quantized`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def dynamic_code(signed: bool) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: for each
    decade 10^-6 .. 10^0, evenly spaced fractions (more of them in the larger decades), plus 0
    and 1; 256 sorted values in [-1, 1] (signed) or [0, 1]."""
    data = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = np.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)
        data += list(means) + (list(-means) if signed else [])
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))  # the signed map has 255 values
    return np.sort(np.array(data, np.float32))


def linear_code(signed: bool) -> np.ndarray:
    """256 evenly spaced values over [-1, 1] (signed) or [0, 1]."""
    return np.linspace(-1.0 if signed else 0.0, 1.0, 256, dtype=np.float32)


def blocks_per_row(last: int, block_size: int) -> tuple[int, int]:
    """(blocks per row, elements per block) for a last dim of `last` elements."""
    size = min(last, block_size)
    return math.ceil(last / size), size


def quantize(x: jax.Array, code: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """x -> (uint8 codes, x's shape; float32 absmax per block, last dim counted in blocks)."""
    n, size = blocks_per_row(x.shape[-1], block_size)
    pad = n * size - x.shape[-1]
    xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], n, size)
    absmax = jnp.max(jnp.abs(xb), axis=-1)
    normed = xb / jnp.where(absmax == 0, 1.0, absmax)[..., None]
    # nearest code-book value: the insertion point or the value just below it
    hi = jnp.clip(jnp.searchsorted(code, normed), 1, code.shape[0] - 1)
    lo = hi - 1
    idx = jnp.where(jnp.abs(code[hi] - normed) < jnp.abs(normed - code[lo]), hi, lo)
    idx = idx.reshape(*x.shape[:-1], n * size)[..., : x.shape[-1]]
    return idx.astype(jnp.uint8), absmax


def dequantize(q: jax.Array, absmax: jax.Array, code: jax.Array, block_size: int) -> jax.Array:
    n, size = blocks_per_row(q.shape[-1], block_size)
    scale = jnp.repeat(absmax, size, axis=-1)[..., : q.shape[-1]]
    return code[q.astype(jnp.int32)] * scale
