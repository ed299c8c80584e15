"""Verifiable rewards of GRPO: Python functions of the rollouts, run on the host.

A reward function takes the batch's prompts (as the records wrote them), completions (decoded
text) and answers (the records' `answer_field`) and returns one float per completion, the shape
of TRL's `reward_funcs`. `train.reward` names it:

    exact_match     1.0 when the completion, stripped of surrounding whitespace, equals the
                    answer (as a string, stripped), else 0.0
    regex:PATTERN   1.0 when PATTERN's first match in the completion (its group 1 when the
                    pattern has a group) equals the answer, else 0.0: answer extraction, as
                    GSM8K's `#### (-?\\d+)`
    MODULE:NAME     a function of your own (`path/to/file.py:NAME` too), e.g. one that runs a
                    unit test against the completion's code

A reward model stands in their place when `train.reward` is a directory (`is_model`): a
`train.objective=reward` run or a Hugging Face `*ForSequenceClassification` export, or a
process reward model (a `train.objective=prm` run) scoring each step. `train.rewards` weighs
several (`jaxllm.objectives.rollout.scoring`). It is a
frozen model held on the mesh beside the policy (`jaxllm.train.companions`, name `reward_model`)
and scores the token rows of the rollouts on the device (`jaxllm.objectives.rollout.sampling`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxllm.config import ConfigError
from jaxllm.objectives.base import load_function

RewardFn = Callable[[Sequence, Sequence[str], Sequence], Sequence[float]]


def exact_match(prompts, completions: Sequence[str], answers) -> list[float]:
    """1.0 where the stripped completion equals the stripped answer."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


def regex(pattern: str) -> RewardFn:
    """1.0 where `pattern`'s first match (group 1 if it has groups) equals the answer."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"train.reward=regex:{pattern}: not a regular expression ({e})") from None

    def regex_match(prompts, completions: Sequence[str], answers) -> list[float]:
        out = []
        for c, a in zip(completions, answers):
            m = compiled.search(c)
            found = None if m is None else (m.group(1) if compiled.groups else m.group(0))
            out.append(float(found is not None and found.strip() == str(a).strip()))
        return out

    return regex_match


def _load(spec: str) -> RewardFn:
    return load_function(spec, "train.reward")


def is_model(spec: str) -> bool:
    """Whether `train.reward` names a reward model (a directory) rather than a function."""
    return Path(spec).is_dir()


def model_sources(t) -> dict[str, str]:
    """The reward models of the train section `t` by the name their frozen copy is held under:
    `reward_model` for `train.reward`, `reward_model_<i>` for entry i of `train.rewards`."""
    if t.rewards:
        return {f"reward_model_{i}": r.model for i, r in enumerate(t.rewards) if r.model}
    return {"reward_model": t.reward} if is_model(t.reward) else {}


def with_term_metrics(objective, names: Sequence[str]):
    """`objective` (grpo / ppo, whose `tokens` counts completions) that also logs each named
    reward's mean over the completions, `rewards/<name>/mean`, from the batch's
    `rewards/<name>` fields (`jaxllm.objectives.rollout.scoring`)."""
    import jax.numpy as jnp

    def with_terms(model, batch: dict, rng, others=None):
        out = objective(model, batch, rng, others)
        valid_B = (jnp.sum(batch["loss_mask"], axis=-1) > 0).astype(jnp.float32)
        metrics = dict(out.metrics)
        for name in names:
            metrics[f"rewards/{name}/mean"] = jnp.sum(batch[f"rewards/{name}"][:, 0] * valid_B)
        return out._replace(metrics=metrics)

    with_terms.others = getattr(objective, "others", ())
    return with_terms


def from_spec(spec: str) -> RewardFn:
    """The reward function `train.reward` names (see the module docstring)."""
    if spec == "exact_match":
        return exact_match
    if spec.startswith("regex:"):
        return regex(spec[len("regex:") :])
    if is_model(spec):
        raise ConfigError(
            f"train.reward={spec} is a reward model, which scores token rows on the mesh, not "
            "a function of texts."
        )
    if ":" in spec:
        return _load(spec)
    raise ConfigError(
        f"train.reward={spec!r}: use exact_match, regex:PATTERN, or MODULE:NAME / "
        "path/to/file.py:NAME naming a function (prompts, completions, answers) -> rewards"
    )


def score(fn: RewardFn, prompts, completions: Sequence[str], answers) -> list[float]:
    """`fn`'s rewards, checked: one finite float per completion, else a ValueError."""
    rewards = [float(r) for r in fn(prompts, completions, answers)]
    if len(rewards) != len(completions):
        raise ValueError(
            f"the reward function returned {len(rewards)} rewards for {len(completions)} "
            "completions"
        )
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"the reward function returned a non-finite reward: {rewards}")
    return rewards
