"""The learning-rate schedules after warmup, each a function of the step since warmup ended.

- `cosine`, `linear`: decay from lr to min_lr_ratio * lr over the remaining steps.
- `step`, `exponential`: lr * decay_rate^(t / decay_every), with t / decay_every rounded down
  (step) or not (exponential), floored at min_lr_ratio * lr.
- `cosine_restarts`: SGDR (Loshchilov & Hutter 2017): cosine cycles from lr down to
  min_lr_ratio * lr, restarting at lr; the first cycle takes restart_steps, each next one
  restart_mult times as many as the last.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax

from jaxllm.config import OptimConfig


def cosine_restarts(peak: float, end: float, first: int, mult: float, total: int) -> optax.Schedule:
    """SGDR over `total` steps: the cycle of step t and the step within it, then half a cosine
    from `peak` to `end` over that cycle."""
    if mult == 1:

        def cycle(t):
            return t % first, jnp.float32(first)

    else:  # cycle starts first * (mult^i - 1) / (mult - 1): a short table, not a float log
        starts, length = [0.0], float(first)
        while starts[-1] + length < total:
            starts.append(starts[-1] + length)
            length *= mult
        starts_C = jnp.asarray(np.array(starts, np.float32))
        lengths_C = jnp.asarray(np.float32(first) * np.float32(mult) ** np.arange(len(starts)))

        def cycle(t):
            i = jnp.searchsorted(starts_C, jnp.float32(t), side="right") - 1
            return jnp.float32(t) - starts_C[i], lengths_C[i]

    def schedule(count):
        t_cur, length = cycle(count)
        return end + (peak - end) * 0.5 * (1 + jnp.cos(math.pi * t_cur / length))

    return schedule


def after_warmup(cfg: OptimConfig, peak: float, steps: int) -> optax.Schedule:
    """The schedule `cfg.schedule` from `peak` over the `steps` that follow warmup."""
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return optax.cosine_decay_schedule(peak, steps, alpha=cfg.min_lr_ratio)
    if cfg.schedule == "linear":
        return optax.linear_schedule(peak, end, steps)
    if cfg.schedule in ("step", "exponential"):
        return optax.exponential_decay(
            peak,
            cfg.decay_every,
            cfg.decay_rate,
            staircase=cfg.schedule == "step",
            end_value=end,
        )
    if cfg.schedule == "cosine_restarts":
        return cosine_restarts(peak, end, cfg.restart_steps, cfg.restart_mult, steps)
    return optax.constant_schedule(peak)
