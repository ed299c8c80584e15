"""Frozen parameters (`train.freeze`): the optimizer sees only the others.

`trainable_only(tx, mask)` runs `tx` on the parameters whose mask is False, as if the frozen
ones did not exist (no state, no weight decay, no part in the global norm of clipping), and
gives the frozen ones an update of -0.0, which leaves every float bit-identical (x + -0.0 is x,
signed zeros too). `select` prunes a tree (logical axes, a sparsity mask) the same way, so the
optimizers that read such trees see matching structures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def select(tree, mask):
    """`tree` (nested dicts like the parameters) without the leaves `mask` marks frozen, and
    without dicts left empty."""
    if not isinstance(mask, dict):
        return tree
    out = {}
    for k, m in mask.items():
        if isinstance(m, dict):
            sub = select(tree[k], m)
            if sub:
                out[k] = sub
        elif not m:
            out[k] = tree[k]
    return out


def _fill(sub, full, mask):
    """The full tree of updates: `sub`'s where they exist, -0.0 for the frozen leaves."""
    if isinstance(mask, dict):
        return {k: _fill(sub.get(k, {}) if sub else {}, full[k], m) for k, m in mask.items()}
    return jnp.full_like(full, -0.0) if mask else sub


def stop_frozen(params, mask):
    """`params` with the frozen leaves behind `stop_gradient`: their gradients are zeros, and
    the backward pass never computes them."""
    if mask is None:
        return params
    return jax.tree.map(lambda p, m: jax.lax.stop_gradient(p) if m else p, params, mask)


def trainable_only(tx: optax.GradientTransformation, mask) -> optax.GradientTransformation:
    """`tx` over the parameters `mask` leaves trainable (see the module docstring)."""

    def init(params):
        return tx.init(select(params, mask))

    def update(updates, state, params=None):
        sub_params = None if params is None else select(params, mask)
        sub, state = tx.update(select(updates, mask), state, sub_params)
        return _fill(sub, updates, mask), state

    return optax.GradientTransformation(init, update)
