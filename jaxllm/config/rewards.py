"""`train.rewards`: a weighted list of rewards for `grpo` / `ppo`, as TRL's `reward_funcs` with
`reward_weights`. Each entry is a function (`fn`: `exact_match`, `regex:PATTERN`, `MODULE:NAME`
or `path/to/file.py:NAME`, as `train.reward` names them) or a model (`model`: the directory of
a `train.objective=reward` or `prm` run, or a Hugging Face `*ForSequenceClassification`), and a
weight; a completion's reward is the weighted sum. Each one's mean is logged as
`rewards/<name>/mean` (the function's name, the model directory's last part)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Literal

from jaxllm.config.errors import fail as _fail


@dataclasses.dataclass(frozen=True)
class RewardTermConfig:
    fn: str | None = None
    """A reward function, named as `train.reward` names one."""
    model: str | None = None
    """Or a reward model or process reward model directory."""
    weight: float = 1.0
    """Its weight in the sum (finite; the weights must not sum to 0)."""
    aggregate: Literal["min", "mean", "last"] = "min"
    """A process reward model (`prm` run): how its step scores (probabilities that a step is
    correct) make the completion's reward: the lowest, their mean, or the last one's."""


def term_name(term: RewardTermConfig) -> str:
    """The name a term's mean is logged under: the function's name (`regex` for a pattern),
    the model directory's last part."""
    if term.model is not None:
        return Path(term.model.rstrip("/")).name
    spec = term.fn
    return "regex" if spec.startswith("regex:") else spec.rpartition(":")[2]


def validate_rewards(t) -> None:
    """The checks of `train.rewards` that need nothing but the train section `t`."""
    if not t.rewards:
        return
    if t.reward != "exact_match":
        _fail(
            "train.reward and train.rewards both name the reward; keep one (train.rewards: "
            "[{fn: NAME, weight: 1.0}, {model: DIR, weight: 0.5}])."
        )
    for i, term in enumerate(t.rewards):
        key = f"train.rewards[{i}]"
        if (term.fn is None) == (term.model is None):
            _fail(f"{key} names one reward: either fn (a function) or model (a directory).")
        if not math.isfinite(term.weight):
            _fail(f"{key}.weight must be a finite number, not {term.weight}.")
        if term.fn is not None and term.aggregate != "min":
            _fail(f"{key}.aggregate belongs to a process reward model (model), not to fn.")
    if math.isclose(sum(term.weight for term in t.rewards), 0.0, abs_tol=1e-12):
        _fail("the weights of train.rewards sum to 0; give them a non-zero sum.")
    names = [term_name(term) for term in t.rewards]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        _fail(
            f"train.rewards logs each reward by name, and {', '.join(twice)} names more than "
            "one; give each function or model directory a distinct name."
        )
