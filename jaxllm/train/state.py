"""TrainState and its sharded initialisation.

Initialisation never builds the model on one device: `jax.eval_shape` gives the abstract
parameters and their logical axes, `jaxllm.sharding` turns those into shardings, and one
`jax.jit(init, out_shardings=...)` creates every leaf directly in its shards.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm import sharding
from jaxllm.config import ModelConfig
from jaxllm.model import Transformer, abstract_model, abstract_model_state


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # nested dict of arrays, paths like layers/attn/q_proj
    opt_state: Any  # optax state over params
    rng: jax.Array  # uint32 key data, for dropout and other randomness in the step
    # Model variables that are not trained by gradients (MoE router balancing biases), moved
    # by the step itself; a nested dict like params, {} for most models.
    model_state: Any
    # The dynamic loss scale (`jaxllm.train.loss_scale.LossScaleState`), moved by the step;
    # None when the loss is not scaled or the scale is static.
    loss_scale: Any = None


def _init(
    model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, loss_scale=None
) -> TrainState:
    init_key, state_key = jax.random.split(jax.random.key(seed))
    model = Transformer(model_cfg, rngs=nnx.Rngs(params=init_key))
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        rng=jax.random.key_data(state_key),
        model_state=nnx.to_pure_dict(model_state),
        loss_scale=loss_scale,
    )


def state_shardings(
    model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, loss_scaling=None
):
    """NamedShardings of every TrainState leaf: params, their optimizer moments and the model
    state by the logical rules, scalars (the loss scale of `loss_scaling` among them)
    replicated."""
    _, abstract_params, axes = abstract_model(model_cfg)
    sharding.check_divisible(mesh, abstract_params, axes)
    param_sh = sharding.tree_shardings(mesh, axes)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        param_sh,
        transform_non_params=lambda _: replicated,
    )
    _, model_state_axes = abstract_model_state(model_cfg)
    model_state_sh = sharding.tree_shardings(mesh, model_state_axes)
    return TrainState(
        step=replicated,
        params=param_sh,
        opt_state=opt_sh,
        rng=replicated,
        model_state=model_state_sh,
        loss_scale=_initial_loss_scale(loss_scaling, lambda _: replicated),
    )


def _initial_loss_scale(loss_scaling, leaf=lambda x: x):
    """The dynamic loss scale's start (None without one), each leaf passed through `leaf`."""
    if loss_scaling is None:
        return None
    return jax.tree.map(leaf, loss_scaling.initial())


def init_state(model_cfg: ModelConfig, tx, mesh: Mesh, seed: int, loss_scaling=None) -> TrainState:
    """A freshly initialised TrainState, each leaf created in its shards; `loss_scaling`
    (`jaxllm.train.loss_scale.LossScaling`, None: no scaling) gives the loss scale's start."""
    shardings = state_shardings(model_cfg, tx, mesh, loss_scaling)
    init = jax.jit(
        lambda: _init(model_cfg, tx, seed, _initial_loss_scale(loss_scaling)),
        out_shardings=shardings,
    )
    return init()


def init_state_from(
    params, model_cfg: ModelConfig, tx, mesh: Mesh, seed: int, model_state=None, loss_scaling=None
) -> TrainState:
    """A TrainState at step 0 around given (already sharded) parameters and model state (MoE
    routing biases; None: zeros): fresh optimizer state, rng and loss scale, each leaf in its
    shards (fine-tuning, `checkpoint.init_from`)."""
    shardings = state_shardings(model_cfg, tx, mesh, loss_scaling)

    abstract_ms, _ = abstract_model_state(model_cfg)

    def init(params, model_state):
        state_key = jax.random.split(jax.random.key(seed))[1]  # as `_init`: same rng stream
        if model_state is None:
            model_state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_ms)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(state_key),
            model_state=model_state,
            loss_scale=_initial_loss_scale(loss_scaling),
        )

    return jax.jit(init, out_shardings=shardings)(params, model_state)
