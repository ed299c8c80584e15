"""Inputs shared by the attention kernel tests: random q, k, v, dout and packed segment ids."""

import jax
import jax.numpy as jnp
import numpy as np


def inputs(b, l, s, h, g, k, dtype, seed=0):
    """q [B, L, H, K], k / v [B, S, G, K] and a cotangent of q's shape, standard normal."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, l, h, k), jnp.float32).astype(dtype)
    k_ = jax.random.normal(kk, (b, s, g, k), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, g, k), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (b, l, h, k), jnp.float32).astype(dtype)
    return q, k_, v, do


def packed_ids(b, length, cuts):
    """[B, L] segment ids with documents starting at `cuts` (shifted per batch row)."""
    pos = np.arange(length)
    ids = np.stack([np.searchsorted(np.asarray(cuts) + 3 * i, pos, side="right") for i in range(b)])
    return jnp.asarray(ids, jnp.int32)
