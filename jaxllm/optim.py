"""Optax optimizer and learning-rate schedules.

AdamW (Loshchilov & Hutter 2019) after global-norm clipping; weight decay only on matrices
(kernels and embeddings), never on norm scales or biases. The result is a plain
`optax.GradientTransformation`, so anything optax offers can replace it.
"""

from __future__ import annotations

import jax
import optax

from jaxllm.config import OptimConfig

NO_DECAY_NAMES = ("scale", "bias")  # norm scales; `bias` and every `*_bias` (projections)


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine / linear decay to `min_lr_ratio * lr`, or constant."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    else:
        after = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def _no_decay(name: str) -> bool:
    return name in NO_DECAY_NAMES or name.endswith("_bias")


def decay_mask(params) -> dict:
    """True for leaves that take weight decay: everything but norm scales and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not _no_decay(str(getattr(path[-1], "key", ""))), params
    )


def build(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(
        schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
