"""The engine's linear-attention state: hybrid models (`model.layer_pattern` with `linear`).

A Gated DeltaNet layer carries a fixed-size state between tokens (`jaxllm.infer.linear_state`:
per layer, value heads of [K, V] float32 and the last W - 1 convolution inputs), not keys and
values per token, so it has no pages: each slot owns one slice of a `LinearState`
[N linear layers, slots, ...] kept beside the page pool of the full-attention layers. In the
step (`runner.step`):

- a slot that starts a sequence (its start is 0: a new request in a freed slot, or a
  preempted one recomputed from its tokens) has its slice zeroed first (`begin`);
- each slot's real tokens advance its slice (`CacheView.real_B`): a chunk's right padding and
  an idle slot leave it as it was, so a prompt fed in chunks carries the state from chunk to
  chunk and decode steps change the active slots only.

Prefix pages cannot stand in for the state (it sums every token before, not one page), so the
engine shares no prefix pages for a hybrid model. With `swap="host"` a preempted sequence's
slice is copied to host memory with its pages (`save`) and written into its new slot when it
resumes (`restore`); with recompute it starts from zero again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm import sharding
from jaxllm.infer import linear_state
from jaxllm.infer.linear_state import LinearState


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def empty_state(cfg, slots: int, parallel: sharding.Parallel) -> LinearState | None:
    """Zeros for every slot (None without linear layers); on a mesh made in its shards
    (slots over the data axes, value heads over `tensor`, as `linear_state.logical_axes`)."""
    if not linear_state.num_linear_layers(cfg):
        return None
    init = functools.partial(linear_state.init_linear_state, cfg, slots)
    if parallel.mesh is None:
        return init()
    axes = linear_state.logical_axes(jax.eval_shape(init))
    out = jax.tree.map(lambda ax: sharding.named(parallel.mesh, ax), axes, is_leaf=_is_axes)
    return jax.jit(init, out_shardings=out)()


def begin(linear: LinearState | None, start_S, real_S) -> LinearState | None:
    """`linear` with the slices of the slots that start a sequence this step zeroed."""
    if linear is None:
        return None
    fresh_S = (start_S == 0) & (real_S > 0)

    def reset(x):
        return jnp.where(fresh_S.reshape(1, -1, *(1,) * (x.ndim - 2)), jnp.zeros_like(x), x)

    return jax.tree.map(reset, linear)


def constrain(linear: LinearState | None) -> LinearState | None:
    if linear is None:
        return None
    axes = linear_state.logical_axes(linear)
    return jax.tree.map(lambda ax, x: sharding.constrain(x, ax), axes, linear, is_leaf=_is_axes)


@jax.jit
def _gather(linear: LinearState, slot):
    return jax.tree.map(lambda x: x[:, slot], linear)


@functools.partial(jax.jit, donate_argnames=("linear",))
def _scatter(linear: LinearState, saved: LinearState, slot):
    return jax.tree.map(lambda x, v: x.at[:, slot].set(v), linear, saved)


def save(linear: LinearState | None, slot: int) -> LinearState | None:
    """A host copy of `slot`'s slice (every linear layer); None without linear layers."""
    return None if linear is None else jax.device_get(_gather(linear, slot))


def restore(linear: LinearState | None, saved: LinearState | None, slot: int):
    """`linear` with `saved` (from `save`) written into `slot`."""
    return linear if linear is None else _scatter(linear, saved, slot)
