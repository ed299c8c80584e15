"""The sections besides `model`, `train`, `peft`, `optim` and `checkpoint`: run, mesh (with the
mesh-degree arithmetic), data and generate."""

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
    tensor2: int = 1
    """2D TP (Colossal-AI's 2D layout as sharding rules): the model dim of every weight and of
    the residual stream split over a second axis, so each matmul weight is split over `tensor`
    and `tensor2` (mesh.tensor x mesh.tensor2 ways). Dense decoder models, stage and sequence 1."""
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
        "csv",
        "arrow",
        "arrayrecord",
        "chat",
        "prompt_completion",
        "preference",
        "unpaired_preference",
        "rollout",
        "stepwise",
    ] = "auto"
    """`auto` picks by extension (of a .gz / .zst file, the one before): .jsonl/.json -> jsonl,
    .parquet, .csv/.tsv -> csv, .arrow (Hugging Face `datasets`' save_to_disk) -> arrow,
    .arrayrecord/.array_record, anything else -> text. `chat` and `prompt_completion` are supervised fine-tuning examples
    (rows of a .parquet file, lines of any other file, read as JSONL): a conversation rendered
    by the tokenizer's chat template, or a prompt followed by its completion; the loss covers
    the assistant turns / the completion (see `data.train_on_prompt`). `preference` records
    hold a prompt with a chosen and a rejected answer, for the DPO family and reward models;
    `unpaired_preference` records a prompt, one completion and a boolean label, for KTO.
    `rollout` records hold a prompt and the answer its completions are checked against, for
    GRPO (`jaxllm.objectives.rollout.sampling`): the model writes the completions. `stepwise`
    records (TRL's stepwise_supervision: `prompt`, `completions` a list of steps, `labels` a
    boolean per step) train a process reward model, `train.objective=prm`
    (`jaxllm.data.stepwise`). `auto` reads JSON-lines / columnar records that are plainly chats
    or preference pairs as `chat` / `preference`, saying so (`jaxllm.data.detect`)."""
    text_field: str = "text"
    """Field holding the document in JSONL lines and Parquet rows."""
    messages_field: str = "messages"
    """`format: chat`: field holding the conversation, a list of {role, content} messages with
    roles system, user and assistant and at least one assistant turn."""
    prompt_field: str = "prompt"
    """`format: prompt_completion`, `preference`, `unpaired_preference` and `rollout`: field
    holding the prompt (a string, or except for `prompt_completion` also chat messages)."""
    completion_field: str = "completion"
    """`format: prompt_completion` / `unpaired_preference`: field holding the completion (a
    string; for `unpaired_preference` also a list of assistant messages)."""
    label_field: str = "label"
    """`format: unpaired_preference`: field holding the label, true (desirable) or false."""
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
    image_resize: bool = True
    """Images in chat rows (a model with `model.vision`) are resized into the tower's patch grid
    within its min/max_pixels, as the Qwen2-VL processor does; false: used as they are, an
    image off the grid or over max_pixels a bad record (`on_bad_record`)."""
    seed: int = 0
    """Seed of the row shuffle and of the mixture (and of span corruption's noise masks)."""
    span_corruption: SpanCorruptionConfig = SpanCorruptionConfig()
    """T5's span corruption of each row (`train.objective=span_corruption`)."""
    workers: int = 0
    """Grain worker processes preparing batches (0: in the training process)."""
    order: Literal["shuffled", "length", "curriculum"] = "shuffled"
    """Order of the training rows. `shuffled`: a new permutation per epoch (sources interleaved
    by weight); `length`: each source's documents sorted by length, shortest first, before
    packing, rows in that order; `curriculum`: all rows of source 1 (shuffled), then of source
    2, ... as listed (weights must stay 1). Held-out rows are the same for every order."""


KV_CACHE_DTYPE = "float32"
"""The default KV-cache storage of every decoder: `generate.kv_cache_dtype`, the engine's
`Engine(kv_cache_dtype=)`, `jaxllm serve --kv-cache-dtype`. float32 holds the keys and values of
any compute dtype exactly, so the static generator, the engine and the cache-free reference pick
the same greedy tokens; bfloat16 halves the cache and may round a near-tie the other way."""


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
    kv_cache_dtype: Literal["bfloat16", "float32", "int8", "int4", "int2"] = KV_CACHE_DTYPE
    """Storage of cached keys/values (default float32, `KV_CACHE_DTYPE`): full precision, int8 (symmetric, one scale per token and kv
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


MESH_AXES = ("stage", "data", "fsdp", "tensor", "tensor2", "sequence", "expert")


def mesh_degrees(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Size of each mesh axis (fast degree * dcn degree), with the one -1 resolved; checks that
    the product equals the device count."""
    ici = {a: getattr(mesh, a) for a in MESH_AXES}
    dcn = {a: getattr(mesh, f"dcn_{a}", 1) for a in MESH_AXES}  # tensor2: one slice
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
