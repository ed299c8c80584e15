"""Structured pruning of whole layers (`jaxllm prune --method layers`): each layer's importance
is LLM-Pruner's first-order Taylor estimate of the loss change its removal would make (Ma et al.
2023, arXiv:2305.11627, its "block" grouping),

    I_l = sum over the layer's parameters theta of |theta * dL/dtheta|,

with L the next-token loss summed over the calibration rows (the gradient accumulated over all
rows first, as LLM-Pruner does); the floor(S x num_layers) layers of least importance are
removed, the others kept in order. The result is a plain model with fewer layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxllm.model import merge_model

BATCH_ROWS = 8


def next_token_loss(model, inputs, positions, segment_ids):
    """The summed next-token cross-entropy over the rows' tokens whose next token is of the
    same document (padding, segment id 0, left out)."""
    logits = model(inputs, positions_BxL=positions, segment_ids_BxL=segment_ids).logits
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), inputs[:, 1:]
    )
    return jnp.sum(jnp.where(same, ce, 0.0))


def layer_importance(graphdef, params, model_state, rows: dict) -> np.ndarray:
    """I_l of each layer of the stacked `params["layers"]` [L, ...] (module docstring): [L]."""

    def loss(p, x, pos, seg):
        return next_token_loss(merge_model(graphdef, p, None, model_state), x, pos, seg)

    grad = jax.jit(jax.grad(loss))
    total = None
    n = len(rows["inputs"])
    for i in range(0, n, BATCH_ROWS):
        g = grad(params, *(jnp.asarray(rows[k][i : i + BATCH_ROWS]) for k in _KEYS))
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    per = jax.tree.map(
        lambda w, g: jnp.sum(jnp.abs(w.astype(jnp.float32) * g), axis=tuple(range(1, w.ndim))),
        params["layers"],
        total["layers"],
    )
    return np.asarray(sum(jax.tree.leaves(per)))


_KEYS = ("inputs", "positions", "segment_ids")


def kept_layers(importance: np.ndarray, fraction: float) -> list[int]:
    """The layers kept: all but the floor(fraction x L) of least importance, in order."""
    drop = math.floor(fraction * len(importance))
    order = np.argsort(importance, kind="stable")
    return sorted(int(i) for i in order[drop:])


def take_layers(tree, keep: list[int]):
    """`tree` (params or model state) with its stacked `layers` subtree cut to `keep`."""
    if "layers" not in tree:
        return tree
    index = jnp.asarray(keep)
    return {**tree, "layers": jax.tree.map(lambda x: x[index], tree["layers"])}
