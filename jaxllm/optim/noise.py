"""Annealed Gaussian gradient noise (Neelakantan et al. 2015, "Adding Gradient Noise Improves
Learning for Very Deep Networks"): g_t + N(0, eta / (1 + t)^gamma), t counting from 0.

optax's `add_noise` does the same but keeps a typed key in its state; this one keeps the raw
key data, as the train state keeps its own rng, so checkpoints hold plain uint32 arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class NoiseState(NamedTuple):
    count: jax.Array  # steps taken
    rng: jax.Array  # raw key data of the next draw


def annealed_noise(eta: float, gamma: float, seed: int) -> optax.GradientTransformation:
    """Adds noise of variance eta / (1 + t)^gamma to every gradient leaf at step t."""

    def init(params):
        del params
        return NoiseState(jnp.zeros([], jnp.int32), jax.random.key_data(jax.random.key(seed)))

    def update(updates, state, params=None):
        del params
        count = state.count + 1
        std = jnp.sqrt(eta / count.astype(jnp.float32) ** gamma)
        rng, draw = jax.random.split(jax.random.wrap_key_data(state.rng))
        leaves, treedef = jax.tree.flatten(updates)
        keys = jax.random.split(draw, len(leaves))
        noisy = [
            u + (std * jax.random.normal(k, u.shape, jnp.float32)).astype(u.dtype)
            for u, k in zip(leaves, keys, strict=True)
        ]
        return treedef.unflatten(noisy), NoiseState(count, jax.random.key_data(rng))

    return optax.GradientTransformation(init, update)
