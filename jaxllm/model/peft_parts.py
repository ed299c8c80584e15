"""Which parts of a model train beside its LoRA adapters, and where: the whole weights of
`peft.modules_to_save` (PEFT's modules_to_save) and the layers of `peft.layers_to_transform`
(PEFT's layers_to_transform)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError, PeftConfig

# Our parameter of each name `peft.modules_to_save` takes (PEFT's module names).
SAVED = {"embed_tokens": ("embed", "embedding"), "lm_head": ("lm_head",), "score": ("score",)}
BESIDE = {"score": "score_bias"}
"""A saved module's other top-level parameter, where the model has it (the score head's bias)."""


def saved_from(params: dict, base: dict, peft: PeftConfig) -> dict:
    """`params` (what trains) with the modules `peft.modules_to_save` names taken from the
    loaded `base`: where they start."""
    out = dict(params)
    for name in peft.modules_to_save:
        path = SAVED[name]
        if name in BESIDE and BESIDE[name] in base:
            out[BESIDE[name]] = base[BESIDE[name]]
        if len(path) == 1:
            out[path[0]] = base[path[0]]
        else:
            out[path[0]] = {**out[path[0]], path[1]: base[path[0]][path[1]]}
    return out


def picked_layers(path, axes, shape, layers, ndim, dtype) -> jax.Array:
    """1 for the stacked layers `layers` names, else 0, broadcast over a factor of `ndim`."""
    if not path or path[0] != "layers" or axes[:1] != ("layers",):
        raise ConfigError(
            "peft.layers_to_transform needs a model with one stack of layers (no MoE groups, "
            "hybrid pattern or vision tower adapters); leave it unset."
        )
    if max(layers) >= shape[0]:
        raise ConfigError(f"peft.layers_to_transform: this model has layers 0..{shape[0] - 1}.")
    keep = jnp.isin(jnp.arange(shape[0]), jnp.asarray(layers)).astype(dtype)
    return keep.reshape(-1, *(1,) * (ndim - 1))
