"""AdamW with 8-bit moments, quantized blockwise (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"; the bitsandbytes scheme).

Each moment is stored as one uint8 code per element plus one float32 absmax per block: a
moment is divided by its block's absmax and mapped to the nearest of 256 code-book values; the
first moment uses a signed code book, the second (never negative) an unsigned one. That is
2 bytes per parameter plus 8 / block bytes of scales, against AdamW's 8. Each step dequantizes,
takes the AdamW step in float32 and quantizes again.

Blocks are runs of up to `block_size` elements along the last dim, never straddling rows (a
row shorter than a block is one block). For a last dim that is a multiple of the block size
this is bitsandbytes' blocking of the flattened tensor; in general it keeps the codes in the
parameter's shape and the scales in its shape with the last dim counted in blocks, so both
shard like the parameter (`jaxllm.train.state.state_shardings`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


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


class Adam8bitState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken, for bias correction
    mu: optax.Params  # uint8 codes of the first moment (signed code book)
    mu_scale: optax.Params  # float32 absmax per block
    nu: optax.Params  # uint8 codes of the second moment (unsigned code book)
    nu_scale: optax.Params


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    block_size: int = 2048,
    quantization: str = "dynamic",
) -> optax.GradientTransformation:
    """The Adam direction m_hat / (sqrt(v_hat) + eps) with m and v kept in 8 bits."""
    make = dynamic_code if quantization == "dynamic" else linear_code
    signed, unsigned = jnp.asarray(make(True)), jnp.asarray(make(False))

    def init(params):
        def zeros(p):
            n, _ = blocks_per_row(p.shape[-1], block_size)
            # code of 0.0: the value closest to 0 in each code book
            return jnp.zeros(p.shape[:-1] + (n,), jnp.float32)

        mu = jax.tree.map(
            lambda p: jnp.full(p.shape, jnp.argmin(jnp.abs(signed)), jnp.uint8), params
        )
        nu = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.uint8), params)
        scales = jax.tree.map(zeros, params)
        return Adam8bitState(jnp.zeros((), jnp.int32), mu, scales, nu, scales)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def one(g, mq, ms, vq, vs):
            g = g.astype(jnp.float32)
            m = b1 * dequantize(mq, ms, signed, block_size) + (1 - b1) * g
            v = b2 * dequantize(vq, vs, unsigned, block_size) + (1 - b2) * jnp.square(g)
            out = (m / c1) / (jnp.sqrt(v / c2) + eps)
            return (out, *quantize(m, signed, block_size), *quantize(v, unsigned, block_size))

        res = jax.tree.map(one, updates, state.mu, state.mu_scale, state.nu, state.nu_scale)
        tdef = jax.tree.structure(updates)
        out, mq, ms, vq, vs = (
            jax.tree.unflatten(tdef, [r[i] for r in tdef.flatten_up_to(res)]) for i in range(5)
        )
        return out, Adam8bitState(count, mq, ms, vq, vs)

    return optax.GradientTransformation(init, update)
