"""Typed, frozen run configuration: one dataclass per component, YAML files, key=value overrides.

The dataclasses below are the single source of truth for every key: their defaults *are* the
default run (`jaxllm train` with no arguments), each field is documented where it is declared,
and YAML files under `configs/` only override them.

    cfg = jaxllm.config.load("configs/runs/default.yaml", ["train.steps=20", "mesh=fsdp"])

A YAML file may hold `include: [other.yaml, ...]` (paths relative to the including file, merged in
order, the including file winning). A section may be named by preset instead of spelled out:
`model: llama3_8b` (in YAML or as an override `model=llama3_8b`) loads `configs/models/llama3_8b.yaml`.

User mistakes raise `ConfigError` with one sentence naming the key and the fix; the CLI turns it
into exit code 2 before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class _Loader(yaml.SafeLoader):
    """YAML 1.2 scalars: only true/false are booleans (`yes`, `on` stay strings) and `1e-3` is
    a float (YAML 1.1 wants a dot)."""


_Loader.yaml_implicit_resolvers = {
    k: [
        (tag, rx)
        for tag, rx in v
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")
    ]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$"
        r"|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)


class ConfigError(ValueError):
    """A configuration the user can fix; the message names the key and the fix."""


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, TensorBoard events, loss.png, checkpoints."""
    seed: int = 0
    """Seed for parameter init and the train-state rng (data order has its own seed)."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (`jaxllm.model.moe`); num_experts=0 is a dense model.

    Which blocks are MoE: the first `first_dense_layers` blocks are dense, and of the rest every
    `moe_every`-th is MoE (the others dense), so blocks k+n-1, k+2n-1, ... (0-based) for
    k = first_dense_layers, n = moe_every.
    """

    num_experts: int = 0
    """E: routed experts per MoE layer; 0 makes every block dense."""
    experts_per_token: int = 2
    """Top-k: routed experts each token is sent to."""
    expert_mlp_dim: int | None = None
    """Hidden width of each expert's SwiGLU; null means model.mlp_dim."""
    num_shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek / Qwen style),
    run as one SwiGLU of width num_shared_experts * expert_mlp_dim."""
    first_dense_layers: int = 0
    """Leading blocks kept dense (DeepSeek-V3 keeps 3)."""
    moe_every: int = 1
    """Of the blocks after those, every this-many-th is MoE (2: alternate dense and MoE)."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores from the float32 logits: softmax over experts (Mixtral, Qwen) or an
    independent sigmoid per expert (DeepSeek-V3)."""
    normalize_top_k: bool = True
    """Rescale each token's top-k scores to sum to 1 (for softmax this is Mixtral's softmax
    over the top-k logits)."""
    route_scale: float = 1.0
    """Factor on the routed experts' combined output (DeepSeek-V3's routed_scaling_factor)."""
    dispatch: Literal["dropless", "capacity"] = "dropless"
    """`dropless`: tokens sorted by expert and run as a grouped matmul, none dropped;
    `capacity`: fixed per-expert buffers of each sequence, assignments over capacity dropped."""
    capacity_factor: float = 1.25
    """Capacity mode: buffer slots per expert = ceil(capacity_factor * top-k * seq_len / E)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch / GShard load-balancing loss E * sum_e f_e * P_e (1 when balanced),
    averaged over MoE layers."""
    router_z_loss_weight: float = 0.001
    """Weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE), averaged over
    MoE layers."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for
    the top-k choice only, moves by this much per step against the sign of each expert's load
    error; 0 keeps it where it is (and without `router_bias` there is no bias at all)."""
    router_bias: bool = False
    """Keep the per-expert choice bias even when bias_update_rate is 0: a model imported from
    DeepSeek-V3 routes with its trained `e_score_correction_bias`, frozen unless
    bias_update_rate > 0 (which implies a bias)."""
    num_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups
    of consecutive experts (one per device or node in DeepSeek's layout); 1: no groups."""
    groups_per_token: int = 1
    """Group-limited routing (DeepSeek-V3's topk_group): a token's top-k experts come from its
    best this-many groups, a group ranked by the sum of its two highest (biased) scores, which
    bounds how many devices a token's assignments travel to; num_groups: no limit."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def has_router_bias(self) -> bool:
        """Whether MoE layers carry a `RouterBias` (in the model state, not the parameters)."""
        return self.router_bias or self.bias_update_rate > 0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434; DeepSeek-V3); off unless
    kv_lora_rank > 0.

    Each token's keys and values come from one shared latent c (kv_lora_rank wide, normalised):
    per head, k = [c W_uk ; k_rope] and v = c W_uv, where k_rope (qk_rope_head_dim wide) is one
    RoPE'd key shared by all heads (the "decoupled" RoPE key). Queries are [q_nope ; q_rope],
    from a low-rank latent too when q_lora_rank > 0. Generation caches only [c ; k_rope] per
    token, and decode steps attend in the latent space: W_uk is folded into the queries and W_uv
    applied after attention, so no per-head key or value is ever built for cached tokens.
    model.num_kv_heads must equal model.num_heads and model.head_dim stay null.
    """

    kv_lora_rank: int = 0
    """Width of the compressed key/value latent (DeepSeek-V2/V3: 512); 0: ordinary attention."""
    q_lora_rank: int = 0
    """Width of the query latent (DeepSeek-V3: 1536); 0: queries straight from the residual
    stream (DeepSeek-V2-Lite)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without position (from the latent)."""
    qk_rope_head_dim: int = 64
    """Per-head query channels, and the shared key's channels, that carry RoPE."""
    v_head_dim: int = 128
    """Per-head value width (input of the output projection)."""

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. Shapes use the dimension letters of `jaxllm.model`."""

    vocab_size: int = 384
    """V: rows of the embedding table; at least the tokenizer's vocabulary (258 for bytes)."""
    d_model: int = 256
    """D: width of the residual stream."""
    num_layers: int = 4
    """Number of decoder blocks, stacked along a leading `layers` axis and scanned."""
    num_heads: int = 4
    """H: query heads."""
    num_kv_heads: int = 2
    """G: key/value heads. H for MHA, 1 for MQA, a divisor of H for GQA."""
    head_dim: int | None = None
    """K: per-head width; null means d_model / num_heads (H * K may differ from D, as in Qwen3)."""
    mlp_dim: int = 640
    """F: hidden width of the SwiGLU MLP."""
    max_seq_len: int = 2048
    """Largest position the model is built for; data.seq_len may not exceed it."""
    position: Literal["rope", "alibi", "learned", "none"] = "rope"
    """How tokens know their position: `rope` (rotary, Su et al. 2021), `alibi` (a per-head
    linear distance penalty on attention logits, Press et al. 2022; attention_impl xla only),
    `learned` (an absolute [max_seq_len, D] table added to the embeddings, GPT-2), or `none`
    (causal masking alone, NoPE)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: Literal["none", "linear", "ntk", "yarn", "llama3"] = "none"
    """RoPE context extension by `rope_factor` (Hugging Face `rope_type`): `linear` (position
    interpolation: frequencies / factor), `ntk` (NTK-aware: theta * factor^(K / (K - 2))),
    `yarn` (Peng et al. 2023: per-frequency ramp between interpolation and extrapolation, plus
    an attention temperature), `llama3` (Llama 3.1: low frequencies / factor, a smooth band)."""
    rope_factor: float = 1.0
    """Context extension factor of `rope_scaling`; must stay 1 without scaling."""
    rope_original_max_len: int | None = None
    """Context length the model was pretrained at (`yarn`, `llama3`); null means max_seq_len."""
    rope_low_freq_factor: float = 1.0
    """`llama3`: wavelengths above original_max_len / this are interpolated fully."""
    rope_high_freq_factor: float = 4.0
    """`llama3`: wavelengths below original_max_len / this are kept as they are."""
    rope_beta_fast: float = 32.0
    """`yarn`: rotations over the original context above which a frequency is extrapolated."""
    rope_beta_slow: float = 1.0
    """`yarn`: rotations below which a frequency is interpolated."""
    rope_attention_factor: float | None = None
    """`yarn`: multiplier of cos/sin (attention temperature); null is 0.1 ln(factor) + 1."""
    rope_interleave: bool = False
    """Rotate adjacent channel pairs (2i, 2i + 1) (GPT-J, DeepSeek-V2/V3 checkpoints) instead of
    the "rotate half" pairs (i, i + K/2) of Llama checkpoints."""
    mlp_activation: Literal["swiglu", "geglu", "gelu", "relu", "relu2"] = "swiglu"
    """MLP nonlinearity. Gated (`swiglu`: silu(gate) * up, `geglu`: gelu(gate) * up) have
    gate/up/down projections; plain ones (`gelu`, `relu`, `relu2` = squared ReLU, So et al.
    2021) have up/down."""
    gelu_approximate: bool = True
    """`gelu` / `geglu`: the tanh approximation (GPT-2, Gemma) rather than the exact erf form."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """RMSNorm (scale only) or LayerNorm (mean subtracted; scale and bias)."""
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """Where each block normalises: `pre` (x + f(norm(x)); a final norm before the head),
    `post` (norm(x + f(x)), the original Transformer; no final norm), `sandwich`
    (x + norm(f(norm(x))), Gemma 2/3; with a final norm)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm."""
    norm_offset: float = 0.0
    """Norms multiply by (norm_offset + scale): Gemma stores scale - 1 and uses 1 here."""
    qk_norm: bool = False
    """Normalise queries and keys per head over the head dim before RoPE (Qwen3, Gemma 3)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2, GPT-2)."""
    o_bias: bool = False
    """Bias on the attention output projection (GPT-2)."""
    mlp_bias: bool = False
    """Biases on the MLP projections (GPT-2)."""
    attn_scale: float | None = None
    """Multiplier of q.k logits; null means head_dim ** -0.5 (Gemma 2: query_pre_attn_scalar
    ** -0.5)."""
    attn_soft_cap: float | None = None
    """Cap c of attention logits: s -> c * tanh(s / c) (Gemma 2); null: none."""
    final_soft_cap: float | None = None
    """Cap of the output logits, as attn_soft_cap (Gemma 2); null: none."""
    sliding_window: int | None = None
    """Windowed layers let a token see only the last `sliding_window` tokens (itself included;
    Mistral, Gemma); null: every layer attends to the whole prefix."""
    global_every: int = 0
    """With sliding_window: layer i (0-based) attends globally when (i + 1) % global_every == 0
    (2: alternate as Gemma 2, 6: Gemma 3); 0: every layer is windowed (Mistral)."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(d_model) (Gemma)."""
    tie_embeddings: bool = False
    """Use the token embedding (transposed) as the LM head."""
    dropout: float = 0.0
    """Dropout rate on the embeddings and on each residual branch's output; training only (the
    train step passes an rng; eval, scoring and generation never drop)."""
    init_std: float = 0.02
    """Std of the normal init of embeddings and projections (output projections scaled by depth)."""
    param_dtype: str = "float32"
    """Storage dtype of parameters (and of optimizer state)."""
    dtype: str = "bfloat16"
    """Compute dtype of activations and matmuls; softmax statistics and the loss stay float32."""
    scan_unroll: int = 1
    """Blocks per iteration of the layer scan; num_layers unrolls it fully (longer compiles)."""
    remat: Literal["none", "full", "dots", "dots_with_no_batch_dims"] = "none"
    """Activation checkpointing of each block: none, full (save only block inputs), or save matmul
    outputs (`dots`: every matmul; `dots_with_no_batch_dims`: weight matmuls, not attention)."""
    attention_impl: Literal["auto", "xla", "flash", "cudnn"] = "auto"
    """`xla` (einsum, float32 softmax), `flash` (the Pallas kernel of `jaxllm.kernels`;
    interpreted on CPU), `cudnn` (`jax.nn.dot_product_attention` on NVIDIA GPUs, no packed
    segments), or `auto`: flash on TPU, xla elsewhere (see docs/benchmarks.md for GPU)."""
    moe: MoEConfig = MoEConfig()
    """Mixture-of-experts feed-forward layers; dense unless moe.num_experts > 0."""
    mla: MLAConfig = MLAConfig()
    """Multi-head Latent Attention in every block instead of GQA when mla.kv_lora_rank > 0."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def rope_dim(self) -> int:
        """Channels of each query/key head that RoPE rotates."""
        return self.mla.qk_rope_head_dim if self.mla.enabled else self.resolved_head_dim

    @property
    def resolved_expert_mlp_dim(self) -> int:
        return self.mlp_dim if self.moe.expert_mlp_dim is None else self.moe.expert_mlp_dim

    @property
    def gated_mlp(self) -> bool:
        return self.mlp_activation in ("swiglu", "geglu")

    def layer_windows(self) -> tuple[int, ...] | None:
        """Per layer: the sliding window, or 0 for a global layer; None without windows."""
        if self.sliding_window is None:
            return None
        every = self.global_every
        return tuple(
            0 if every and (i + 1) % every == 0 else self.sliding_window
            for i in range(self.num_layers)
        )

    def validate(self) -> None:
        """Combinations of model keys no field type can express (raises ConfigError)."""
        if self.position != "rope":
            changed = [
                f"model.{f.name}" for f in dataclasses.fields(self)
                if f.name.startswith("rope_") and getattr(self, f.name) != f.default
            ]  # fmt: skip
            if changed:
                _fail(f"{changed[0]} only applies to model.position=rope, not {self.position}.")
        if self.rope_scaling == "none" and self.rope_factor != 1.0:
            _fail("model.rope_factor needs model.rope_scaling (linear, ntk, yarn or llama3).")
        if self.rope_factor <= 0 or self.rope_theta <= 0:
            _fail("model.rope_factor and model.rope_theta must be positive.")
        if self.rope_scaling == "llama3" and not (
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            _fail("model.rope_low_freq_factor must be positive and below rope_high_freq_factor.")
        if self.position == "rope" and self.rope_dim % 2:
            what = "model.mla.qk_rope_head_dim" if self.mla.enabled else "model.head_dim"
            _fail(f"{what} ({self.rope_dim}) must be even for RoPE.")
        if self.mla.enabled:  # off, its widths are ignored (as moe.* without experts)
            self._validate_mla()
        if self.sliding_window is not None and self.sliding_window < 1:
            _fail(f"model.sliding_window must be >= 1 or null, not {self.sliding_window}.")
        if self.global_every < 0 or (self.global_every and self.sliding_window is None):
            _fail("model.global_every needs model.sliding_window and must be >= 0.")
        for name in ("attn_soft_cap", "final_soft_cap", "attn_scale"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                _fail(f"model.{name} must be positive or null.")
        if not 0 <= self.dropout < 1:
            _fail(f"model.dropout must be in [0, 1), not {self.dropout}.")
        if self.position == "alibi" and self.attention_impl in ("flash", "cudnn"):
            _fail(
                f"model.position=alibi needs model.attention_impl=xla (or auto): the "
                f"{self.attention_impl} kernel has no ALiBi bias."
            )
        if self.attention_impl == "cudnn" and self.attn_soft_cap is not None:
            _fail("model.attn_soft_cap needs model.attention_impl xla, flash or auto, not cudnn.")

    def _validate_mla(self) -> None:
        a = self.mla
        dims = dict(q_lora_rank=a.q_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                    qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim)  # fmt: skip
        for name, value in dims.items():
            if value < (0 if name == "q_lora_rank" else 1):
                _fail(f"model.mla.{name} must be positive, not {value}.")
        if self.position != "rope":
            _fail(f"MLA carries position in its decoupled RoPE key: model.position must be rope, "
                  f"not {self.position}.")  # fmt: skip
        if self.num_kv_heads != self.num_heads or self.head_dim is not None:
            _fail(
                "MLA gives every query head its own key and value from the latent: set "
                f"model.num_kv_heads = model.num_heads ({self.num_heads}) and leave "
                "model.head_dim null (widths are model.mla.*_head_dim)."
            )
        if self.qk_norm or self.qkv_bias:
            _fail("model.qk_norm and model.qkv_bias are not part of MLA (it normalises its "
                  "latents); turn them off.")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Degree of each parallelism axis of the device mesh.

    The plain degrees split the devices of one slice / host group joined by the fast network
    (ICI, NVLink); one of them may be -1 to take what is left. The `dcn_*` degrees split the
    slices (or hosts) joined by the slow data-center network, as MaxText's `dcn_*_parallelism`:
    the mesh axis `fsdp` then has size fsdp * dcn_fsdp, slices outermost. The product of all
    degrees must equal the number of devices.
    """

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
    sequence_attention: Literal["all_gather", "ring"] = "all_gather"
    """How attention sees keys of other sequence shards: all-gather K/V, or ring attention
    (K/V blocks passed around the `sequence` axis, zigzag layout for causal load balance)."""
    expert_dispatch: Literal["annotations", "all_to_all"] = "annotations"
    """How capacity-mode MoE layers move token buffers to their experts' devices over
    `expert`: sharding constraints on the buffers, from which XLA makes the all-to-all, or an
    explicit all-to-all under shard_map. Both move the same bytes in every plan of
    docs/benchmarks.md; constraints need less memory with FSDP. Dropless layers always gather
    the tokens of the expert group under shard_map."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with a schedule, global-norm clipping and a weight-decay mask (kernels/embeddings)."""

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


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One corpus of a (possibly weighted) mixture."""

    path: str = "stdlib"
    """`stdlib` (the running Python's standard-library sources), a directory, a glob, or a file;
    a directory or glob may mix formats, told apart by extension."""
    format: Literal["auto", "stdlib", "text", "jsonl", "parquet", "arrayrecord"] = "auto"
    """`auto` picks by extension: .jsonl/.json -> jsonl, .parquet, .arrayrecord/.array_record,
    anything else -> text."""
    text_field: str = "text"
    """Field holding the document in JSONL lines and Parquet rows."""
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
    """`byte` (UTF-8 bytes, no files), a `tokenizer.json` (Hugging Face tokenizers), or a
    SentencePiece `.model` file."""
    add_bos: bool = True
    """Start every document with the tokenizer's BOS token."""
    add_eos: bool = True
    """End every document with the tokenizer's EOS token."""
    packing: Literal["concat", "first_fit"] = "concat"
    """`concat`: documents end to end, cut into rows (long documents split); `first_fit`: whole
    documents placed in the first row with room, padded (documents longer than a row split)."""
    seq_len: int = 256
    """Tokens per row the model sees (rows are packed documents)."""
    eval_fraction: float = 0.05
    """Fraction of files held out for eval (by a hash of their path) when eval_sources is empty."""
    max_files: int | None = None
    """Read at most this many files (sorted by path) of each source; null reads all."""
    on_bad_record: Literal["skip", "fail"] = "skip"
    """A JSONL line that is not JSON or lacks the text field: count, warn and skip, or stop."""
    seed: int = 0
    """Seed of the row shuffle and of the mixture."""
    workers: int = 0
    """Grain worker processes preparing batches (0: in the training process)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    """Optimizer steps."""
    global_batch_size: int = 16
    """Rows per optimizer step across all devices and microbatches."""
    grad_accum_steps: int = 1
    """Split each global batch into this many microbatches, accumulated inside the jitted step."""
    z_loss: float = 0.0
    """Weight of the z-loss (log of the softmax normaliser squared) added to the loss."""
    log_every: int = 10
    """Write a metrics line every this many steps."""
    eval_every: int = 50
    """Evaluate on the held-out split every this many steps; 0 evaluates only at the end."""
    eval_batches: int = 8
    """Batches of the held-out split per evaluation."""
    sample_prompt: str = "def __init__(self"
    """Prompt of the greedy continuation printed at the end of training ("" skips it)."""
    sample_tokens: int = 96
    """Length of that continuation in tokens."""
    nonfinite: Literal["skip", "stop"] = "stop"
    """A step whose loss or gradients are NaN/Inf never updates the state (done inside the
    jitted step); `skip` goes on with the next batch, `stop` ends the run after
    `nonfinite_patience` such steps in a row, with a checkpoint of the last good state."""
    nonfinite_patience: int = 1
    """Consecutive non-finite steps tolerated before `stop` ends the run."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints: train state, data iterator, resolved config and tokenizer together."""

    dir: str | None = None
    """Checkpoint directory; null means `<run.dir>/checkpoints`."""
    every: int = 0
    """Save every this many steps (asynchronously: training goes on while it is written); 0
    saves only at the end (and on SIGTERM / SIGINT)."""
    keep: int = 3
    """Keep the newest this many checkpoints ..."""
    keep_every: int | None = None
    """... plus every checkpoint whose step is a multiple of this (null: none)."""
    async_save: bool = True
    """Write checkpoints in a background thread."""
    save_final: bool = True
    """Write a checkpoint of the train state when training ends."""
    resume: bool = True
    """Continue from the newest readable checkpoint in the directory, if there is one."""
    init_from: str | None = None
    """A fresh run (nothing to resume) starts from these parameters instead of random ones: a
    run directory, its checkpoints directory, one step of it, or a Hugging Face model directory
    (config.json + safetensors). The model section must describe the same parameters."""


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
    kv_cache_dtype: Literal["bfloat16", "float32", "int8", "int4"] = "bfloat16"
    """Storage of cached keys/values: full precision, int8 (symmetric, one scale per token and kv
    head) or int4 (KIVI: keys per channel, values per token, asymmetric, two codes per byte)."""
    kv_group: int = 32
    """int4 group size: tokens per key scale, channels per value scale; also the number of most
    recent tokens kept in full precision until their key group fills."""
    kv_page_size: int = 0
    """0 lays the cache out contiguously ([batch, max_len] per layer); N > 0 stores it in pages of
    N tokens shared by the batch through a block table, so each sequence reserves only the pages
    its own prompt + max_new_tokens need."""
    decode_impl: Literal["auto", "xla", "kernel"] = "auto"
    """Attention over the cache: `kernel` (the Pallas decode kernel of `jaxllm.kernels`: Mosaic
    on TPU, Triton on GPU, interpreted on CPU), `xla` (dequantize, then attend), `auto` (kernel
    on TPU, xla elsewhere)."""


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

    def validate(self, num_devices: int | None = None) -> Config:
        """Checks combinations no field type can express; returns self or raises ConfigError."""
        m, t = self.model, self.train
        positive = {
            "model.vocab_size": m.vocab_size, "model.d_model": m.d_model,
            "model.num_layers": m.num_layers, "model.num_heads": m.num_heads,
            "model.num_kv_heads": m.num_kv_heads, "model.mlp_dim": m.mlp_dim,
            "model.max_seq_len": m.max_seq_len, "model.scan_unroll": m.scan_unroll,
            "model.head_dim": 1 if m.head_dim is None else m.head_dim, "data.seq_len": self.data.seq_len,
            "train.steps": t.steps, "train.global_batch_size": t.global_batch_size,
            "train.grad_accum_steps": t.grad_accum_steps, "train.log_every": t.log_every,
            "train.eval_batches": t.eval_batches,
        }  # fmt: skip
        for key, value in positive.items():
            if value < 1:
                _fail(f"{key} must be at least 1, not {value}.")
        if t.eval_every < 0 or t.sample_tokens < 0 or self.optim.warmup_steps < 0:
            _fail("train.eval_every, train.sample_tokens and optim.warmup_steps must be >= 0.")
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
        if gen.kv_cache_dtype == "int4" and m.mla.enabled:
            _fail(
                "generate.kv_cache_dtype=int4 (KIVI: keys per channel, values per token) cannot "
                "quantize MLA's latent, which is key and value at once; use int8 or bfloat16."
            )
        if gen.kv_cache_dtype == "int4" and m.resolved_head_dim % min(
            gen.kv_group, m.resolved_head_dim
        ):
            _fail(
                f"generate.kv_group ({gen.kv_group}) must divide the head dim "
                f"({m.resolved_head_dim}) for the int4 cache's per-token value groups."
            )
        if gen.kv_page_size and gen.kv_page_size % gen.kv_group:
            _fail(
                f"generate.kv_page_size ({gen.kv_page_size}) must be a multiple of "
                f"generate.kv_group ({gen.kv_group})."
            )
        if m.num_heads % m.num_kv_heads:
            _fail(
                f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads "
                f"({m.num_kv_heads}); pick num_kv_heads from the divisors of num_heads."
            )
        if m.head_dim is None and m.d_model % m.num_heads:
            _fail(
                f"model.d_model ({m.d_model}) is not divisible by model.num_heads ({m.num_heads}); "
                "change one of them so that head_dim = d_model / num_heads is an integer."
            )
        m.validate()
        if self.mesh.sequence_attention == "ring" and (
            m.position == "alibi" or m.sliding_window is not None or m.attn_soft_cap is not None
            or m.attn_scale is not None
        ):  # fmt: skip
            _fail(
                "mesh.sequence_attention=ring supports neither model.position=alibi, "
                "model.sliding_window, model.attn_soft_cap nor model.attn_scale; use all_gather."
            )
        if self.data.seq_len > m.max_seq_len:
            _fail(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
                "lower data.seq_len or raise model.max_seq_len."
            )
        from jaxllm.data import tokenizer_vocab_size  # local: config must not import jax

        if m.vocab_size < tokenizer_vocab_size(self.data):
            _fail(
                f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({tokenizer_vocab_size(self.data)}); raise model.vocab_size."
            )
        if m.moe.enabled:
            _validate_moe(m)
        elif m.moe.num_experts < 0:
            _fail(f"model.moe.num_experts must be >= 0 (0: dense), not {m.moe.num_experts}.")
        for name in ("dtype", "param_dtype"):
            if getattr(m, name) not in ("float32", "bfloat16", "float16"):
                _fail(
                    f"model.{name} must be float32, bfloat16 or float16, not {getattr(m, name)!r}."
                )
        if t.global_batch_size % t.grad_accum_steps:
            _fail(
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
                f"train.grad_accum_steps ({t.grad_accum_steps})."
            )
        if num_devices is not None:
            degrees = mesh_degrees(self.mesh, num_devices)
            dp = degrees["data"] * degrees["fsdp"] * degrees["expert"]
            micro = t.global_batch_size // t.grad_accum_steps
            if micro % dp:
                _fail(
                    f"train.global_batch_size ({t.global_batch_size}) / train.grad_accum_steps "
                    f"({t.grad_accum_steps}) = {micro} rows per microbatch is not divisible by the "
                    f"data-parallel size mesh.data * mesh.fsdp * mesh.expert = {dp}; use a "
                    f"multiple of {dp}."
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
            if self.mesh.sequence_attention == "ring" and self.data.seq_len % (
                2 * degrees["sequence"]
            ):
                _fail(
                    f"data.seq_len ({self.data.seq_len}) must be divisible by 2 * mesh.sequence "
                    f"({2 * degrees['sequence']}) for ring attention's zigzag layout."
                )
            if self.data.seq_len % degrees["sequence"]:
                _fail(
                    f"data.seq_len ({self.data.seq_len}) must be divisible by mesh.sequence "
                    f"({degrees['sequence']})."
                )
        return self


def _validate_moe(m: ModelConfig) -> None:
    moe = m.moe
    if not 1 <= moe.experts_per_token <= moe.num_experts:
        _fail(
            f"model.moe.experts_per_token ({moe.experts_per_token}) must be between 1 and "
            f"model.moe.num_experts ({moe.num_experts})."
        )
    if moe.expert_mlp_dim is not None and moe.expert_mlp_dim < 1:
        _fail(f"model.moe.expert_mlp_dim must be at least 1 or null, not {moe.expert_mlp_dim}.")
    if moe.num_shared_experts < 0 or moe.first_dense_layers < 0 or moe.moe_every < 1:
        _fail(
            "model.moe.num_shared_experts and model.moe.first_dense_layers must be >= 0 and "
            "model.moe.moe_every >= 1."
        )
    rest = m.num_layers - moe.first_dense_layers
    if rest < moe.moe_every or rest % moe.moe_every:
        _fail(
            f"model.num_layers - model.moe.first_dense_layers ({rest}) must be a positive "
            f"multiple of model.moe.moe_every ({moe.moe_every}), so that the MoE pattern repeats "
            "whole and holds at least one MoE block."
        )
    if moe.capacity_factor <= 0 or moe.route_scale <= 0:
        _fail("model.moe.capacity_factor and model.moe.route_scale must be positive.")
    for name in ("aux_loss_weight", "router_z_loss_weight", "bias_update_rate"):
        if getattr(moe, name) < 0:
            _fail(f"model.moe.{name} must be >= 0, not {getattr(moe, name)}.")
    _validate_groups(moe)


def _validate_groups(moe: MoEConfig) -> None:
    groups, keep = moe.num_groups, moe.groups_per_token
    if groups < 1 or moe.num_experts % groups:
        _fail(f"model.moe.num_groups ({groups}) must be a positive divisor of "
              f"model.moe.num_experts ({moe.num_experts}).")  # fmt: skip
    if not 1 <= keep <= groups:
        _fail(f"model.moe.groups_per_token ({keep}) must be between 1 and model.moe.num_groups "
              f"({groups}).")  # fmt: skip
    if moe.experts_per_token > keep * (moe.num_experts // groups):
        _fail(
            f"model.moe.experts_per_token ({moe.experts_per_token}) exceeds the "
            f"{keep * (moe.num_experts // groups)} experts of model.moe.groups_per_token ({keep}) "
            f"groups of {moe.num_experts // groups}; raise groups_per_token."
        )


MESH_AXES = ("data", "fsdp", "tensor", "sequence", "expert")


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


# ----------------------------------------------------------------------------------------------
# Loading: YAML, includes, presets, overrides, type checking
# ----------------------------------------------------------------------------------------------

SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_PRESET_DIRS = {"model": "models", "mesh": "mesh"}


def configs_dir() -> Path:
    """The `configs/` directory: $JAXLLM_CONFIGS, else ./configs, else the one beside the package."""
    if env := os.environ.get("JAXLLM_CONFIGS"):
        return Path(env)
    cwd = Path.cwd() / "configs"
    return cwd if cwd.is_dir() else Path(__file__).resolve().parent.parent / "configs"


def _fail(msg: str) -> typing.NoReturn:
    raise ConfigError(msg)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        _fail(f"{path} includes itself (through {' -> '.join(p.name for p in seen)}).")
    if not path.is_file():
        _fail(f"config file {path} does not exist; check the path.")
    try:
        raw = _yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        _fail(f"{path} is not valid YAML: {str(e).splitlines()[0]}.")
    if not isinstance(raw, dict):
        _fail(f"{path} must hold a mapping of sections, not a {type(raw).__name__}.")
    includes = raw.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        _deep_merge(merged, _read_yaml(path.parent / inc, seen + (path,)))
    for section, value in raw.items():
        _deep_merge(merged, {section: _expand_preset(section, value, path.parent, seen + (path,))})
    return merged


def _expand_preset(section: str, value: Any, base: Path, seen: tuple[Path, ...]) -> Any:
    """`model: tiny` -> the `model` section of configs/models/tiny.yaml."""
    if not isinstance(value, str) or section not in _PRESET_DIRS:
        return value
    candidates = [
        Path(value),
        base / value,
        configs_dir() / _PRESET_DIRS[section] / f"{value}.yaml",
    ]
    path = next((p for p in candidates if p.suffix in (".yaml", ".yml") and p.is_file()), None)
    if path is None:
        available = sorted(p.stem for p in (configs_dir() / _PRESET_DIRS[section]).glob("*.yaml"))
        _fail(
            f"{section}={value!r} names no preset; available in configs/{_PRESET_DIRS[section]}/: "
            f"{', '.join(available) or 'none'}."
        )
    data = _read_yaml(path, seen)
    if set(data) - {section}:
        _fail(f"preset {path} may only hold the `{section}:` section.")
    return data.get(section, {})


def _deep_merge(into: dict, other: dict) -> dict:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v
    return into


def _parse_override(item: str) -> dict:
    if "=" not in item:
        _fail(f"override {item!r} must look like key.sub=value (for example train.steps=20).")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = _yaml(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    if key in _PRESET_DIRS and isinstance(value, str):
        return {key: _expand_preset(key, value, Path.cwd(), ())}
    if key == "run" and not isinstance(value, dict):
        _fail(f"override {item!r}: `run` is a section; set a key in it, e.g. run.dir=runs/x.")
    node: Any = value
    for part in reversed(key.split(".")):
        if not part:
            _fail(f"override {item!r} has an empty key part.")
        node = {part: node}
    return node


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Checks `value` against the annotation `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            _fail(f"{key} must be a list, not {value!r}.")
        if dataclasses.is_dataclass(item_tp):
            return tuple(_build(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
        return tuple(_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            _fail(f"{key} must be one of {', '.join(map(str, choices))}, not {value!r}.")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(f"{key} must be true or false, not {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(f"{key} must be an integer, not {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(f"{key} must be a number, not {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(f"{key} must be a string, not {value!r}; quote it.")
        return value
    raise TypeError(f"unsupported annotation {tp} for {key}")  # a bug in this file, not the user's


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        _fail(f"{prefix} must be a mapping of keys, not {data!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f"did you mean {prefix}.{close[0]}?" if close else f"known keys: {', '.join(names)}."
        _fail(f"unknown config key {prefix}.{unknown[0]}; {hint}")
    kwargs = {}
    for k, v in data.items():
        if dataclasses.is_dataclass(hints[k]):
            kwargs[k] = _build(hints[k], v, f"{prefix}.{k}")
        else:
            kwargs[k] = _coerce(f"{prefix}.{k}", v, hints[k])
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    unknown = [k for k in data if k not in SECTIONS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(SECTIONS), n=1)
        hint = f"did you mean {close[0]}?" if close else f"sections are {', '.join(SECTIONS)}."
        _fail(f"unknown config section {unknown[0]!r}; {hint}")
    hints = typing.get_type_hints(Config)
    return Config(**{k: _build(hints[k], v or {}, k) for k, v in data.items()})


def load(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """YAML file (or the built-in defaults when None) + `key.sub=value` overrides -> Config.

    Validates everything that does not need the device count; `Config.validate(n)` does the rest.
    """
    data = _read_yaml(Path(path)) if path is not None else {}
    for item in overrides:
        _deep_merge(data, _parse_override(item))
    return from_dict(data).validate()


def to_dict(cfg: Config) -> dict:
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def dump(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the fully resolved config; `load(path)` reads it back to an equal Config."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
