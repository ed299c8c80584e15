"""`Config`: every section together, and the checks that span sections (batch vs mesh, heads
vs tensor degree, cache vs model)."""

from __future__ import annotations

import dataclasses
import math
import warnings

from jaxllm.config.checkpoint import CheckpointConfig, validate_checkpoint
from jaxllm.config.data_order import validate_order
from jaxllm.config.distill import validate_features, validate_on_policy
from jaxllm.config.errors import JaxllmWarning
from jaxllm.config.errors import fail as _fail
from jaxllm.config.grad_compression import validate_grad_compression
from jaxllm.config.memory_budget import validate_memory_budget
from jaxllm.config.model import ModelConfig
from jaxllm.config.optim import (
    OptimConfig,
    validate_optim,
    validate_param_groups,
    validate_schedule,
)
from jaxllm.config.overlap import validate_overlap
from jaxllm.config.peft import PeftConfig
from jaxllm.config.pipeline import microbatches, validate_pipeline
from jaxllm.config.prune import PruneConfig
from jaxllm.config.quantize import QuantizeConfig
from jaxllm.config.sections import (
    DataConfig,
    GenerateConfig,
    MeshConfig,
    RunConfig,
    mesh_degrees,
)
from jaxllm.config.seq2seq import validate_span_corruption
from jaxllm.config.sequence import validate_sequence, validate_tensor_sequence
from jaxllm.config.tensor2 import validate_tensor2
from jaxllm.config.trackers import validate_trackers
from jaxllm.config.train import (
    PAIR_OBJECTIVES,
    ROLLOUT_OBJECTIVES,
    UNPAIRED_OBJECTIVES,
    TrainConfig,
    validate_evaluated,
    validate_train,
)
from jaxllm.config.unpaired_online import validate_kto_online
from jaxllm.config.urls import validate_urls

# The keys of `optim.loss_scale`, the ones static scaling ignores after the first.
# Formats of JSONL / Parquet examples, which the stdlib corpus cannot hold.
EXAMPLE_FORMATS = ("chat", "prompt_completion", "preference", "unpaired_preference", "stepwise")
_LOSS_SCALE_KEYS = (
    "loss_scale_init",
    "loss_scale_growth_interval",
    "loss_scale_growth",
    "loss_scale_backoff",
)


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run. Each section is passed only to the component that owns it."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    generate: GenerateConfig = GenerateConfig()
    peft: PeftConfig = PeftConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    prune: PruneConfig = PruneConfig()

    def validate(self, num_devices: int | None = None) -> Config:
        """Checks combinations no field type can express; returns self or raises ConfigError."""
        m, t = self.model, self.train
        m.validate()  # the model's own keys (sizes, heads, dtypes, ...) first
        positive = {
            "data.seq_len": self.data.seq_len,
            "train.steps": t.steps,
            "train.global_batch_size": t.global_batch_size,
            "train.grad_accum_steps": t.grad_accum_steps,
            "train.log_every": t.log_every,
            "train.eval_batches": t.eval_batches,
        }
        for key, value in positive.items():
            if value < 1:
                _fail(f"{key} must be at least 1, not {value}.")
        if t.loss_chunks >= 1 and self.data.seq_len % t.loss_chunks:
            _fail(
                f"train.loss_chunks ({t.loss_chunks}) must divide data.seq_len "
                f"({self.data.seq_len})."
            )
        if t.eval_every < 0 or t.sample_tokens < 0 or self.optim.warmup_steps < 0:
            _fail("train.eval_every, train.sample_tokens and optim.warmup_steps must be >= 0.")
        self._validate_values()
        validate_evaluated(t, self.data, self.checkpoint.keep_best)
        self._validate_kind()
        self.peft.validate()
        for g in ("vision", "projector"):  # the rest by the parameters (`model.groups`)
            if g in t.freeze and m.vision is None:
                _fail(f"train.freeze: {g} holds no trainable parameter: model.vision is null.")
        self.quantize.validate()
        self.prune.validate()
        if self.train.qat.enabled and self.peft.method != "none":
            _fail(
                "train.qat rounds the weights that train and their inputs; "
                f"peft.method={self.peft.method} freezes them. Use one or the other."
            )
        routed = m.moe.enabled and m.moe.dispatch == "dropless"
        if self.mesh.dropless_dispatch != "all_gather" and not routed:
            _fail(
                "mesh.dropless_dispatch moves the tokens of dropless MoE layers: set "
                "model.moe.num_experts and model.moe.dispatch=dropless, or leave it at all_gather."
            )
        if self.train.qat.enabled and self.mesh.stage > 1:
            _fail("train.qat does not run under pipeline stages (mesh.stage > 1) yet.")
        gen = self.generate
        if gen.max_new_tokens < 1 or gen.temperature < 0 or gen.top_k < 0:
            _fail("generate.max_new_tokens must be >= 1, generate.temperature and top_k >= 0.")
        if not 0 < gen.top_p <= 1:
            _fail(f"generate.top_p must be in (0, 1], not {gen.top_p}.")
        if gen.kv_group < 1 or gen.kv_page_size < 0:
            _fail("generate.kv_group must be >= 1 and generate.kv_page_size >= 0.")
        if gen.decode_impl == "kernel" and m.mla.enabled:
            _fail(
                "generate.decode_impl=kernel: the decode kernels read separate keys and values; "
                "MLA's latent cache decodes with xla (auto picks it)."
            )
        kivi, hd = gen.kv_cache_dtype in ("int4", "int2"), m.resolved_head_dim
        if kivi and m.mla.enabled:
            _fail(
                f"generate.kv_cache_dtype={gen.kv_cache_dtype} (KIVI: keys per channel, values "
                "per token) cannot quantize MLA's latent, which is key and value at once; use "
                "int8 or bfloat16."
            )
        if kivi and hd % min(gen.kv_group, hd):
            _fail(
                f"generate.kv_group ({gen.kv_group}) must divide the head dim "
                f"({hd}) for the {gen.kv_cache_dtype} cache's per-token value groups."
            )
        if gen.kv_cache_dtype == "int2" and min(gen.kv_group, hd) % 4:
            _fail(
                f"generate.kv_cache_dtype=int2 packs four codes a byte: its value group, "
                f"min(generate.kv_group, head dim) = {min(gen.kv_group, hd)}, must be a "
                "multiple of 4."
            )
        if gen.kv_page_size and gen.kv_page_size % gen.kv_group:
            _fail(
                f"generate.kv_page_size ({gen.kv_page_size}) must be a multiple of "
                f"generate.kv_group ({gen.kv_group})."
            )
        validate_span_corruption(self)
        self._validate_head()
        validate_sequence(self, None)
        if self.data.seq_len > m.max_seq_len - m.encoder.position_offset:
            _fail(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}) "
                f"less model.encoder.position_offset ({m.encoder.position_offset}); lower "
                "data.seq_len or raise model.max_seq_len."
            )
        n_micro = microbatches(self)
        validate_pipeline(self, None)
        if t.global_batch_size % n_micro:
            _fail(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"train.grad_accum_steps / mesh.pipeline_microbatches ({n_micro})."
            )
        if num_devices is not None:
            degrees = mesh_degrees(self.mesh, num_devices)
            validate_pipeline(self, degrees["stage"])
            dp = degrees["data"] * degrees["fsdp"] * degrees["expert"]
            micro = t.global_batch_size // n_micro
            if micro % dp:
                _fail(
                    f"train.global_batch_size ({t.global_batch_size}) / microbatches "
                    f"({n_micro}) = {micro} rows per microbatch is not divisible by the "
                    f"data-parallel size mesh.data * mesh.fsdp * mesh.expert = {dp}; use a "
                    f"multiple of {dp}."
                )
            if self.mesh.zero_stage and degrees["data"] == 1:
                _fail(
                    f"mesh.zero_stage={self.mesh.zero_stage} shards over mesh.data, which is 1 "
                    f"on {num_devices} device(s); give mesh.data a degree > 1 or drop "
                    "mesh.zero_stage (mesh.fsdp is ZeRO stage 3)."
                )
            if m.moe.enabled and m.moe.num_experts % degrees["expert"]:
                _fail(
                    f"mesh.expert ({degrees['expert']}) must divide model.moe.num_experts "
                    f"({m.moe.num_experts})."
                )
            if m.num_heads % degrees["tensor"] or m.num_kv_heads % degrees["tensor"]:
                _fail(
                    f"mesh.tensor ({degrees['tensor']}) must divide model.num_heads "
                    f"({m.num_heads}) and model.num_kv_heads ({m.num_kv_heads})."
                )
            la = m.linear_attention
            if la.enabled and (degrees["sequence"] > 1 or degrees["stage"] > 1):
                _fail(
                    "linear-attention layers (model.layer_pattern) carry their state along the "
                    "whole sequence on one shard and scan the pattern in one stack: set "
                    "mesh.sequence=1 and mesh.stage=1."
                )
            if la.enabled and (
                la.num_k_heads % degrees["tensor"] or la.num_v_heads % degrees["tensor"]
            ):
                _fail(
                    f"mesh.tensor ({degrees['tensor']}) must divide model.linear_attention."
                    f"num_k_heads ({la.num_k_heads}) and num_v_heads ({la.num_v_heads})."
                )
            validate_sequence(self, degrees)
            if self.data.seq_len % degrees["sequence"]:
                _fail(
                    f"data.seq_len ({self.data.seq_len}) must be divisible by mesh.sequence "
                    f"({degrees['sequence']})."
                )
            if self.mesh.tensor_sequence_parallel:
                validate_tensor_sequence(self, degrees)
            validate_tensor2(self, degrees)
        validate_overlap(self, None if num_devices is None else degrees)
        return self

    def _validate_kind(self) -> None:
        """Built-in objectives fit the model's kind: an encoder sees every token, so it trains
        only with `mlm`, which in turn needs one (an objective of your own may do either)."""
        kind, objective = self.model.kind, self.train.objective
        if ":" in objective:
            return
        if objective == "mlm" and kind != "encoder":
            _fail(
                f"train.objective=mlm predicts hidden tokens from both sides: it needs "
                f"model.kind=encoder, not {kind}."
            )
        if objective == "prefix_lm":
            m = self.model
            if kind != "decoder":
                _fail(f"train.objective=prefix_lm trains a decoder (model.kind={kind}).")
            if m.attention_impl in ("flash", "cudnn") or self.mesh.sequence_attention in (
                "ring",
                "usp",
            ):
                _fail(
                    "train.objective=prefix_lm's prefix mask runs on the xla attention: set "
                    "model.attention_impl to xla or auto and mesh.sequence_attention to all_gather or ulysses."
                )
        if kind == "encoder" and objective != "mlm":
            _fail(
                f"train.objective={objective} predicts each token from those before it, which "
                "a bidirectional model (model.kind=encoder) sees; use train.objective=mlm."
            )

    def _validate_head(self) -> None:
        """A reward model's score head trains whole: with peft.method=none, or beside LoRA
        adapters under `peft.modules_to_save=[score]` (as PEFT's sequence classification).
        Whether the head fits the objective is checked where the objective is chosen
        (`jaxllm.objectives.from_config`): an imported reward model's run is valid before any
        objective is given to it."""
        p = self.peft
        if self.model.head == "score" and p.method != "none" and "score" not in p.modules_to_save:
            fix = " add peft.modules_to_save=[score] or" if p.lora else ""
            _fail(
                f"peft.method={p.method} would leave the score head frozen;{fix} train the "
                "reward model with peft.method=none."
            )

    def _validate_values(self) -> None:
        """Values no type can refuse but no run can use: an empty run directory, a NaN or
        negative learning rate, a checkpoint period of 0, a negative worker count, ..."""
        if not self.run.dir.strip():
            _fail("run.dir is empty; name a directory for the run (e.g. run.dir=runs/mine).")
        validate_trackers(self.run.trackers, self.run.wandb, self.run.mlflow)
        validate_optim(self.optim, self.model.param_dtype, self.train.z_loss)
        validate_schedule(self.optim, self.train.steps)
        validate_param_groups(self.optim)
        validate_checkpoint(self.checkpoint, self.peft.method, self.run.dir, self.optim)
        d = self.data
        if d.workers < 0:
            _fail(f"data.workers must be >= 0 (0: in the training process), not {d.workers}.")
        if not 0 <= d.eval_fraction < 1:
            _fail(f"data.eval_fraction must be in [0, 1), not {d.eval_fraction}.")
        if d.max_files is not None and d.max_files < 1:
            _fail(f"data.max_files must be >= 1 (null reads all), not {d.max_files}.")
        for i, src in enumerate((*d.sources, *d.eval_sources)):
            if not math.isfinite(src.weight) or src.weight <= 0:
                _fail(f"data source {src.path!r} has weight {src.weight}; weights must be > 0.")
            if src.format in EXAMPLE_FORMATS and src.path == "stdlib":
                _fail(
                    f"data source stdlib cannot have format {src.format}: give the path of "
                    "JSONL or Parquet examples."
                )
        if not d.sources:
            _fail("data.sources is empty; name at least one corpus.")
        validate_order(d, self.train.objective)
        validate_urls(self)
        self._validate_pairs()
        self._validate_loss_scale()
        if self.train.nonfinite_patience < 1:
            _fail(f"train.nonfinite_patience must be >= 1, not {self.train.nonfinite_patience}.")
        validate_train(self.train)
        validate_memory_budget(self)
        validate_kto_online(self)
        validate_on_policy(self.train, self.data)
        validate_features(self.train, self.model, self.peft)
        validate_grad_compression(self)

    def _validate_pairs(self) -> None:
        """Preference pairs and the objectives that read them go together."""
        objective, d = self.train.objective, self.data
        if ":" in objective:  # an objective of your own reads what it likes
            return
        for src in (*d.sources, *d.eval_sources):
            if (objective in UNPAIRED_OBJECTIVES) != (src.format == "unpaired_preference"):
                _fail(
                    f"train.objective={objective} trains on unpaired preferences, but data "
                    f"source {src.path!r} has format {src.format}; give format: "
                    "unpaired_preference sources."
                    if objective in UNPAIRED_OBJECTIVES
                    else f"data source {src.path!r} holds unpaired preferences, which "
                    f"train.objective={objective} does not read; set train.objective=kto."
                )
            # format: auto is read as preference when its records are pairs (`jaxllm.data.detect`)
            auto = src.format == "auto" and src.path != "stdlib"
            if objective in PAIR_OBJECTIVES and src.format != "preference" and not auto:
                _fail(
                    f"train.objective={objective} trains on preference pairs, but data source "
                    f"{src.path!r} has format {src.format}; give format: preference sources."
                )
            if objective not in PAIR_OBJECTIVES and src.format == "preference":
                _fail(
                    f"data source {src.path!r} holds preference pairs, which "
                    f"train.objective={objective} does not read; set train.objective to one of "
                    f"{', '.join(PAIR_OBJECTIVES)}."
                )
            if (objective == "prm") != (src.format == "stepwise"):
                _fail(
                    f"train.objective=prm trains on step-labelled solutions, but data source "
                    f"{src.path!r} has format {src.format}; give format: stepwise sources."
                    if objective == "prm"
                    else f"data source {src.path!r} holds step-labelled solutions (format: "
                    f"stepwise), which train.objective={objective} does not read; set "
                    "train.objective=prm."
                )
            rollout = objective in ROLLOUT_OBJECTIVES
            if rollout != (src.format == "rollout"):
                _fail(
                    f"train.objective={objective} samples its completions from the prompts of "
                    f"format: rollout sources, but data source {src.path!r} has format "
                    f"{src.format}; give format: rollout sources."
                    if rollout
                    else f"data source {src.path!r} holds rollout prompts, which "
                    f"train.objective={objective} does not read; set train.objective to one of "
                    f"{', '.join(ROLLOUT_OBJECTIVES)}."
                )
        if (objective in PAIR_OBJECTIVES or objective in UNPAIRED_OBJECTIVES) and d.train_on_prompt:
            _fail(
                "data.train_on_prompt does not apply to preference pairs, whose losses compare "
                "the answers only; set it to false."
            )

    def _validate_loss_scale(self) -> None:
        o = self.optim
        mode = o.resolved_loss_scale(self.model.dtype)
        # A key set away from its default where it cannot act is a mistake, not a no-op.
        idle = {"none": _LOSS_SCALE_KEYS, "static": _LOSS_SCALE_KEYS[1:], "dynamic": ()}[mode]
        for key in idle:
            if getattr(o, key) != getattr(OptimConfig, key):
                _fail(
                    f"optim.{key} has no effect with optim.loss_scale={mode} (model.dtype="
                    f"{self.model.dtype}); set optim.loss_scale="
                    f"{'static or dynamic' if key == 'loss_scale_init' else 'dynamic'} or drop it."
                )
        if mode == "none":
            if self.model.dtype == "float16":
                warnings.warn(
                    "model.dtype=float16 with optim.loss_scale=none: small gradients may flush "
                    "to zero in the float16 backward pass; optim.loss_scale=dynamic avoids it.",
                    JaxllmWarning,
                    stacklevel=2,  # one place: a run validates twice, the warning shows once
                )
            return
        if not math.isfinite(o.loss_scale_init) or o.loss_scale_init <= 0:
            _fail(f"optim.loss_scale_init must be a finite number > 0, not {o.loss_scale_init}.")
        if mode == "static":
            return
        if o.loss_scale_init < 1:
            _fail(
                f"optim.loss_scale_init ({o.loss_scale_init}) must be >= 1 with "
                "optim.loss_scale=dynamic, whose scale never goes below 1."
            )
        if o.loss_scale_growth_interval < 1:
            _fail(
                "optim.loss_scale_growth_interval must be >= 1, not "
                f"{o.loss_scale_growth_interval}."
            )
        if not (math.isfinite(o.loss_scale_growth) and o.loss_scale_growth > 1):
            _fail(
                f"optim.loss_scale_growth must be a finite number > 1, not {o.loss_scale_growth}."
            )
        if not 0 < o.loss_scale_backoff < 1:
            _fail(f"optim.loss_scale_backoff must be in (0, 1), not {o.loss_scale_backoff}.")
