"""Sparse fine-tuning: the zeros of a pruned model stay zero (`jaxllm prune`).

`keep_zeros(chosen)` is the last transformation of the chain: its state is the mask of the
chosen parameters' nonzero values as they were when the optimizer was initialised (the pruned
weights `checkpoint.init_from` loaded), and it zeroes every update outside it. A zero weight so
gets no step from the gradient, the moments or the weight decay, and stays exactly zero; the
mask is checkpointed with the optimizer state, so a resumed run keeps the same one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class KeepZerosState(NamedTuple):
    mask: Any  # per chosen parameter: bool, where it was nonzero; others a scalar True


def keep_zeros(chosen) -> optax.GradientTransformation:
    """Updates zeroed wherever a parameter `chosen` (a tree of bools shaped like the
    parameters) was zero at init (module docstring)."""

    def init(params):
        return KeepZerosState(
            jax.tree.map(lambda c, p: p != 0 if c else jnp.ones((), bool), chosen, params)
        )

    def update(updates, state, params=None):
        del params
        out = jax.tree.map(lambda u, m: jnp.where(m, u, jnp.zeros_like(u)), updates, state.mask)
        return out, state

    return optax.GradientTransformation(init, update)
