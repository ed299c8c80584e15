"""The checks of on-policy distillation's keys (`train.distill_lambda`; the sampling itself is
`jaxllm.objectives.rollout.onpolicy`), which read the train and the data sections together."""

from __future__ import annotations

from jaxllm.config.errors import fail

# The formats whose examples have prompts to sample from; `auto` may be a directory prepared
# from them, told apart when it is read.
PROMPT_FORMATS = ("chat", "prompt_completion", "auto")
# The rollout keys on-policy distillation samples with.
SAMPLING_KEYS = ("max_completion_tokens", "rollout_temperature")


def validate_on_policy(t, data) -> None:
    """`train.distill_lambda` in [0, 1]; with it above 0, the sampling keys in range, prompts
    to sample from, and nothing that would train on the student's own samples as data; at 0,
    no sampling key set (they would do nothing)."""
    lam = t.distill_lambda
    if not 0 <= lam <= 1:
        fail(f"train.distill_lambda must be in [0, 1] (the share of on-policy batches), not {lam}.")
    if t.objective != "distill":
        return
    if lam == 0:
        for key in SAMPLING_KEYS:
            if getattr(t, key) != getattr(type(t), key):
                fail(
                    f"train.{key} has no effect with train.objective=distill and "
                    "train.distill_lambda=0 (nothing is sampled); set train.distill_lambda > 0 "
                    f"for on-policy batches or drop train.{key}."
                )
        return
    if t.max_completion_tokens < 1:
        fail(f"train.max_completion_tokens must be positive, not {t.max_completion_tokens}.")
    if not t.rollout_temperature > 0:
        fail(f"train.rollout_temperature must be positive, not {t.rollout_temperature}.")
    if t.distill_weight != 1:
        fail(
            f"train.distill_weight={t.distill_weight} mixes in the cross-entropy of the batch's "
            f"completions, but with train.distill_lambda={lam} some are the student's own "
            "samples; set train.distill_weight=1 (the divergence alone, as GKD trains)."
        )
    for src in data.sources:
        if src.format not in PROMPT_FORMATS or src.path == "stdlib":
            fail(
                f"train.distill_lambda={lam} samples the student's completions of the data's "
                f"prompts, but data source {src.path!r} has format {src.format}, which has "
                "none; give chat or prompt_completion sources (or a directory prepared from "
                "them), or set train.distill_lambda=0."
            )
    if data.train_on_prompt:
        fail(
            f"train.distill_lambda={lam} samples completions of the examples' prompts, but "
            "data.train_on_prompt=true trains every token, so no example has a prompt; set it "
            "to false."
        )
