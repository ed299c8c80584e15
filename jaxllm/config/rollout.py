"""The checks of the rollout objectives' keys (the critic-free family, `ppo`, `online_dpo`) in the `train`
section."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail
from jaxllm.config.grpo import CRITIC_FREE

# Those whose advantages compare the G completions of one prompt (G >= 2).
GROUP_OBJECTIVES = tuple(o for o in CRITIC_FREE if o != "reinforce_pp")


def validate_rollout(t) -> None:
    """The checks of the rollout objectives' keys."""
    group = t.objective in GROUP_OBJECTIVES
    if t.num_generations < (2 if group else 1):
        _fail(
            f"train.num_generations must be at least {2 if group else 1} for {t.objective}"
            + (" (a completion's advantage is relative to its group's others)" if group else "")
            + f", not {t.num_generations}."
        )
    if t.global_batch_size % t.num_generations:
        _fail(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.num_generations={t.num_generations}: each step samples whole groups."
        )
    if t.max_completion_tokens < 1:
        _fail(f"train.max_completion_tokens must be positive, not {t.max_completion_tokens}.")
    if not t.rollout_temperature > 0:
        _fail(
            f"train.rollout_temperature must be positive ({t.objective} samples), not "
            f"{t.rollout_temperature}."
        )
    if t.beta == 0 and t.reference:
        _fail(
            f"train.reference has no effect with train.beta=0: {t.objective} then keeps no KL "
            "to a reference; set train.beta > 0 or drop train.reference."
        )
    if t.updates_per_rollout < 1:
        _fail(f"train.updates_per_rollout must be at least 1, not {t.updates_per_rollout}.")
    if t.rollout_ahead not in (0, 1):
        _fail(
            f"train.rollout_ahead must be 0 (on-policy) or 1 (one step off-policy), not "
            f"{t.rollout_ahead}."
        )
    if not 0 < t.clip_epsilon < 1:
        _fail(f"train.clip_epsilon must be in (0, 1), not {t.clip_epsilon}.")
    for key in ("gae_gamma", "gae_lambda"):
        if not 0 <= getattr(t, key) <= 1:
            _fail(f"train.{key} must be in [0, 1], not {getattr(t, key)}.")
    for key in ("value_coef", "value_clip"):
        if not getattr(t, key) > 0:
            _fail(f"train.{key} must be positive, not {getattr(t, key)}.")
