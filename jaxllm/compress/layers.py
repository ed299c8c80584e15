"""Structured pruning (`jaxllm prune --method layers|heads|channels`): each group of parameters
gets LLM-Pruner's first-order Taylor estimate of the loss change its removal would make (Ma et
al. 2023, arXiv:2305.11627),

    I_group = sum over the group's parameters theta of |theta * dL/dtheta|,

with L the next-token loss summed over the calibration rows (the gradient accumulated over all
rows first, as LLM-Pruner does). The groups of least importance are removed and the model's
shapes shrink; the result is a plain model.

- `layers`: a group is a whole layer; floor(S x num_layers) layers go, the others keep their
  order.
- `heads`: a group is one key-value head with the query heads that read it (under GQA,
  num_heads / num_kv_heads of them; one head with its key and value under MHA), its rows of
  q/k/v_proj (and their biases) and of o_proj. Each layer loses its own floor(S x
  num_kv_heads) groups of least importance, so every layer keeps the same number of heads and
  the GQA grouping stays whole.
- `channels`: a group is one intermediate channel of the MLP (its column of gate_proj and
  up_proj, its row of down_proj, and their biases); each layer loses its own floor(S x
  mlp_dim) channels of least importance, so `model.mlp_dim` shrinks for every layer alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxllm.model import merge_model

BATCH_ROWS = 8
_KEYS = ("inputs", "positions", "segment_ids")


def next_token_loss(model, inputs, positions, segment_ids):
    """The summed next-token cross-entropy over the rows' tokens whose next token is of the
    same document (padding, segment id 0, left out)."""
    logits = model(inputs, positions_BxL=positions, segment_ids_BxL=segment_ids).logits
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), inputs[:, 1:]
    )
    return jnp.sum(jnp.where(same, ce, 0.0))


def taylor(graphdef, params, model_state, rows: dict):
    """|theta * dL/dtheta| of every parameter in float32 (the tree of `params`), the gradient
    of the loss summed over all calibration rows."""

    def loss(p, x, pos, seg):
        return next_token_loss(merge_model(graphdef, p, None, model_state), x, pos, seg)

    grad = jax.jit(jax.grad(loss))
    total = None
    n = len(rows["inputs"])
    for i in range(0, n, BATCH_ROWS):
        g = grad(params, *(jnp.asarray(rows[k][i : i + BATCH_ROWS]) for k in _KEYS))
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    return jax.tree.map(lambda w, g: jnp.abs(w.astype(jnp.float32) * g), params, total)


def layer_importance(graphdef, params, model_state, rows: dict) -> np.ndarray:
    """I_l of each layer of the stacked `params["layers"]` [L, ...] (module docstring): [L]."""
    scores = taylor(graphdef, params, model_state, rows)["layers"]
    per = jax.tree.map(lambda s: jnp.sum(s, axis=tuple(range(1, s.ndim))), scores)
    return np.asarray(sum(jax.tree.leaves(per)))


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def group_importance(scores, axes, unit: str, per_group: int = 1) -> dict[str, np.ndarray]:
    """{stack: [L, G]} from the Taylor `scores`: for every stacked parameter (its first axis
    `layers`) with the axis `unit` (heads, kv_heads or mlp), its scores summed over the other
    axes, `per_group` consecutive units of that axis to a group; stacks by their top-level
    name (`layers`, `moe_layers`)."""
    out: dict[str, np.ndarray] = {}
    for stack in scores:
        leaves = jax.tree.leaves(scores[stack])
        names = jax.tree.leaves(axes[stack], is_leaf=_is_axes) if stack in axes else []
        for s, a in zip(leaves, names):
            if not (isinstance(a, tuple) and a[:1] == ("layers",) and unit in a):
                continue
            u = a.index(unit)
            per = jnp.sum(s, axis=tuple(i for i in range(1, s.ndim) if i != u))
            per = np.asarray(per).reshape(per.shape[0], -1, per_group).sum(-1)
            out[stack] = out.get(stack, 0) + per
    return out


def kept_units(importance_LxG: np.ndarray, drop: int) -> np.ndarray:
    """[L, G - drop]: each layer's groups but its `drop` of least importance, in order."""
    order = np.argsort(importance_LxG, axis=1, kind="stable")[:, drop:]
    return np.sort(order, axis=1)


def take_units(tree, axes, keep: dict[str, dict[str, np.ndarray]]):
    """`tree` (params) with each stack's parameters cut along their unit axes:
    `keep[stack][unit]` [L, K] the indices each layer keeps of the axis `unit`."""

    def cut(units, x, a):
        for unit, idx in units.items():
            if unit not in a:
                continue
            u = a.index(unit)
            shape = [idx.shape[0]] + [1] * (x.ndim - 1)
            shape[u] = idx.shape[1]
            x = jnp.take_along_axis(x, jnp.asarray(idx).reshape(shape), axis=u)
        return x

    return {
        k: jax.tree.map(lambda x, a, u=keep[k]: cut(u, x, a), v, axes[k], is_leaf=_is_axes)
        if k in keep
        else v
        for k, v in tree.items()
    }


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
