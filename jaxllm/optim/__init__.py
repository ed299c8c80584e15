"""Optax optimizers and learning-rate schedules.

`optim.name` picks the optimizer; every one runs after clipping (elementwise, `clip_value`,
then by global norm, `clip_norm`) and annealed gradient noise (`grad_noise`), with decoupled
weight decay (Loshchilov & Hutter 2019) only on matrices (kernels and embeddings), never on
norm scales or biases, and the learning-rate schedule, optionally on float32 master weights
(`master.py`). The result is a plain `optax.GradientTransformation`. Optax provides every
optimizer but these, which live here each in its own module: Adam-mini (`adam_mini`), AdamW
with 8-bit blockwise-quantized moments (`adamw_8bit`), CAME (`came`), LDAdam (`ldadam`), GaLore
with its quantized form Q-GaLore (`galore`: optax.contrib's GaLore flattens stacked layers into
one matrix and keeps states no parameter sharding fits), and the matrix preconditioners SOAP
(`soap`) and Shampoo (`shampoo`), which neither optax nor a maintained JAX package ships.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
import optax.contrib
from optax.contrib import MuonDimensionNumbers

from jaxllm.config import OptimConfig
from jaxllm.config.optim import resolved_lr
from jaxllm.optim import (
    adam_mini,
    adamw_8bit,
    came,
    galore,
    groups,
    ldadam,
    schedules,
    shampoo,
    soap,
)
from jaxllm.optim.freeze import select, trainable_only
from jaxllm.optim.master import with_master_weights
from jaxllm.optim.noise import annealed_noise
from jaxllm.optim.sparse import keep_zeros

__all__ = [
    "NO_DECAY_NAMES",
    "adam_mini",
    "adamw_8bit",
    "annealed_noise",
    "build",
    "came",
    "decay_mask",
    "galore",
    "groups",
    "keep_zeros",
    "ldadam",
    "resolve",
    "schedule",
    "schedules",
    "select",
    "shampoo",
    "soap",
    "trainable_only",
    "with_master_weights",
]

NO_DECAY_NAMES = ("scale", "bias", "sinks")  # norm scales; biases (and `*_bias`); sink logits


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then `cfg.schedule` (`schedules.after_warmup`). `cfg.lr` is the
    peak as given: `build` and `schedule` take the optim section after `resolve` scaled it."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    after = schedules.after_warmup(cfg, cfg.lr, max(total_steps - warmup, 1))
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def resolve(cfg: OptimConfig, global_batch: int) -> OptimConfig:
    """The optim section with `lr` scaled to a global batch of `global_batch` rows by
    `lr_scaling` (`config.optim.resolved_lr`), and the scaling then marked done."""
    if cfg.lr_scaling == "none":
        return cfg
    lr = resolved_lr(cfg, global_batch)
    return dataclasses.replace(cfg, lr=lr, lr_scaling="none", reference_batch_size=None)


def _no_decay(name: str) -> bool:
    return name in NO_DECAY_NAMES or name.endswith("_bias")


def decay_mask(params) -> dict:
    """True for leaves that take weight decay: everything but norm scales and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not _no_decay(str(getattr(path[-1], "key", ""))), params
    )


def _muon_dims(axes):
    """optax's Muon dimension numbers from logical axes: the reduction (input) dims and the
    output dims of each matrix, stacked dims (layers, experts) batched over. Embeddings, the LM
    head and vectors get None: optax updates them with Adam, as Muon's authors do."""

    def dims(ax):
        d = galore.matrix_dims(ax)
        if d is None:
            return None
        if ax[d.out[-1]] == "embed":  # (inputs..., embed): several input dims, one output
            return MuonDimensionNumbers(reduction_axis=d.red, output_axis=d.out[0])
        return MuonDimensionNumbers(reduction_axis=d.red[0], output_axis=d.out)

    return jax.tree.map(dims, axes, is_leaf=lambda x: isinstance(x, tuple))


def _direction(cfg: OptimConfig, axes) -> optax.GradientTransformation:
    """The optimizer's update direction before weight decay and the learning rate."""
    name = cfg.name
    if name == "sgd":
        # optax.trace(decay=0) is a state-less identity only in value; skip it to keep SGD at 0
        # bytes of state
        if cfg.momentum == 0:
            return optax.identity()
        return optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov)
    if name == "adagrad":
        return optax.scale_by_rss(eps=cfg.eps)
    if name == "rmsprop":
        rms = optax.scale_by_rms(decay=cfg.b2, eps=cfg.eps)
        if cfg.momentum == 0:
            return rms
        return optax.chain(rms, optax.trace(decay=cfg.momentum, nesterov=cfg.nesterov))
    if name in ("adam", "adamw"):
        scale = optax.scale_by_amsgrad if cfg.amsgrad else optax.scale_by_adam
        return scale(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if name == "adafactor":
        # factored second moment (row and column means of g^2) for matrices, no first moment;
        # clipped update (threshold 1, as in the paper); the schedule sets the step size. Dims
        # from 32 up are factored so (embed, heads, head_dim) kernels count as matrices
        return optax.chain(
            optax.scale_by_factored_rms(min_dim_size_to_factor=32), optax.clip_by_block_rms(1.0)
        )
    if name == "lion":
        return optax.scale_by_lion(b1=cfg.b1, b2=cfg.b2)
    if name == "lamb":
        return optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    if name == "sm3":
        return optax.scale_by_sm3(b1=cfg.b1, eps=cfg.eps)
    if name == "adam_mini":
        return adam_mini.scale_by_adam_mini(_need_axes(axes, name), cfg.b1, cfg.b2, cfg.eps)
    if name == "adamw_8bit":
        return adamw_8bit.scale_by_adam_8bit(
            cfg.b1, cfg.b2, cfg.eps, cfg.block_size, cfg.quantization
        )
    if name == "soap":
        args = (_need_axes(axes, name), cfg.b1, cfg.b2, cfg.eps, cfg.precondition_every)
        return soap.scale_by_soap(*args)
    if name == "shampoo":
        args = (_need_axes(axes, name), cfg.b1, cfg.b2, cfg.eps, cfg.precondition_every)
        return shampoo.scale_by_shampoo(*args)
    if name == "came":
        return came.scale_by_came(_need_axes(axes, name), cfg.b1, cfg.b2, cfg.came_b3)
    if name == "ldadam":
        return ldadam.scale_by_ldadam(
            _need_axes(axes, name), cfg.galore_rank, cfg.b1, cfg.b2, cfg.eps
        )
    if name in ("galore", "q_galore"):
        return galore.scale_by_galore(
            _need_axes(axes, name),
            cfg.galore_rank,
            cfg.galore_update_gap,
            cfg.galore_scale,
            cfg.b1,
            cfg.b2,
            cfg.eps,
            int4=name == "q_galore",
        )
    raise AssertionError(name)


def _need_axes(axes, name):
    if axes is None:
        raise ValueError(f"optim.name={name} takes its blocks from the parameters' logical axes")
    return axes


def build(
    cfg: OptimConfig, total_steps: int, axes=None, sparse=None, seed: int = 0, frozen=None
) -> optax.GradientTransformation:
    """The configured optimizer. `axes`: the parameters' logical axes as a tree of tuples
    (`jaxllm.model.abstract_model`), which adam_mini, muon, soap and shampoo read to find blocks and matrices.
    `sparse`: a tree of bools over the parameters, those whose zeros stay zero (a pruned run's
    weights, `sparse.keep_zeros`); None: none. `seed`: the gradient noise's (optim.grad_noise).
    `frozen`: a tree of bools over the parameters, True for those that do not train
    (`train.freeze` and the `lr_scale: 0` groups, `groups.frozen_mask`); None: all train.
    `cfg.param_groups` scale each group's updates after the learning rate (`groups`)."""
    if frozen is not None:
        axes = None if axes is None else select(axes, frozen)
        sparse = None if sparse is None else select(sparse, frozen)
    lr = schedule(cfg, total_steps)
    group_decay = any(g.weight_decay is not None for g in cfg.param_groups)
    if cfg.name == "adamw" and not cfg.amsgrad and not group_decay:
        tx = optax.adamw(
            lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
        )
    elif cfg.name == "muon":
        tx = optax.contrib.muon(
            lr,
            beta=cfg.b1,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=decay_mask,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            muon_weight_dimension_numbers=_muon_dims(_need_axes(axes, "muon")),
        )
    else:
        parts = [_direction(cfg, axes)]
        if group_decay:  # per-group rates (config refuses them for adam and muon)
            parts.append(groups.add_group_decay(cfg.weight_decay, cfg.param_groups, _no_decay))
        elif cfg.name != "adam" and cfg.weight_decay > 0:
            parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
        if cfg.name == "lamb":  # layer-wise trust ratio ||w|| / ||update|| (You et al. 2020)
            parts.append(optax.scale_by_trust_ratio())
        parts.append(optax.scale_by_learning_rate(lr))
        tx = optax.chain(*parts)
    if cfg.param_groups:  # after the learning rate; before int8 weights, clipping, master copy
        tx = groups.scale_by_groups(tx, cfg.param_groups)
    if cfg.grad_noise > 0:  # on the clipped gradients
        noise = annealed_noise(cfg.grad_noise, cfg.grad_noise_gamma, seed)
        tx = optax.chain(noise, tx)
    if cfg.name == "q_galore":  # int8 weights: after the learning rate, before clipping
        tx = galore.with_int8_weights(tx, axes)
    if cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    if cfg.clip_value is not None:
        tx = optax.chain(optax.clip(cfg.clip_value), tx)
    if sparse is not None:
        tx = optax.chain(tx, keep_zeros(sparse))
    if cfg.master_weights != "none":
        tx = with_master_weights(tx, cfg.master_weights)
    return tx if frozen is None else trainable_only(tx, frozen)
