"""The checks of on-policy distillation's keys (`train.distill_lambda`; the sampling itself is
`jaxllm.objectives.rollout.onpolicy`), which read the train and the data sections together, and
of feature distillation's (`train.distill_hidden_weight`, `train.distill_layers`,
`model.distill_proj`), which read the train, model and peft sections together; the teacher's
side of the layer map is checked when its config is read (`jaxllm.objectives.distill`)."""

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


def validate_features(t, model, peft) -> None:
    """`train.distill_hidden_weight` >= 0; with it above 0, a full (not PEFT) student and layer
    pairs [student block, teacher block] inside the student's stack; at 0 (or another
    objective), no layer map and no projections (they would do nothing)."""
    w = t.distill_hidden_weight
    if not w >= 0:
        fail(f"train.distill_hidden_weight must be >= 0 (0: off), not {w}.")
    if t.objective != "distill" or w == 0:
        if t.distill_layers:
            fail(
                "train.distill_layers has no effect with train.distill_hidden_weight=0; set "
                "train.distill_hidden_weight > 0 to match hidden states, or drop it."
            )
        if model.distill_proj and ":" not in t.objective:
            fail(
                "model.distill_proj holds feature distillation's projections, which only "
                "train.objective=distill with train.distill_hidden_weight > 0 trains; set "
                "model.distill_proj=[] (a new run from this one starts without them)."
            )
        return
    if peft.method != "none":
        fail(
            f"train.distill_hidden_weight={w} trains projections beside the whole student; "
            f"peft.method={peft.method} trains adapters only: set peft.method=none or "
            "train.distill_hidden_weight=0."
        )
    if model.kind == "encoder_decoder":
        fail(
            "train.distill_hidden_weight matches the hidden states of one stack of blocks; "
            "model.kind=encoder_decoder has two: set train.distill_hidden_weight=0."
        )
    n = model.num_layers
    for pair in t.distill_layers:
        if len(pair) != 2 or not 0 <= pair[0] < n or pair[1] < 0:
            fail(
                f"train.distill_layers holds {list(pair)}; each entry is [student block, "
                f"teacher block], 0-based, the student's in [0, {n}) (model.num_layers={n})."
            )
    m = model.distill_proj
    if m and t.distill_layers and m[0] != len(t.distill_layers):
        fail(
            f"model.distill_proj={list(m)} holds {m[0]} projections but train.distill_layers "
            f"has {len(t.distill_layers)} pairs; set model.distill_proj=[] (jaxllm train fills "
            "it) or match them."
        )
