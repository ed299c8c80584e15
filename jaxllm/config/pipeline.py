"""The checks of pipeline parallelism's keys (`mesh.stage`, `mesh.pipeline_schedule`,
`mesh.virtual_stages`, `mesh.pipeline_microbatches`) against the model, the objective and the
batch, and the one number of microbatches a step splits its batch into.

Gradient accumulation and the pipeline's microbatches are one concept: the step splits the
global batch into `microbatches(cfg)` microbatches whether it accumulates them one after the
other (mesh.stage = 1) or streams them through the stages (mesh.stage > 1)."""

from __future__ import annotations

from jaxllm.config.errors import fail as _fail

# The objectives whose loss is a sum over tokens of the last stage's logits.
PIPELINE_OBJECTIVES = ("next_token", "sft")
# Schedules of the 1F1B family: they start backwards after mesh.stage forwards.
ONE_F_ONE_B = ("1f1b", "interleaved", "zero_bubble")


def microbatches(cfg) -> int:
    """Microbatches of one step: mesh.pipeline_microbatches when set, else
    train.grad_accum_steps."""
    n = cfg.mesh.pipeline_microbatches
    return cfg.train.grad_accum_steps if n is None else n


def validate_pipeline(cfg, stages: int | None) -> None:
    """ConfigError naming the keys when the pipeline settings cannot run this config;
    `stages`: the mesh's stage degree (None before the device count is known)."""
    mesh, m, t = cfg.mesh, cfg.model, cfg.train
    n = mesh.pipeline_microbatches
    if n is not None and n < 1:
        _fail(f"mesh.pipeline_microbatches must be >= 1 (null: train.grad_accum_steps), not {n}.")
    if n is not None and t.grad_accum_steps not in (1, n):
        _fail(
            f"mesh.pipeline_microbatches ({n}) and train.grad_accum_steps ({t.grad_accum_steps}) "
            "name the same microbatches and disagree; set one of them."
        )
    if mesh.virtual_stages < 1:
        _fail(f"mesh.virtual_stages must be >= 1, not {mesh.virtual_stages}.")
    if mesh.virtual_stages > 1 and mesh.pipeline_schedule != "interleaved":
        _fail(
            f"mesh.virtual_stages={mesh.virtual_stages} needs mesh.pipeline_schedule=interleaved, "
            f"not {mesh.pipeline_schedule}."
        )
    if m.fp8 == "delayed" and (stages or mesh.stage) > 1:
        _fail(
            "model.fp8_scaling=delayed records its amaxes through the unpipelined step; with "
            "mesh.stage > 1 use model.fp8_scaling=current or blockwise."
        )
    if stages is None or stages == 1:
        if stages == 1 and (mesh.pipeline_schedule != "1f1b" or mesh.virtual_stages != 1):
            _fail(
                "mesh.pipeline_schedule and mesh.virtual_stages act only with mesh.stage > 1; "
                "set mesh.stage, or reset them (mesh.pipeline_schedule=1f1b "
                "mesh.virtual_stages=1), as when resuming a pipelined run without stages."
            )
        return
    schedule = mesh.pipeline_schedule
    if schedule == "dualpipe" and stages % 2:
        _fail(
            f"mesh.pipeline_schedule=dualpipe runs two pipelines that meet in the middle and "
            f"needs an even mesh.stage, not {stages}; use dualpipev for an odd one."
        )
    v_shape = schedule == "dualpipev"  # two chunks per stage, placed as a V
    chunks = stages * (2 if v_shape else mesh.virtual_stages)
    if v_shape:
        count = f"2 * mesh.stage (2 * {stages} = {chunks})"
    else:
        count = f"mesh.stage * mesh.virtual_stages ({stages} * {mesh.virtual_stages} = {chunks})"
    moe = m.moe
    if moe.enabled:  # the stages split the MoE groups; the dense prefix goes with the embedding
        groups = (m.num_layers - moe.first_dense_layers) // moe.moe_every
        if groups % chunks:
            _fail(
                f"model.moe's {groups} MoE groups ((model.num_layers - "
                "model.moe.first_dense_layers) / model.moe.moe_every) must be divisible by "
                f"{count}."
            )
        if moe.first_dense_layers % stages:
            _fail(
                f"model.moe.first_dense_layers ({moe.first_dense_layers}) must be divisible by "
                f"mesh.stage ({stages}): the first stage runs them, and between steps they are "
                "stored split over the stages like the other stacked blocks."
            )
    elif m.num_layers % chunks:
        _fail(f"model.num_layers ({m.num_layers}) must be divisible by {count}.")
    micro = microbatches(cfg)
    if mesh.pipeline_schedule in ONE_F_ONE_B and micro < stages:
        _fail(
            f"mesh.pipeline_schedule={mesh.pipeline_schedule} needs at least mesh.stage "
            f"({stages}) microbatches, not {micro}; raise mesh.pipeline_microbatches."
        )
    if schedule in ("dualpipev", "dualpipe") and micro < 2 * stages:
        _fail(
            f"mesh.pipeline_schedule={schedule} needs at least 2 * mesh.stage ({2 * stages}) "
            f"microbatches, not {micro}; raise mesh.pipeline_microbatches."
        )
    if schedule == "dualpipe" and micro % 2:
        _fail(
            f"mesh.pipeline_schedule=dualpipe sends half the microbatches each way; make "
            f"mesh.pipeline_microbatches ({micro}) even."
        )
    if mesh.pipeline_schedule == "interleaved" and micro % stages:
        _fail(
            f"mesh.pipeline_schedule=interleaved runs microbatches in groups of mesh.stage "
            f"({stages}); make mesh.pipeline_microbatches ({micro}) a multiple of it."
        )
    if t.objective not in PIPELINE_OBJECTIVES:
        _fail(
            f"mesh.stage > 1 pipelines the token-level objectives "
            f"({', '.join(PIPELINE_OBJECTIVES)}), not train.objective={t.objective}."
        )
    if m.kind != "decoder":
        _fail(
            f"mesh.stage > 1 pipelines decoder models, not model.kind={m.kind}; use mesh.stage=1."
        )
