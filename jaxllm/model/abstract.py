"""The model's parameters without creating them: shapes, dtypes and logical axes from
`jax.eval_shape`, for sharding and initialisation plans."""

from __future__ import annotations

from flax import nnx

from jaxllm.config import ModelConfig, PeftConfig
from jaxllm.model import lora
from jaxllm.model.layers import logical_axes
from jaxllm.model.transformer import build, init_keys, split_peft


def _abstract_split(cfg: ModelConfig, peft: PeftConfig | None):
    """(graphdef, trainable, frozen, model state) of the abstract model, as `nnx.State`s."""
    if not isinstance(cfg, ModelConfig):  # a whole Config fails deep inside otherwise
        raise TypeError(
            f"a model is built from a ModelConfig (a Config's .model), not {type(cfg).__name__}"
        )
    model = nnx.eval_shape(lambda: build(cfg, 0, peft))
    if peft is None or peft.method == "none":
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return graphdef, params, nnx.State({}), rest
    return nnx.split(model, lora.trainable(peft), nnx.Param, ...)


def abstract_model(cfg: ModelConfig, peft: PeftConfig | None = None):
    """(graphdef, abstract trainable params as a dict of ShapeDtypeStruct, logical axes dict):
    every parameter, or under `peft` only the adapters / soft prompt (`abstract_frozen` has the
    rest).

    The graphdef merges with params, the frozen params and the model state: `nnx.merge(graphdef,
    params, frozen, model_state)` (empty ones may be left out)."""
    graphdef, state, _, _ = _abstract_split(cfg, peft)
    return graphdef, nnx.to_pure_dict(state), logical_axes(state)


def abstract_frozen(cfg: ModelConfig, peft: PeftConfig | None = None):
    """(abstract frozen params, logical axes): the base under `peft`, {} without it."""
    _, _, state, _ = _abstract_split(cfg, peft)
    return nnx.to_pure_dict(state), logical_axes(state)


def abstract_model_state(cfg: ModelConfig):
    """(abstract non-Param model variables as a dict of ShapeDtypeStruct, logical axes dict)."""
    model = nnx.eval_shape(lambda: build(cfg, 0))
    _, _, state = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(state), logical_axes(state)


def fresh_where_missing(params: dict, cfg: ModelConfig, seed: int) -> dict:
    """Every parameter of `cfg`: those of `params`, and the top-level ones it lacks (a head or a
    vision tower new to a run started from another model) as a fresh run of `seed` starts them.
    Traceable: call it inside the jitted init."""
    fresh_keys = set(abstract_model(cfg)[1])
    if fresh_keys <= set(params):
        return {k: params[k] for k in sorted(fresh_keys)}
    fresh = split_peft(build(cfg, init_keys(seed)[0]), None)[1]
    return {k: params[k] if k in params else fresh[k] for k in fresh}
