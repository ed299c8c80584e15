"""`train.grpo`: the loss options of the critic-free rollout objectives, by TRL's names.

`train.objective` picks a family and a preset; each key left null takes the preset's value
(`PRESETS`), a key set explicitly wins over it:

    grpo          loss_type grpo, scale_rewards group, importance_sampling_level token
    dr_grpo       loss_type dr_grpo, scale_rewards none                     (Liu et al. 2025)
    dapo          loss_type dapo, epsilon_high 0.28, dynamic_sampling, overlong_buffer
                  max_completion_tokens // 4                                  (Yu et al. 2025)
    gspo          importance_sampling_level sequence, clip range 3e-4 / 4e-4 while
                  train.clip_epsilon is left at 0.2                          (Zheng et al. 2025)
    rloo          leave-one-out baseline, sequence ratio of summed log-probs, KL in the reward
    reinforce_pp  token returns with a KL penalty per token, advantages normalised over the batch
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

from jaxllm.config.errors import fail as _fail

GRPO_FAMILY = ("grpo", "dr_grpo", "dapo", "gspo")
# Every objective whose advantages need no value head (`jaxllm.objectives.rollout.advantages`).
CRITIC_FREE = (*GRPO_FAMILY, "rloo", "reinforce_pp")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """`train.grpo` (see the module docstring for each objective's presets)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] | None = None
    """How token losses are averaged (TRL's GRPOTrainer): `grpo` each completion's mean, then
    the completions'; `bnpo` / `dapo` one mean over every completion token of the batch;
    `dr_grpo` token sums / (completions x max_completion_tokens). Null: the preset."""
    epsilon_high: float | None = None
    """The ratio's upper clip 1 + epsilon_high (DAPO's clip-higher), >= train.clip_epsilon
    (the lower one). Null: the preset, else train.clip_epsilon."""
    scale_rewards: Literal["group", "batch", "none"] | None = None
    """Advantages (r - group mean) divided by the group's std, the batch's std, or nothing."""
    importance_sampling_level: Literal["token", "sequence"] | None = None
    """`sequence` (GSPO): one ratio per completion, exp of its mean token log-ratio."""
    dynamic_sampling: bool | None = None
    """DAPO: groups whose rewards are all equal are dropped and others sampled in their place."""
    max_resample: int = 4
    """`dynamic_sampling`: extra rounds of sampling per rollout at most; groups still missing
    are then filled with dropped ones (advantage 0)."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong punishment: a completion longer than max_completion_tokens minus
    this many tokens loses up to `overlong_penalty`, linearly over the buffer; 0: off."""
    overlong_penalty: float = 1.0
    """The largest overlong punishment (> 0)."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_tokens (no stop) train nothing (their loss mask is 0)."""


PRESETS = {
    "grpo": dict(loss_type="grpo", scale_rewards="group"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28, dynamic_sampling=True),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "rloo": dict(loss_type="grpo", scale_rewards="none"),
    "reinforce_pp": dict(loss_type="grpo", scale_rewards="none"),
}
# Which objectives read each key: set for another one it would do nothing (refused).
READS = {
    "loss_type": (*GRPO_FAMILY, "reinforce_pp"),
    "epsilon_high": CRITIC_FREE,
    "scale_rewards": GRPO_FAMILY,
    "importance_sampling_level": GRPO_FAMILY,
    "dynamic_sampling": (*GRPO_FAMILY, "rloo"),
    "max_resample": (*GRPO_FAMILY, "rloo"),
    "overlong_buffer": CRITIC_FREE,
    "overlong_penalty": CRITIC_FREE,
    "mask_truncated_completions": CRITIC_FREE,
}


class Settings(NamedTuple):
    """The resolved loss options of one run (`settings`)."""

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    scale_rewards: str
    level: str  # token | sequence | sum (RLOO's ratio of summed log-probabilities)
    dynamic_sampling: bool
    max_resample: int
    overlong_buffer: int
    overlong_penalty: float
    mask_truncated: bool


def settings(t) -> Settings:
    """`train.grpo` of the train section `t` with its objective's preset filled in."""
    g, preset = t.grpo, PRESETS.get(t.objective, PRESETS["grpo"])

    def pick(key, default):
        value = getattr(g, key)
        return value if value is not None else preset.get(key, default)

    low = t.clip_epsilon
    gspo_range = t.objective == "gspo" and t.clip_epsilon == 0.2  # GSPO's section 5.1
    if gspo_range:
        low = 3e-4
    dapo_buffer = t.max_completion_tokens // 4 if t.objective == "dapo" else 0
    level = "sum" if t.objective == "rloo" else pick("importance_sampling_level", "token")
    return Settings(
        loss_type=pick("loss_type", "grpo"),
        epsilon_low=low,
        epsilon_high=pick("epsilon_high", 4e-4 if gspo_range else low),
        scale_rewards=pick("scale_rewards", "group"),
        level=level,
        dynamic_sampling=bool(pick("dynamic_sampling", False)),
        max_resample=g.max_resample,
        overlong_buffer=pick("overlong_buffer", dapo_buffer),
        overlong_penalty=g.overlong_penalty,
        mask_truncated=g.mask_truncated_completions,
    )


def validate_grpo(t) -> None:
    """The checks of `train.grpo` against the train section `t`."""
    g = t.grpo
    for key, readers in READS.items():
        if getattr(g, key) != getattr(GRPOConfig, key) and t.objective not in readers:
            if ":" not in t.objective:
                _fail(
                    f"train.grpo.{key} has no effect with train.objective={t.objective}; it "
                    f"belongs to {', '.join(readers)}."
                )
    if t.objective not in CRITIC_FREE:
        return
    s = settings(t)
    if s.epsilon_high < s.epsilon_low:
        _fail(
            f"train.grpo.epsilon_high={s.epsilon_high} is below the lower clip "
            f"{s.epsilon_low} (train.clip_epsilon); clip-higher needs epsilon_high >= it."
        )
    if g.max_resample < 0:
        _fail(f"train.grpo.max_resample must be >= 0, not {g.max_resample}.")
    if not 0 <= s.overlong_buffer <= t.max_completion_tokens:
        _fail(
            f"train.grpo.overlong_buffer must be in [0, train.max_completion_tokens="
            f"{t.max_completion_tokens}], not {s.overlong_buffer}."
        )
    if not g.overlong_penalty > 0:
        _fail(f"train.grpo.overlong_penalty must be positive, not {g.overlong_penalty}.")
