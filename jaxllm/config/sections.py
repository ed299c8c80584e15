"""The sections besides `model`, `train` and `peft`: run, mesh (with the mesh-degree
arithmetic), optimizer, data, checkpoint and generate."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxllm.config.errors import fail as _fail
from jaxllm.config.seq2seq import SpanCorruptionConfig
from jaxllm.config.trackers import MlflowConfig, Tracker, WandbConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, TensorBoard events, loss.png, checkpoints."""
    seed: int = 0
    """Seed for parameter init and the train-state rng (data order has its own seed)."""
    trackers: tuple[Tracker, ...] = ("jsonl", "tensorboard")
    """Where metrics go: `jsonl` (metrics.jsonl, always kept), `tensorboard` (tensorboard/),
    `wandb` (Weights & Biases, run.wandb.*) and `mlflow` (run.mlflow.*); the last two need the
    `trackers` extra. A resumed run goes on in the same W&B / MLflow run (RUN/trackers.json)."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases: the project (`jaxllm.config.trackers.WandbConfig`)."""
    mlflow: MlflowConfig = MlflowConfig()
    """MLflow: tracking URI and experiment (`jaxllm.config.trackers.MlflowConfig`)."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Degree of each parallelism axis of the device mesh.

    The plain degrees split the devices of one slice / host group joined by the fast network
    (ICI, NVLink); one of them may be -1 to take what is left. The `dcn_*` degrees split the
    slices (or hosts) joined by the slow data-center network, as MaxText's `dcn_*_parallelism`:
    the mesh axis `fsdp` then has size fsdp * dcn_fsdp, slices outermost. The product of all
    degrees must equal the number of devices.
    """

    stage: int = 1
    """PP: pipeline stages, each holding a contiguous slice of the layer stack (the `stage`
    axis, outermost after the dcn axes; `jaxllm.parallel.pipeline`)."""
    data: int = -1
    """DP: replicas that each see a slice of the batch."""
    fsdp: int = 1
    """FSDP / ZeRO-3: batch split as in DP, parameters and optimizer state sharded too."""
    tensor: int = 1
    """TP: heads and MLP hidden units split Megatron-style."""
    sequence: int = 1
    """SP / context parallelism: the sequence axis of activations split."""
    expert: int = 1
    """EP: experts of MoE layers split; outside MoE layers the batch is split over it as over
    `data`."""
    dcn_stage: int = 1
    """Slices the pipeline stages are spread over (cheap: one activation per tick crosses)."""
    dcn_data: int = 1
    """Slices that replicate the model (the usual multi-slice choice: data over DCN)."""
    dcn_fsdp: int = 1
    """Slices the FSDP shards are spread over (costly: parameters cross DCN every layer)."""
    dcn_tensor: int = 1
    """Slices the tensor-parallel shards are spread over (rarely wise)."""
    dcn_sequence: int = 1
    """Slices the sequence shards are spread over."""
    dcn_expert: int = 1
    """Slices the experts are spread over."""
    sequence_attention: Literal["all_gather", "ring", "ulysses", "usp"] = "all_gather"
    """How attention sees keys of other sequence shards: all-gather K/V; ring attention (K/V
    blocks passed around the `sequence` axis, zigzag layout for causal load balance); Ulysses
    (all-to-alls turn length shards into whole sequences of mesh.sequence head groups,
    attention runs per group with every mask and implementation; mesh.tensor * mesh.sequence
    must divide model.num_heads, kv heads are repeated as needed); or `usp`, Ulysses inside
    groups of mesh.sequence_ulysses devices and the ring across the groups."""
    sequence_ulysses: int = 1
    """With sequence_attention=usp: the Ulysses degree, devices per group (it divides
    mesh.sequence; mesh.tensor * it must divide model.num_heads); the ring runs over
    mesh.sequence / it groups. Only usp reads it."""
    tensor_sequence_parallel: bool = False
    """Megatron-style sequence parallelism in the tensor group (Korthikanti et al. 2022): the
    residual stream between blocks and inside them (norms, dropout, residual adds) is split on
    the sequence over `tensor` as well as `sequence`, so its activations take 1 / tensor of
    the bytes; an all-gather comes before each column-parallel matmul and a reduce-scatter
    after each row-parallel one, in place of the all-reduce. Needs mesh.tensor > 1."""
    zero_stage: Literal[0, 1, 2] = 0
    """ZeRO over the `data` axis while parameters stay whole on every replica: 1 shards the
    optimizer state `mesh.data` ways, 2 the gradients too (a reduce-scatter replaces the
    all-reduce; the updated parameters are all-gathered). Stage 3, parameters sharded as well,
    is `mesh.fsdp`. 0: plain data parallelism."""
    pipeline_schedule: Literal[
        "gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipev", "dualpipe"
    ] = "1f1b"
    """With mesh.stage > 1, the order in which stages run forwards and backwards of the
    microbatches (`jaxllm.parallel.schedules`): `gpipe` (all forwards, then all backwards),
    `1f1b`, `interleaved` (1F1B over mesh.virtual_stages chunks per device), `zero_bubble`
    (ZB-H1: input- and weight-gradient passes split, weight passes fill the bubbles) or
    `dualpipev` (DeepSeek's DualPipeV: the stack cut in 2 * mesh.stage chunks placed as a V,
    stage s holding chunks s and 2 * mesh.stage - 1 - s; needs 2 * mesh.stage microbatches) or
    `dualpipe` (DeepSeek-V3's DualPipe: half the microbatches go down the stages, half up, so
    stage s also holds stage mesh.stage - 1 - s's parameters; needs an even mesh.stage and an
    even number of microbatches, at least 2 * mesh.stage)."""
    virtual_stages: int = 1
    """Chunks of the layer stack per stage for the `interleaved` schedule: the stack is cut in
    stage * virtual_stages chunks and stage s holds chunks s, s + stage, ... (circular)."""
    pipeline_microbatches: int | None = None
    """Microbatches the pipeline splits the global batch into; they are the step's gradient
    accumulation microbatches (null: train.grad_accum_steps; set, it is the number of them,
    and train.grad_accum_steps must be 1 or equal)."""
    expert_dispatch: Literal["annotations", "all_to_all"] = "annotations"
    """How capacity-mode MoE layers move token buffers to their experts' devices over
    `expert`: sharding constraints on the buffers, from which XLA makes the all-to-all, or an
    explicit all-to-all under shard_map. Both move the same bytes in every plan of
    docs/benchmarks.md; constraints need less memory with FSDP. Dropless layers: see
    dropless_dispatch."""
    dropless_dispatch: Literal["all_gather", "ragged_all_to_all"] = "all_gather"
    """How dropless MoE layers reach experts on other devices over `expert`: `all_gather`
    every token of the expert group and reduce-scatter the outputs, or send each token only to
    the devices of its chosen experts and back (`jaxllm.model.moe_ragged`) by
    `jax.lax.ragged_all_to_all`; where the backend lacks it (XLA:CPU) by an exact padded
    all-to-all that moves as many bytes as the gather."""
    overlap: tuple[str, ...] = ()
    """Switches that hide collectives behind compute (`jaxllm.train.overlap`):
    `collective_matmul` (Megatron-SP's all-gather before each column-parallel MLP matmul as
    mesh.tensor ring steps under shard_map, each overlapped with a partial matmul; any
    backend), `latency_hiding` (XLA:GPU's latency-hiding scheduler), `async_fusion` (XLA:GPU's
    pipelined collectives, started an iteration early; both GPU-only). Empty: XLA's defaults."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """An optimizer (`name`) with a schedule, global-norm clipping and decoupled weight decay on
    kernels/embeddings. Keys an optimizer does not read must stay at their defaults
    (`OPTIM_READS`; anything else is a config error naming the key)."""

    name: Literal[
        "sgd",
        "adagrad",
        "rmsprop",
        "adam",
        "adamw",
        "adafactor",
        "lion",
        "lamb",
        "sm3",
        "muon",
        "adam_mini",
        "adamw_8bit",
    ] = "adamw"
    """The optimizer (README lists what each keeps per parameter); `adam` is `adamw` without
    weight decay."""
    lr: float = 3e-3
    """Peak learning rate."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warmup: cosine or linear decay to min_lr_ratio * lr, or constant."""
    warmup_steps: int = 15
    """Linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine and linear)."""
    b1: float = 0.9
    """Adam decay rate of the first moment."""
    b2: float = 0.95
    """Adam decay rate of the second moment."""
    eps: float = 1e-8
    """Adam epsilon added to the root of the second moment."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to norm scales or biases."""
    clip_norm: float | None = 1.0
    """Clip gradients to this global L2 norm; null disables clipping."""
    momentum: float = 0.0
    """Heavy-ball momentum of sgd and rmsprop (0: none)."""
    nesterov: bool = False
    """Nesterov momentum (sgd, rmsprop; needs momentum > 0)."""
    amsgrad: bool = False
    """adam/adamw: normalise by the running maximum of the second moment (Reddi et al. 2018)."""
    block_size: Literal[256, 2048] = 2048
    """adamw_8bit: elements per quantization block (one float32 absmax scale per block)."""
    quantization: Literal["dynamic", "linear"] = "dynamic"
    """adamw_8bit code book: bitsandbytes' dynamic tree (fine near 0) or 256 even steps."""
    master_weights: Literal["none", "float32"] = "none"
    """`float32`: the optimizer steps a float32 master copy of the parameters, kept in its state,
    and the stored parameters are the master rounded to `model.param_dtype` (set that to
    bfloat16 or float16 for the classic 2 + 2 + 4 + 8 bytes per parameter of mixed-precision
    Adam). `none`: the optimizer steps the stored parameters."""
    offload: Literal["none", "host"] = "none"
    """`host` keeps the optimizer state (with the master weights, if any) in host memory
    (`pinned_host`) between steps: the step
    copies it to the device for the update and back, so the device holds it only while the
    update runs. Device memory saved for host bandwidth; see README "Memory"."""
    loss_scale: Literal["auto", "dynamic", "static", "none"] = "auto"
    """Multiply the loss (per token: the objective's sum over the token positions of a
    microbatch) by a scale S before differentiation and divide the float32 gradients by S
    before clipping, so small float16 gradients do not flush to zero (see
    `jaxllm.train.loss_scale`). `dynamic` adapts S: a step whose gradients overflow is skipped
    and backs S off, `loss_scale_growth_interval` clean steps grow it; `static` keeps S at
    `loss_scale_init`; `none` does not scale. `auto`: dynamic when model.dtype is float16,
    none for bfloat16 and float32 (their exponent range is float32's, nothing underflows)."""
    loss_scale_init: float = 2.0**15
    """S at the start (dynamic) or always (static); powers of two keep the unscaling exact."""
    loss_scale_growth_interval: int = 2000
    """Dynamic: grow S after this many clean steps in a row."""
    loss_scale_growth: float = 2.0
    """Dynamic: factor S grows by after `loss_scale_growth_interval` clean steps."""
    loss_scale_backoff: float = 0.5
    """Dynamic: factor S shrinks by after a step whose gradients were not finite (never below
    1)."""

    def resolved_loss_scale(self, dtype: str) -> str:
        """`loss_scale` with `auto` resolved for the compute dtype `dtype` (model.dtype)."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if dtype == "float16" else "none"


# The OptimConfig keys (besides lr, schedule, warmup, min_lr_ratio, clip_norm) each optimizer
# reads. A key set away from its default for an optimizer that ignores it is a config error.
OPTIM_READS: dict[str, frozenset[str]] = {
    "sgd": frozenset({"momentum", "nesterov", "weight_decay"}),
    "adagrad": frozenset({"eps", "weight_decay"}),
    "rmsprop": frozenset({"b2", "eps", "momentum", "nesterov", "weight_decay"}),
    "adam": frozenset({"b1", "b2", "eps", "amsgrad"}),
    "adamw": frozenset({"b1", "b2", "eps", "amsgrad", "weight_decay"}),
    "adafactor": frozenset({"weight_decay"}),
    "lion": frozenset({"b1", "b2", "weight_decay"}),
    "lamb": frozenset({"b1", "b2", "eps", "weight_decay"}),
    "sm3": frozenset({"b1", "eps", "weight_decay"}),
    "muon": frozenset({"b1", "b2", "eps", "weight_decay"}),
    "adam_mini": frozenset({"b1", "b2", "eps", "weight_decay"}),
    "adamw_8bit": frozenset({"b1", "b2", "eps", "weight_decay", "block_size", "quantization"}),
}
OPTIM_SPECIFIC = frozenset().union(*OPTIM_READS.values())


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One corpus of a (possibly weighted) mixture."""

    path: str = "stdlib"
    """`stdlib` (the running Python's standard-library sources), a directory, a glob, or a file;
    a directory or glob may mix formats, told apart by extension."""
    format: Literal[
        "auto",
        "stdlib",
        "text",
        "jsonl",
        "parquet",
        "arrayrecord",
        "chat",
        "prompt_completion",
        "preference",
        "rollout",
    ] = "auto"
    """`auto` picks by extension: .jsonl/.json -> jsonl, .parquet, .arrayrecord/.array_record,
    anything else -> text. `chat` and `prompt_completion` are supervised fine-tuning examples
    (rows of a .parquet file, lines of any other file, read as JSONL): a conversation rendered
    by the tokenizer's chat template, or a prompt followed by its completion; the loss covers
    the assistant turns / the completion (see `data.train_on_prompt`). `preference` records
    hold a prompt with a chosen and a rejected answer, for the DPO family and reward models.
    `rollout` records hold a prompt and the answer its completions are checked against, for
    GRPO (`jaxllm.objectives.rollout.sampling`): the model writes the completions."""
    text_field: str = "text"
    """Field holding the document in JSONL lines and Parquet rows."""
    messages_field: str = "messages"
    """`format: chat`: field holding the conversation, a list of {role, content} messages with
    roles system, user and assistant and at least one assistant turn."""
    prompt_field: str = "prompt"
    """`format: prompt_completion`, `preference` and `rollout`: field holding the prompt (a
    string, or for `preference` and `rollout` also a list of chat messages)."""
    completion_field: str = "completion"
    """`format: prompt_completion`: field holding the completion (a string)."""
    chosen_field: str = "chosen"
    """`format: preference`: field holding the preferred answer (a string, or a list of chat
    messages: the assistant turn(s) that follow the prompt)."""
    rejected_field: str = "rejected"
    """`format: preference`: field holding the dispreferred answer, shaped like the chosen."""
    answer_field: str = "answer"
    """`format: rollout`: field holding the reference answer the reward checks a completion
    against (a string; any JSON value is passed to a reward function of your own)."""
    weight: float = 1.0
    """Share of this source in the mixture (normalised over the sources)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are packed into rows."""

    sources: tuple[SourceConfig, ...] = (SourceConfig(),)
    """Training corpora; several make a weighted mixture."""
    eval_sources: tuple[SourceConfig, ...] = ()
    """Held-out corpora; empty holds out `eval_fraction` of the training files instead."""
    tokenizer: str = "byte"
    """`byte` (UTF-8 bytes, no files), a `tokenizer.json` (Hugging Face tokenizers), a
    SentencePiece `.model` file, or `none`: the run has no tokenizer (a Hugging Face model
    imported without tokenizer.json whose vocabulary is smaller than the byte tokenizer's 258
    ids). Such a run computes logits from token ids; whatever must encode or decode text refuses
    it until data.tokenizer names a tokenizer.json."""
    add_bos: bool = True
    """Start every document with the tokenizer's BOS token (also prompt_completion examples; a
    chat example is exactly what its template writes, BOS included or not)."""
    add_eos: bool = True
    """End every document with the tokenizer's EOS token (also prompt_completion examples, where
    it is trained; not chat examples, which end with the template's end-of-turn marker)."""
    packing: Literal["concat", "first_fit"] = "concat"
    """`concat`: documents end to end, cut into rows (long documents split); `first_fit`: whole
    documents placed in the first row with room, padded (documents longer than a row split).
    SFT sources (format chat / prompt_completion) are always placed first-fit and never split:
    see `truncation`."""
    seq_len: int = 256
    """Tokens per row the model sees (rows are packed documents)."""
    eval_fraction: float = 0.05
    """Fraction held out for eval when eval_sources is empty: of each source's files (by a hash of
    their path), or of its records (by a hash of file and record number) when it has too few
    files for that (`jaxllm.data.split`). 0: nothing is held out and the run does not evaluate."""
    max_files: int | None = None
    """Read at most this many files (sorted by path) of each source; null reads all."""
    on_bad_record: Literal["skip", "fail"] = "skip"
    """A JSONL line that is not JSON or lacks the text field, or an SFT example that is
    malformed (a message without a role or string content, an unknown role, no assistant
    turn, a missing prompt or completion): count, warn once per source and skip, or stop
    naming the file and line."""
    train_on_prompt: bool = False
    """SFT sources: the loss covers the whole example (system and user turns, prompts) instead
    of only the assistant turns / completions."""
    truncation: Literal["truncate", "drop"] = "truncate"
    """An SFT example longer than a row (more than seq_len + 1 tokens: a row makes seq_len
    predictions): `truncate` keeps its first seq_len + 1 tokens, `drop` leaves it out. The
    count is reported in one warning per source; an example left with no trained token is
    dropped either way."""
    seed: int = 0
    """Seed of the row shuffle and of the mixture (and of span corruption's noise masks)."""
    span_corruption: SpanCorruptionConfig = SpanCorruptionConfig()
    """T5's span corruption of each row (`train.objective=span_corruption`)."""
    workers: int = 0
    """Grain worker processes preparing batches (0: in the training process)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints: train state, data iterator, resolved config and tokenizer together."""

    dir: str | None = None
    """Checkpoint directory; null means `<run.dir>/checkpoints`."""
    every: int | None = None
    """Save every this many steps (asynchronously: training goes on while it is written); null
    never saves periodically, only at the end (`save_final`) and on SIGTERM / SIGINT."""
    keep: int = 3
    """Keep the newest this many checkpoints ..."""
    keep_every: int | None = None
    """... plus every checkpoint whose step is a multiple of this (null: none)."""
    keep_best: bool = False
    """... plus the best checkpoint by evaluation (`train.early_stopping.metric`, by default
    the objective's main one): a checkpoint is written at every evaluation (`train.eval_every`), each records
    the best step so far (its JSON item `best`), and retention never deletes that one.
    `--checkpoint best` of generate / eval / convert export reads it. Needs periodic
    evaluation."""
    async_save: bool = True
    """Write checkpoints in a background thread."""
    save_final: bool = True
    """Write a checkpoint of the train state when training ends."""
    resume: bool = True
    """Continue from the newest readable checkpoint in the directory, if there is one."""
    reset_optimizer: bool = False
    """Resume with a fresh optimizer state: the checkpoint's parameters, step, rng and data
    position are kept and its optimizer state is dropped, so `optim.*` may change (another
    `optim.name`, `amsgrad`, ...). Acts once, on this command's resume: the run's config.yaml
    records it as false with the new `optim.*`, and metrics.jsonl gets an `optimizer_reset`
    row at the step. Without it, a checkpoint of another optimizer is refused."""
    start_fresh: bool = False
    """Start over at step 0 in a run directory that holds checkpoints: the old run (its files,
    and `checkpoint.dir` when that lies elsewhere) is first moved aside to a sibling
    `<run.dir>.old` (`.old2`, ...), never deleted. Acts once; config.yaml records it as false."""
    init_from: str | None = None
    """A fresh run (nothing to resume) starts from these parameters instead of random ones: a
    run directory, its checkpoints directory, one step of it, or a Hugging Face model directory
    (config.json + safetensors). The model section must describe the same parameters. A
    LoRA / QLoRA run counts as its merged model (base + adapters, NF4 dequantized), unless
    `init_adapters` continues its adapters; a prompt-tuning run's soft prompt only continues."""
    init_adapters: Literal["merge", "continue"] = "merge"
    """When `init_from` is a fine-tuning run (peft) and this run has `peft` too: `merge` starts
    from that run's merged model and trains new adapters (or a new soft prompt) on it, as TRL
    does with an SFT adapter given to DPO; `continue` trains on that run's own adapters (or
    soft prompt) over its base, which needs the same peft.rank, alpha, rslora and targets (or
    num_virtual_tokens). Either way a reference (DPO, GRPO / PPO's KL) is the starting model.
    A run without peft always starts from the merged model."""


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Sampling and KV cache of `jaxllm generate` (and of `jaxllm.infer.generate`)."""

    max_new_tokens: int = 128
    """Tokens generated per prompt at most (fewer when a stop token comes first)."""
    temperature: float = 0.0
    """Softmax temperature; 0 decodes greedily (argmax)."""
    top_k: int = 0
    """Sample only among the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches p; 1 keeps all."""
    seed: int = 0
    """Seed of the sampling rng (ignored when greedy)."""
    stop_tokens: tuple[int, ...] = ()
    """Token ids that end a sequence, besides the tokenizer's end-of-sequence token."""
    kv_cache_dtype: Literal["bfloat16", "float32", "int8", "int4", "int2"] = "bfloat16"
    """Storage of cached keys/values: full precision, int8 (symmetric, one scale per token and kv
    head), int4 (KIVI: keys per channel, values per token, asymmetric, two codes per byte) or
    int2 (KIVI-2: the same at 2 bits, four codes per byte)."""
    kv_group: int = 32
    """int4 / int2 group size: tokens per key scale, channels per value scale; also the number of most
    recent tokens kept in full precision until their key group fills."""
    kv_page_size: int = 0
    """0 lays the cache out contiguously ([batch, max_len] per layer); N > 0 stores it in pages of
    N tokens shared by the batch through a block table, so each sequence reserves only the pages
    its own prompt + max_new_tokens need."""
    decode_impl: Literal["auto", "xla", "kernel"] = "auto"
    """Attention over the cache: `kernel` (the Pallas decode kernel of `jaxllm.kernels`: Mosaic
    on TPU, Mosaic GPU on Hopper, Pallas-Triton (deprecated in JAX) on other GPUs, interpreted on
    CPU), `xla` (dequantize, then attend), `auto` (kernel on TPU and Hopper, xla elsewhere)."""


MESH_AXES = ("stage", "data", "fsdp", "tensor", "sequence", "expert")


def mesh_degrees(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Size of each mesh axis (fast degree * dcn degree), with the one -1 resolved; checks that
    the product equals the device count."""
    ici = {a: getattr(mesh, a) for a in MESH_AXES}
    dcn = {a: getattr(mesh, f"dcn_{a}") for a in MESH_AXES}
    for name, d in [*ici.items(), *((f"dcn_{a}", d) for a, d in dcn.items())]:
        if d == 0 or d < -1 or (d == -1 and name.startswith("dcn_")):
            allowed = "a positive degree" + ("" if name.startswith("dcn_") else " or -1")
            _fail(f"mesh.{name} must be {allowed}, not {d}.")
    auto = [a for a, d in ici.items() if d == -1]
    if len(auto) > 1:
        _fail(f"only one mesh degree may be -1, but {', '.join('mesh.' + a for a in auto)} are.")
    fixed = math.prod(d for d in ici.values() if d != -1) * math.prod(dcn.values())
    if auto:
        if num_devices % fixed:
            _fail(
                f"mesh.{auto[0]}=-1 cannot fill {num_devices} devices: the other degrees multiply "
                f"to {fixed}, which does not divide {num_devices}."
            )
        ici[auto[0]] = num_devices // fixed
    elif fixed != num_devices:
        named = [f"mesh.{a}={d}" for a, d in ici.items() if d != 1]
        named += [f"mesh.dcn_{a}={d}" for a, d in dcn.items() if d != 1]
        _fail(
            f"the mesh degrees ({' * '.join(named) or 'all 1'}) multiply to {fixed} but there "
            f"are {num_devices} devices; make the product equal the device count or set one "
            "degree to -1."
        )
    return {a: ici[a] * dcn[a] for a in MESH_AXES}
