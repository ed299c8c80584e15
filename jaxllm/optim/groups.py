"""Per-parameter-group learning rates and weight decay (`optim.param_groups`), as torch's
param groups, LLaVA's `mm_projector_lr` / `vision_tower_lr` or Megatron's embedding lr.

Each parameter takes the first group whose `match` regex `re.search`es its path (the dict keys
joined by `/`, as `jaxllm plan` lists them); the others keep the optimizer's own settings. A
group's `lr_scale` multiplies the leaf's update after the learning rate (`scale_by_groups`), so
schedule, clipping (on the whole gradient, before), weight-decay masks and the optimizer's
state are untouched: the factors are Python floats fixed at trace time, no state, nothing to
shard. `lr_scale: 0` freezes the group through `train.freeze`'s mask (`frozen_mask`): no
optimizer state, no gradient, bit-identical weights. A group's `weight_decay` replaces
`optim.weight_decay` on its matrices (`add_group_decay`); norm scales and biases never decay.
"""

from __future__ import annotations

import re

import jax
import optax

from jaxllm.config import ConfigError


def path_of(path) -> str:
    """The `/`-joined dict path of a leaf (`blocks/attn/q/kernel`)."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def group_of(name: str, groups) -> int | None:
    """The index of the first group whose `match` fits `name`; None: no group."""
    for i, g in enumerate(groups):
        if re.search(g.match, name):
            return i
    return None


def frozen_mask(params, groups, mask=None):
    """`mask` (`train.freeze`'s, None: nothing frozen) with the parameters of the `lr_scale: 0`
    groups added; None when nothing is frozen. ConfigError for a group that no trainable
    parameter of `params` falls into, or when nothing would train."""
    if not groups:
        return mask
    hit = [0] * len(groups)

    def one(path, _, frozen=False):
        i = group_of(path_of(path), groups)
        if i is not None and not frozen:
            hit[i] += 1
        return i is not None and groups[i].lr_scale == 0

    by_group = jax.tree_util.tree_map_with_path(one, params, *(() if mask is None else (mask,)))
    for i, n in enumerate(hit):
        if n == 0:
            names = [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
            raise ConfigError(
                f"optim.param_groups[{i}].match {groups[i].match!r} matches no trainable "
                f"parameter not taken by an earlier group; paths look like {names[0]} "
                "(`jaxllm plan` lists them)."
            )
    out = by_group if mask is None else jax.tree.map(lambda a, b: a or b, mask, by_group)
    if not any(jax.tree.leaves(out)):
        return None
    if all(jax.tree.leaves(out)):
        raise ConfigError(
            "optim.param_groups with lr_scale 0 (and train.freeze) freeze every trainable "
            "parameter; leave one group training."
        )
    return out


def scale_by_groups(tx: optax.GradientTransformation, groups) -> optax.GradientTransformation:
    """`tx` with each leaf's update times its group's `lr_scale` (1 outside every group). The
    state is `tx`'s own, so a run resumes across a change of the factors or of the groups."""

    def factor(path):
        i = group_of(path_of(path), groups)
        return 1.0 if i is None else groups[i].lr_scale

    def scaled(path, u):
        f = factor(path)
        return u if f == 1.0 else u * jax.numpy.asarray(f, u.dtype)

    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        return jax.tree_util.tree_map_with_path(scaled, updates), state

    return optax.GradientTransformation(tx.init, update)


def add_group_decay(weight_decay: float, groups, no_decay) -> optax.GradientTransformation:
    """Decoupled weight decay `u + wd * p` with each group's `weight_decay` (the optimizer's
    `weight_decay` outside groups or where a group sets none); none on the leaves whose last
    key `no_decay(name)` marks (norm scales, biases)."""

    def rate(path):
        if no_decay(str(getattr(path[-1], "key", ""))):
            return 0.0
        i = group_of(path_of(path), groups)
        if i is None or groups[i].weight_decay is None:
            return weight_decay
        return groups[i].weight_decay

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the parameters in update()")

        def one(path, u, p):
            wd = rate(path)
            return u if wd == 0 else u + wd * p

        return jax.tree_util.tree_map_with_path(one, updates, params), state

    # the state of optax's masked add_decayed_weights: a checkpoint moves between the two
    return optax.GradientTransformation(lambda _: optax.MaskedState(optax.EmptyState()), update)


def group_lrs(groups, lr):
    """{`lr/group_I`: lr x lr_scale} of the training groups, for the step's metrics."""
    return {f"lr/group_{i}": lr * g.lr_scale for i, g in enumerate(groups) if g.lr_scale > 0}
