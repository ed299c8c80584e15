"""The checks of KTO's and online DPO's keys, which read the `train` and `mesh` sections."""

from __future__ import annotations

from jaxllm.config.errors import fail


def validate_kto_online(cfg) -> None:
    """`kto`: positive class weights; `online_dpo`: a positive beta, groups of two completions
    (the pair), and each pair within one microbatch (no accumulation, no pipeline stages: both
    split the batch by rows)."""
    t = cfg.train
    for key in ("desirable_weight", "undesirable_weight"):
        if not getattr(t, key) > 0:
            fail(f"train.{key} must be positive, not {getattr(t, key)}.")
    if t.objective != "online_dpo":
        return
    if not t.beta > 0:
        fail(f"train.beta (DPO's beta of online_dpo) must be positive, not {t.beta}.")
    if t.num_generations != 2:
        fail(
            "train.objective=online_dpo samples two completions per prompt, ranked into a "
            f"pair: set train.num_generations=2, not {t.num_generations}."
        )
    if t.grad_accum_steps > 1 or cfg.mesh.stage > 1:
        fail(
            "train.objective=online_dpo compares each prompt's two completions within one "
            "batch: set train.grad_accum_steps=1 and mesh.stage=1."
        )
