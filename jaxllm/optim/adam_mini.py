"""Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More").

Adam keeps one second moment per parameter; Adam-mini keeps one per *block*, the mean of g^2
over the block, so the second moment costs almost nothing and the state is about 4 bytes per
parameter (the first moment). The paper's blocks are the Hessian's near-diagonal blocks: one
per attention head for the attention projections, one per token for embeddings and the LM
head, one per output neuron for the other matrices. Here they come from the parameter's logical
axis names (`block_dims`), so no parameter path is hard-coded.

The second moment keeps the parameter's rank with the averaged dims set to 1, so it shards like
its parameter on the kept dims (`jaxllm.train.state.state_shardings`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# Axes that index separate matrices (stacked layers, experts): always their own blocks.
STACKED = ("layers", "expert")
# Axes whose entries are blocks of their own, in order of preference.
BLOCK_AXES = ("vocab", "heads", "kv_heads")


def block_dims(axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """Dims of a parameter with these logical axes that index Adam-mini blocks (the others are
    averaged): stacked axes always; then the token axis (embeddings, LM head), else the head
    axis (attention projections), else the last (output) dim of any other matrix. A vector
    (norm scale, bias) is one block per stacked entry."""
    keep = [i for i, a in enumerate(axes) if a in STACKED]
    inner = [i for i, a in enumerate(axes) if a not in STACKED]
    for name in BLOCK_AXES:
        if name in axes:
            return tuple(sorted(keep + [axes.index(name)]))
    if len(inner) >= 2:
        keep.append(inner[-1])
    return tuple(sorted(keep))


class AdamMiniState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken, for bias correction
    mu: optax.Params  # first moment, the parameter's shape
    nu: optax.Params  # one second moment per block: the parameter's shape, averaged dims 1


def scale_by_adam_mini(
    axes, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8
) -> optax.GradientTransformation:
    """The Adam-mini direction m_hat / (sqrt(v_hat) + eps), v a per-block mean of g^2.

    `axes`: a tree like the parameters of logical-axis tuples (`jaxllm.model.abstract_model`)."""

    def reduced(axes_leaf):
        keep = block_dims(axes_leaf)
        return tuple(i for i in range(len(axes_leaf)) if i not in keep)

    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731

    def block_mean_sq(g, ax):
        return jnp.mean(jnp.square(g), axis=reduced(ax), keepdims=True)

    def init(params):
        nu = jax.tree.map(
            lambda ax, p: jnp.zeros_like(block_mean_sq(p, ax)), axes, params, is_leaf=is_axes
        )
        return AdamMiniState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params), nu)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(
            lambda ax, v, g: b2 * v + (1 - b2) * block_mean_sq(g, ax),
            axes,
            state.nu,
            updates,
            is_leaf=is_axes,
        )
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)
        out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return out, AdamMiniState(count, mu, nu)

    return optax.GradientTransformation(init, update)
