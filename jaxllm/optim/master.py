"""Master weights: the optimizer steps a float32 copy of low-precision parameters.

With `model.param_dtype=bfloat16` the parameters (and so the gradients) are stored in
bfloat16. An update smaller than half a bfloat16 step of its weight (2^-9 relative) would round
away, so a long run at a small learning rate stops moving. `optim.master_weights=float32`
wraps the optimizer: its state holds a float32 master copy, the optimizer (and its moments)
works on the master, and the update it returns takes each stored parameter to its master
rounded to the parameter's dtype. This is the mixed-precision recipe the seeds' "16 bytes per
parameter" counts: 2 (weights) + 2 (gradients) + 4 (master) + 8 (Adam's moments). Being
optimizer state, the master is sharded like its parameter, checkpointed, and kept in host
memory with `optim.offload=host`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterWeightsState(NamedTuple):
    master: optax.Params
    inner: optax.OptState


def with_master_weights(
    inner: optax.GradientTransformation, dtype=jnp.float32
) -> optax.GradientTransformation:
    """`inner` run on a `dtype` copy of the parameters, kept in the state."""

    def init(params):
        master = jax.tree.map(lambda p: p.astype(dtype), params)
        return MasterWeightsState(master, inner.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("with_master_weights needs the parameters in update()")
        grads = jax.tree.map(lambda g: g.astype(dtype), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # what takes each stored parameter exactly to its master, rounded to its dtype (the
        # difference of two values of the narrower dtype is exact in `dtype`)
        to_master = jax.tree.map(
            lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype), master, params
        )
        return to_master, MasterWeightsState(master, inner_state)

    return optax.GradientTransformation(init, update)
