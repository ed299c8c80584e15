"""The `train` section: steps, batch, objective and its coefficients, evaluation, logging."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from jaxllm.config.errors import fail as _fail
from jaxllm.config.grpo import CRITIC_FREE, GRPOConfig, validate_grpo
from jaxllm.config.rewards import RewardTermConfig, validate_rewards
from jaxllm.config.rollout import validate_rollout

# The objectives of the DPO family: a loss over (chosen, rejected) pairs of `format: preference`.
PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
# KTO: a loss over examples of `format: unpaired_preference`, each desirable or not.
UNPAIRED_OBJECTIVES = ("kto",)
# Those that compare the policy with a reference model (SimPO and ORPO need none).
REFERENCE_OBJECTIVES = ("dpo", "ipo", "kto")
# Every objective that reads the pairs of `format: preference` sources (a reward model too).
PAIR_OBJECTIVES = (*PREFERENCE_OBJECTIVES, "reward")
# The reinforcement-learning objectives: they sample their own batches (`format: rollout`).
ROLLOUT_OBJECTIVES = (*CRITIC_FREE, "ppo", "online_dpo")


@dataclasses.dataclass(frozen=True)
class EarlyStoppingConfig:
    """`train.early_stopping`: end the run when evaluation stops improving. Each evaluation
    (`train.eval_every`) compares `metric` with its best so far; after `patience` evaluations
    without an improvement of more than `min_delta`, the run writes a checkpoint, logs why,
    and exits 0 saying it stopped early. Its state is saved in every checkpoint, so a resumed
    run stops where the uninterrupted one would."""

    patience: int | None = None
    """Evaluations without improvement before the run stops; null or 0: never stops early."""
    min_delta: float = 0.0
    """An evaluation improves only when it beats the best so far by more than this (>= 0)."""
    metric: str | None = None
    """The eval metric watched (by `checkpoint.keep_best` too); null: the objective's main
    one, `eval_reward` for `grpo` / `ppo` (which log no eval_loss), `eval_loss` for every
    other. Any `eval_<name>` the objective logs may be named (`eval_accuracy` of a reward
    model). A name the objective does not log is refused at its first evaluation (for
    rollout objectives at config load)."""
    mode: Literal["min", "max"] | None = None
    """Whether lower (`min`) or higher (`max`) is better; null: `max` for eval_reward,
    eval_accuracy, eval_margin and eval_chosen_reward, `min` for every other metric (losses)."""


QAT_KINDS = ("int8", "int4", "fp8", "mxfp4", "nvfp4")


@dataclasses.dataclass(frozen=True)
class QATConfig:
    """Quantization-aware training (`jaxllm.compress.qat`): the weights `jaxllm quantize` would
    take are fake-quantized in every forward pass of training and evaluation, with a
    straight-through gradient."""

    weights: Literal["none", "int8", "int4", "fp8", "mxfp4", "nvfp4"] = "none"
    """The kind the weights are rounded to: integer codes on RTN's grid (int8, int4), FP8 E4M3
    per output channel, OCP MXFP4 (E2M1, an E8M0 scale per 32 inputs) or NVFP4 (E2M1, an E4M3
    scale per 16 inputs and one float32 scale per weight); none: off."""
    group_size: int = 0
    """int8 / int4: input channels per scale (0: per output channel), as `quantize.group_size`."""
    symmetric: bool = True
    """int8 / int4: codes around zero; false: a zero point per group, as `quantize.symmetric`."""
    activations: Literal["none", "int8", "fp8"] = "none"
    """The inputs of those weights' matmuls, rounded per token (each row's own scale from its
    largest |x|) as the weight-activation kinds of `jaxllm quantize` do at run time: int8 (the
    W8A8 dot of smoothquant) or fp8 E4M3 (`--method fp8 quantize.fp8_activations=true`); none:
    the compute dtype. The routed experts' inputs stay unrounded, as in a quantized run."""

    @property
    def enabled(self) -> bool:
        return self.weights != "none" or self.activations != "none"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    """Optimizer steps."""
    global_batch_size: int = 16
    """Rows per optimizer step across all devices and microbatches."""
    grad_accum_steps: int = 1
    """Split each global batch into this many microbatches, accumulated inside the jitted step."""
    deterministic: bool = False
    """Bit-identical runs: XLA:GPU's deterministic ops (scatters included) and float32 matmuls
    at full precision (no TF32), seeds from the config (`jaxllm.train.determinism`)."""
    objective: str = "next_token"
    """What the step minimises: `next_token` (cross-entropy over `loss_mask` tokens), `sft`
    (the same loss, named for fine-tuning on chat / prompt_completion sources, whose
    `loss_mask` covers only the assistant turns; on plain text it trains every token), the
    preference losses `dpo`, `ipo`, `simpo`, `orpo` (on `format: preference` sources), `kto`
    (on `format: unpaired_preference` sources; `jaxllm.objectives.kto`), `reward`
    (a reward model, `model.head=score`, fitted to the same pairs by the Bradley-Terry loss
    -log sigmoid(r_chosen - r_rejected); `jaxllm.objectives.reward`), `prm` (a process reward
    model, `model.head=score`, scoring each step of `format: stepwise` solutions at its
    separator, fitted to the step labels by binary cross-entropy as TRL's PRMTrainer), `distill`
    (match `train.teacher`), the rollout objectives `grpo` (and its presets `dr_grpo`, `dapo`,
    `gspo`), `rloo`, `reinforce_pp`, `ppo` and `online_dpo` (on `format: rollout` sources;
    `jaxllm.objectives.rollout`, `train.grpo`), `mlm` (masked LM, BERT: an encoder,
    `model.kind=encoder`, predicts the tokens `jaxllm.data.mlm` hid), `prefix_lm` (a decoder
    reads each example's prefix, its prompt or a drawn length of text, bidirectionally and
    learns what follows; `jaxllm.data.objective_rows`), `span_corruption` (T5's denoising of
    `model.kind=encoder_decoder`; `data.span_corruption`), or your own objective
    function as `MODULE:NAME` or `path/to/file.py:NAME` (see `jaxllm.objectives`)."""
    mask_rate: float = 0.15
    """`mlm`: the share of real tokens (neither padding nor BOS / EOS) selected for prediction,
    each independently; of those 80% become the mask token, 10% a random token and 10% stay."""
    mask_token_id: int | None = None
    """`mlm`: the id that hides a selected token. Null: the tokenizer's mask token ([MASK],
    <mask>), or for a tokenizer without one (the byte tokenizer) the first id past its
    vocabulary (258 for bytes), which model.vocab_size must hold; an id here overrides both."""
    beta: float = 0.1
    """The preference losses' coefficient: DPO's and KTO's beta (the inverse temperature of the
    implicit reward), IPO's tau (the target margin is 1 / (2 tau)), SimPO's beta, ORPO's lambda (the
    weight of the odds-ratio term); `grpo` / `ppo`: the weight of the KL to `train.reference` (0 holds
    no reference)."""
    label_smoothing: float = 0.0
    """`dpo`: the probability that a pair's labels are flipped (conservative DPO, cDPO);
    0 is plain DPO. In [0, 0.5)."""
    simpo_gamma: float = 0.5
    """`simpo`: the target reward margin gamma (the loss is -log sigmoid(beta * margin -
    gamma), as TRL's CPOTrainer writes it with gamma / beta inside the bracket)."""
    desirable_weight: float = 1.0
    """`kto`: the weight lambda_D of the desirable examples' losses (> 0; TRL's name)."""
    undesirable_weight: float = 1.0
    """`kto`: the weight lambda_U of the undesirable examples' losses (> 0; TRL's name)."""
    reference: str | None = None
    """The reference model of `dpo` / `ipo` / `kto` / `grpo`: a run directory, a checkpoint step, or a Hugging
    Face directory, held frozen and sharded on the same mesh. Null: the run's starting point,
    `checkpoint.init_from`; under `peft` the base itself with the adapters switched off, so no
    second copy is held."""
    precompute_reference: bool = False
    """Compute the reference's log-probabilities of every training row once, before training,
    and store them in the run directory instead of holding the reference model during
    training (a forward pass of it per row, once, against its weights' memory on every step)."""
    teacher: str | None = None
    """`distill`: the teacher, a run directory, a checkpoint step, or a Hugging Face
    directory, frozen and sharded on the same mesh. It may differ from the student in depth
    and width but must share its vocabulary."""
    distill_loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """`distill`: KL(teacher || student) (Hinton et al.), KL(student || teacher) (MiniLLM), or
    the generalized Jensen-Shannon divergence of GKD with `distill_jsd_beta`."""
    distill_temperature: float = 1.0
    """`distill`: both distributions are softened by this temperature; the divergence is
    multiplied by its square so gradients keep their scale (Hinton et al.)."""
    distill_jsd_beta: float = 0.5
    """`distill_loss: jsd`: the mixture weight beta of GKD's generalized JSD, in (0, 1):
    near 0 it behaves as forward KL, near 1 as reverse KL."""
    distill_weight: float = 1.0
    """`distill`: the loss is distill_weight x divergence + (1 - distill_weight) x next-token
    cross-entropy on the data's targets. In [0, 1]."""
    distill_lambda: float = 0.0
    """`distill`: GKD's lambda (TRL's `lmbda`), the share of batches that are on-policy: the
    student's own completions of the data's prompts (chat / prompt_completion sources), sampled
    at `rollout_temperature` up to `max_completion_tokens`; the other batches are the data's.
    In [0, 1]; 0 trains on the data alone (`jaxllm.objectives.rollout.onpolicy`)."""
    distill_hidden_weight: float = 0.0
    """`distill`: the weight of feature distillation, the mean squared error between teacher
    hidden states and the student's mapped into the teacher's width by learned projections
    (`model.distill_proj`), added to the loss; >= 0, 0: off."""
    distill_layers: tuple[tuple[int, ...], ...] = ()
    """`distill` with `distill_hidden_weight` > 0: the pairs [student block, teacher block]
    (0-based; each block's output) whose hidden states are matched. []: TinyBERT's uniform map,
    min(S, T) pairs evenly spaced over both stacks, the last blocks paired."""
    num_generations: int = 8
    """`grpo` / `ppo`: completions sampled per prompt (the group G); global_batch_size rows are
    global_batch_size / G prompts, so G must divide it (PPO
    may sample 1)."""
    max_completion_tokens: int = 64
    """`grpo` / `ppo` / on-policy `distill`: tokens sampled per completion at most (fewer when
    EOS comes first); the longest prompt plus this must fit a row of data.seq_len + 1 tokens.
    Dr. GRPO's constant normaliser."""
    rollout_temperature: float = 1.0
    """`grpo` / `ppo` / on-policy `distill`: the sampling temperature of the rollouts (> 0)."""
    updates_per_rollout: int = 1
    """`grpo` / `ppo`: optimizer steps on each rollout's batch (GRPO's mu, PPO's epochs): the
    first is on-policy (the ratio is 1), the later ones move pi away from pi_old, where the
    clipped ratio acts. Each is one train step (`train.steps` counts updates)."""
    rollout_ahead: int = 0
    """`grpo` / `ppo`: 0 samples each rollout from the parameters it trains; 1 is one step
    off-policy (verl's one-step-off-policy, TRL's async GRPO): the next rollout is sampled
    from the parameters before the current update, in a background thread while it runs,
    and pi_old is the sampling policy's."""
    clip_epsilon: float = 0.2
    """`grpo` / `ppo`: the ratio exp(log pi - log pi_old) is clipped to [1 - eps, 1 + eps] (PPO)."""
    reward: str = "exact_match"
    """`grpo` / `ppo`: how a completion is scored, on the host: `exact_match` (1 when the completion,
    stripped, equals the record's answer), `regex:PATTERN` (1 when PATTERN's first match in the
    completion, its group 1 if it has one, equals the answer), or `MODULE:NAME` /
    `path/to/file.py:NAME`, a function (prompts, completions, answers) -> rewards (floats),
    e.g. one that runs a unit test; or a reward model: the directory of a `train.objective=reward`
    run or a Hugging Face `*ForSequenceClassification` export, sharing the policy's tokenizer,
    held frozen on the mesh and read at each completion's last token, or of a `prm` run (the
    lowest of its steps' scores; `jaxllm.objectives.rollout.scoring`)."""
    rewards: tuple[RewardTermConfig, ...] = ()
    """A weighted list of rewards instead of `train.reward`, each logged by name (`.rewards`)."""
    grpo: GRPOConfig = GRPOConfig()
    """The critic-free objectives' loss options, by TRL's names (`jaxllm.config.grpo`)."""
    moved_keys: ClassVar[dict[str, str]] = {
        "grpo_normalization": "grpo.loss_type (sequence: grpo; dr_grpo: train.objective=dr_grpo)"
    }
    gae_gamma: float = 1.0
    """`ppo`: the discount gamma of GAE over a completion's tokens, in [0, 1]."""
    gae_lambda: float = 0.95
    """`ppo`: GAE's lambda, in [0, 1]: 1 is the Monte-Carlo return minus V, 0 the one-step
    TD error."""
    value_coef: float = 0.1
    """`ppo`: the weight c_v of the clipped value loss beside the policy loss (> 0)."""
    value_clip: float = 0.2
    """`ppo`: the value head's new estimate is clipped to within this of the rollout's (> 0)."""
    z_loss: float = 0.0
    """Weight of the z-loss (log of the softmax normaliser squared) added to the loss
    (`next_token`, `sft`, `mlm`, `prefix_lm` and `span_corruption` objectives)."""
    loss_chunks: int = 1
    """`next_token`, `sft`, `mlm`, `prefix_lm`: run the LM head and the cross-entropy on
    data.seq_len / loss_chunks tokens of each row at a time, each chunk recomputed in the
    backward, so the [batch, seq, vocab] float32 logits never exist at once (with a large
    vocabulary, the largest activation of the step). Same loss and gradients; must divide
    data.seq_len."""
    memory_budget: float = 0.9
    """`model.remat=auto`: the fraction in (0, 1] of one device's memory (`device_memory`) the
    compiled train step may use; the first policy whose step fits is taken."""
    device_memory: str | None = None
    """`model.remat=auto`: one device's memory as a size (80GiB); null: what the device
    reports (its allocator's limit), which a CPU does not, so CPU runs give it here."""
    log_every: int = 10
    """Write a metrics line every this many steps."""
    eval_every: int = 50
    """Evaluate on the held-out split every this many steps; 0 evaluates only at the end."""
    eval_batches: int = 8
    """Batches of the held-out split per evaluation."""
    sample_prompt: str = "def __init__(self"
    """Prompt of the greedy continuation printed at the end of training ("" skips it; a
    reward model, `model.head=score`, generates nothing)."""
    sample_tokens: int = 96
    """Length of that continuation in tokens."""
    nonfinite: Literal["skip", "stop"] = "stop"
    """A step whose loss or gradients are NaN/Inf never updates the state (done inside the
    jitted step); `skip` goes on with the next batch, `stop` ends the run after
    `nonfinite_patience` such steps in a row, with a checkpoint of the last good state."""
    nonfinite_patience: int = 1
    """Consecutive non-finite steps tolerated before `stop` ends the run."""
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    """Stop when evaluation no longer improves (`EarlyStoppingConfig`)."""
    qat: QATConfig = QATConfig()
    """Quantization-aware training (`QATConfig`)."""
    grad_compression: Literal["none", "topk", "dgc", "qsgd", "tagc"] = "none"
    """What the data-parallel gradient exchange sends (`jaxllm.parallel.grad_compression`):
    `topk` (each replica's largest `grad_compression_ratio` share of every tensor, values and
    indices, with error feedback), `dgc` (Deep Gradient Compression: the same with momentum
    correction and masking, local clipping and a sparsity warm-up; with `optim.name=sgd` and
    `optim.momentum`), `qsgd` (stochastic quantisation to `grad_compression_bits`), `tagc`
    (TAGC: the feed-forward weights sparsified by a threshold ladder with error feedback, a
    shared index and a summed packed vector); none: the usual all-reduce. Needs a mesh with
    data parallelism only."""
    grad_compression_ratio: float = 0.01
    """`topk` / `dgc`: the share of each gradient tensor's entries a replica sends; `tagc`: the
    share its sparsification keeps (the packed vector has twice as many slots). In (0, 1]."""
    grad_compression_warmup: int = 0
    """`dgc`: steps of the sparsity warm-up (densities 25%, 6.25%, 1.56%, 0.39% down to the
    ratio, in equal parts); 0: the ratio from the first step."""
    grad_compression_bits: int = 8
    """`qsgd`: bits per entry, sign included (2..16): 2^(bits-1) - 1 levels per tensor norm."""
    freeze: tuple[str, ...] = ()
    """Parameter groups that do not train (no gradient, update, weight decay or optimizer
    state): any of FREEZE_GROUPS (`jaxllm.model.groups`); under `peft`, the adapters in them."""


FREEZE_GROUPS = ("vision", "projector", "language", "embed", "head")

# The keys only some objectives read: set away from its default for another objective, a key
# would do nothing, which is an error rather than a silent no-op.
OBJECTIVE_KEYS = {
    "beta": (*PREFERENCE_OBJECTIVES, *UNPAIRED_OBJECTIVES, *ROLLOUT_OBJECTIVES),
    "desirable_weight": UNPAIRED_OBJECTIVES,
    "undesirable_weight": UNPAIRED_OBJECTIVES,
    "label_smoothing": ("dpo",),
    "simpo_gamma": ("simpo",),
    "reference": (*REFERENCE_OBJECTIVES, *ROLLOUT_OBJECTIVES),
    "precompute_reference": REFERENCE_OBJECTIVES,
    "teacher": ("distill",),
    "distill_loss": ("distill",),
    "distill_temperature": ("distill",),
    "distill_jsd_beta": ("distill",),
    "distill_weight": ("distill",),
    "distill_lambda": ("distill",),
    "distill_hidden_weight": ("distill",),
    "distill_layers": ("distill",),
    # on-policy distillation samples with these two as well (`jaxllm.config.distill`)
    "max_completion_tokens": (*ROLLOUT_OBJECTIVES, "distill"),
    "rollout_temperature": (*ROLLOUT_OBJECTIVES, "distill"),
    **{
        key: ROLLOUT_OBJECTIVES
        for key in (
            "num_generations",
            "updates_per_rollout",
            "rollout_ahead",
            "reward",
            "rewards",
        )
    },
    "clip_epsilon": (*CRITIC_FREE, "ppo"),
    "loss_chunks": ("next_token", "sft", "mlm", "prefix_lm"),
    "mask_rate": ("mlm",),
    "mask_token_id": ("mlm",),
    **{key: ("ppo",) for key in ("gae_gamma", "gae_lambda", "value_coef", "value_clip")},
}


def validate_train(t: TrainConfig) -> None:
    """The checks of the train section's own keys."""
    if t.objective in ROLLOUT_OBJECTIVES:
        if not t.beta >= 0:
            _fail(f"train.beta (the KL weight of {t.objective}) must be >= 0, not {t.beta}.")
        validate_rollout(t)
    elif not t.beta > 0:
        _fail(f"train.beta must be positive, not {t.beta}.")
    for g in t.freeze:
        if g not in FREEZE_GROUPS:
            _fail(f"train.freeze: {g!r} is not a group; use {', '.join(FREEZE_GROUPS)}.")
    if not 0 <= t.label_smoothing < 0.5:
        _fail(f"train.label_smoothing must be in [0, 0.5), not {t.label_smoothing}.")
    for key, readers in OBJECTIVE_KEYS.items():
        custom = ":" in t.objective  # an objective of your own may read any of them
        if (
            not custom
            and t.objective not in readers
            and getattr(t, key) != getattr(TrainConfig, key)
        ):
            _fail(
                f"train.{key} has no effect with train.objective={t.objective}; it belongs to "
                f"{', '.join(readers)}."
            )
    validate_grpo(t)
    if t.loss_chunks < 1:
        _fail(f"train.loss_chunks must be >= 1, not {t.loss_chunks}.")
    q = t.qat
    if q.group_size < 0:
        _fail(f"train.qat.group_size must be >= 0 (0: per channel), not {q.group_size}.")
    if q.weights in ("fp8", "mxfp4", "nvfp4") and (q.group_size or not q.symmetric):
        _fail(
            f"train.qat.weights={q.weights} has a fixed grid: it takes no train.qat.group_size "
            "and no train.qat.symmetric=false."
        )
    if q.weights == "none" and (q.group_size or not q.symmetric):
        _fail("train.qat.group_size and train.qat.symmetric need train.qat.weights.")
    if not 0 < t.mask_rate < 1:
        _fail(f"train.mask_rate must be in (0, 1), not {t.mask_rate}.")
    if t.mask_token_id is not None and t.mask_token_id < 0:
        _fail(f"train.mask_token_id must be >= 0 or null, not {t.mask_token_id}.")
    if not t.distill_temperature > 0:
        _fail(f"train.distill_temperature must be positive, not {t.distill_temperature}.")
    if not 0 < t.distill_jsd_beta < 1:
        _fail(
            f"train.distill_jsd_beta must be in (0, 1), not {t.distill_jsd_beta}; for its "
            "limits use train.distill_loss=forward_kl (0) or reverse_kl (1)."
        )
    if t.distill_loss != "jsd" and t.distill_jsd_beta != TrainConfig.distill_jsd_beta:
        _fail(
            f"train.distill_jsd_beta has no effect with train.distill_loss={t.distill_loss}; "
            "it belongs to train.distill_loss=jsd."
        )
    if not 0 <= t.distill_weight <= 1:
        _fail(f"train.distill_weight must be in [0, 1], not {t.distill_weight}.")
    validate_early_stopping(t)
    validate_rewards(t)
    if t.objective == "distill" and not t.teacher:
        _fail(
            "train.objective=distill needs train.teacher: a run directory or a Hugging Face "
            "directory of the teacher."
        )


def watched_metric(t: TrainConfig) -> str:
    """The eval metric `train.early_stopping` and `checkpoint.keep_best` watch."""
    if t.early_stopping.metric is not None:
        return t.early_stopping.metric
    return "eval_reward" if t.objective in ROLLOUT_OBJECTIVES else "eval_loss"


def validate_early_stopping(t: TrainConfig) -> None:
    """The checks of `train.early_stopping` that need nothing but the train section."""
    es = t.early_stopping
    if es.patience is not None and es.patience < 0:
        _fail(f"train.early_stopping.patience must be >= 0 (0 or null: off), not {es.patience}.")
    if not es.min_delta >= 0:
        _fail(f"train.early_stopping.min_delta must be >= 0, not {es.min_delta}.")
    if es.metric is not None and not es.metric.startswith("eval_"):
        _fail(
            f"train.early_stopping.metric={es.metric} is not an eval metric; name one the "
            "objective logs at evaluation, e.g. eval_loss."
        )
    if t.objective in ROLLOUT_OBJECTIVES and watched_metric(t) != "eval_reward":
        _fail(
            f"train.early_stopping.metric={es.metric}: train.objective={t.objective} evaluates "
            "only eval_reward (the greedy completions' mean reward); set "
            "train.early_stopping.metric=eval_reward."
        )


def validate_evaluated(t: TrainConfig, data, keep_best: bool) -> None:
    """`train.early_stopping` and `checkpoint.keep_best` watch periodic evaluations: refused
    when the run evaluates only at its end (`train.eval_every=0`) or has nothing held out."""
    users = [
        k
        for k, on in (
            ("train.early_stopping.patience", t.early_stopping.patience),
            ("checkpoint.keep_best", keep_best),
        )
        if on
    ]
    if not users:
        return
    need = " and ".join(users) + (" need" if len(users) > 1 else " needs")
    if t.eval_every == 0:
        _fail(
            f"{need} periodic evaluation, but train.eval_every=0 evaluates "
            "only at the end; set train.eval_every to a number of steps."
        )
    rollout = t.objective in ROLLOUT_OBJECTIVES
    if not data.eval_sources and (rollout or data.eval_fraction == 0):
        _fail(
            f"{need} a held-out split, but "
            + (
                "data.eval_sources is empty (rollout objectives evaluate only its prompts)."
                if rollout
                else "data.eval_sources is empty and data.eval_fraction=0."
            )
        )
