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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllm.blockwise import blocks_per_row, dequantize, dynamic_code, linear_code, quantize


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
