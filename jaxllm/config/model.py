"""The `model` section: the model's kind, shape and architecture knobs (`ModelConfig`), with its
rotary position (`RopeConfig`, in `jaxllm.config.rope`), mixture-of-experts (`MoEConfig`, in
`jaxllm.config.moe`) and Multi-head Latent Attention (`MLAConfig`, in `jaxllm.config.mla`)
subsections, and the checks that involve only them (`ModelConfig.validate`, which the model
classes call when built)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from jaxllm.config.encoder import EncoderConfig
from jaxllm.config.errors import fail as _fail
from jaxllm.config.fp8 import validate_fp8
from jaxllm.config.linear_attention import LinearAttentionConfig, validate_hybrid
from jaxllm.config.mla import MLAConfig, validate_mla
from jaxllm.config.moe import MoEConfig, validate_moe
from jaxllm.config.rope import RopeConfig, validate_mrope
from jaxllm.config.seq2seq import RelativeConfig, validate_encoder_decoder
from jaxllm.config.vision import VisionConfig, validate_vision


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder, a bidirectional encoder or a T5-style encoder–decoder (`kind`). Shapes use the dimension
    letters of `jaxllm.model`."""

    kind: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"
    """`decoder`: causal self-attention (GPT / Llama; every objective but `mlm`). `encoder`:
    bidirectional self-attention (BERT), where a token sees every token of its own segment,
    before and after it, and padding (segment id 0) sees only padding; its BERT parts are
    `encoder`. `encoder_decoder` (T5, `jaxllm.model.encoder_decoder`): an encoder stack of
    num_layers blocks and a decoder stack of decoder_layers blocks with cross-attention, called
    as model(input_ids, decoder_input_ids); objective `span_corruption`."""
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
    position: Literal["rope", "alibi", "learned", "none", "relative"] = "rope"
    """How tokens know their position: `rope` (rotary, Su et al. 2021), `alibi` (a per-head
    linear distance penalty on attention logits, Press et al. 2022; attention_impl xla only),
    `learned` (an absolute [max_seq_len, D] table added to the embeddings, GPT-2), `none`
    (causal masking alone, NoPE), or `relative` (T5's relative position buckets, `relative`;
    kind=encoder_decoder, attention_impl xla for self-attention)."""
    rope: RopeConfig = RopeConfig()
    """Rotary position embedding (`position=rope`): base, context extension, pair layout."""
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
    attention_sinks: bool = False
    """A learned logit per query head that joins every attention softmax's denominator only, so
    a head can attend to nothing (gpt-oss; Xiao et al. 2023). attention_impl xla, flash or auto
    (not cudnn); no ring attention (mesh.sequence with the ring)."""
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
    scale_head_input: bool = False
    """Multiply the final hidden state by d_model ** -0.5 before the LM head: T5 v1.0, whose
    head is the tied embedding (transformers' `scale_decoder_outputs`); kind=encoder_decoder."""
    head: Literal["lm", "score"] = "lm"
    """`lm`: the LM head (logits [B, L, V]); `score`: a reward model's head, one projection
    `score` [D, 1] (`*ForSequenceClassification`, num_labels=1), a score [B, L, 1] at every
    position, a sequence's reward the one at its last token (`jaxllm.infer.reward.score`). No
    LM head, so no tie_embeddings or final_soft_cap; `init_from` an LM starts the head fresh."""
    score_bias: bool = False
    """A bias [1] on the score head (model.head=score), as a PRM's `*ForTokenClassification` has."""
    value_head: bool = False
    """Add PPO's value head beside the LM head: one projection `value` [D, 1] (no bias) of the
    same final hidden state, giving V(s_t) [B, L] in `ModelOutput.values`
    (`train.objective=ppo`). `checkpoint.init_from` a model without it starts it fresh;
    a model without it started from a PPO run leaves that run's value head behind. Under
    `peft` it trains beside the adapters."""
    distill_proj: tuple[int, ...] = ()
    """Feature distillation's learned projections, [M, D_teacher]: M matrices `distill_proj`
    [M, d_model, D_teacher] that map the student's hidden states into the teacher's width, one
    per pair of `train.distill_layers` (`jaxllm.objectives.distill`). `jaxllm train` fills it
    from the teacher when `train.distill_hidden_weight` > 0; they train and are checkpointed
    with the model but take no part in its output (generate, eval, export leave them out).
    []: none."""
    dropout: float = 0.0
    """Dropout rate on the embeddings and on each residual branch's output; training only (the
    train step passes an rng; eval, scoring and generation never drop)."""
    init_std: float = 0.02
    """Std of the normal init of embeddings and projections (output projections scaled by depth)."""
    param_dtype: str = "float32"
    """Storage dtype of parameters (and of optimizer state)."""
    param_offload: Literal["none", "host"] = "none"
    """`host` keeps the trained parameters, in their (fsdp) shards, in host memory
    (`pinned_host`) between steps, as ZeRO-Offload does: the step copies them to the device,
    computes and updates there, and sends them back. `jaxllm plan` bills them as host memory."""
    dtype: str = "bfloat16"
    """Compute dtype of activations and matmuls; softmax statistics and the loss stay float32."""
    matmul_dtype: str | None = None
    """Dtype of the projection matmuls (attention and MLA, MLP, MoE experts): null (or the name
    of `dtype`): the compute dtype; `float8`: fp8 as `fp8_scaling` says, float32 accumulation.
    The LM head and the MoE router stay in the compute dtype / float32."""
    fp8_scaling: Literal["current", "blockwise", "delayed"] = "current"
    """`current` (a scale per tensor from its amax, e5m2 output gradients; `fp8.py`),
    `blockwise` (DeepSeek-V3's 1x128 / 128x128 tiles, e4m3 both ways; `fp8_blockwise.py`) or
    `delayed` (per tensor from an amax history in the model state; `fp8_delayed.py`)."""
    fp8_amax_history: int = 1024
    """Steps of amax history per tensor with `fp8_scaling=delayed` (its scale fits their max)."""
    scan_unroll: int = 1
    """Blocks per iteration of the layer scan; num_layers unrolls it fully (longer compiles)."""
    remat: Literal[
        "none", "full", "dots", "dots_attention", "dots_with_no_batch_dims", "offload", "auto"
    ] = "none"
    """Activation checkpointing of each block (`jaxllm/model/remat.py`): none, full (block inputs
    only), `dots` (every matmul's output), `dots_attention` (and the attention kernels' output
    and logsumexp: no second attention forward), `dots_with_no_batch_dims` (weight matmuls),
    `offload` (those in host memory); `auto`: the first of none, dots_attention, dots,
    dots_with_no_batch_dims, full whose step fits `train.memory_budget`."""
    attention_impl: Literal["auto", "xla", "flash", "cudnn"] = "auto"
    """`xla` (einsum, float32 softmax), `flash` (the Pallas kernel of `jaxllm.kernels`;
    interpreted on CPU), `cudnn` (cuDNN's fused attention on NVIDIA GPUs, packed documents as
    segment offsets), or `auto`, the fastest measured (docs/benchmarks.md): flash on TPU; on a
    GPU, for bfloat16 / float16 with head dim 64 or 128, cudnn when causal and flash with a
    logit soft cap or bidirectional, otherwise xla; xla on CPU."""
    attention_kernel: Literal["softmax", "gaussian"] = "softmax"
    """How a query scores a key before the softmax: `softmax`, the scaled dot product q.k /
    sqrt(K) (attn_scale); or `gaussian`, an RBF kernel -||q - k||^2 / (2 sigma_h^2 sqrt(K))
    with a per-head sigma (`gaussian_sigma`; `jaxllm.model.gaussian`). Gaussian runs on the
    xla implementation (attention_impl xla or auto), with GQA, packing, windows and ALiBi, and
    generates through the KV cache, which then holds K + 1 channels per key (k and ||k||^2);
    not with MLA, attn_scale, attn_soft_cap, kind=encoder_decoder or ring attention."""
    gaussian_sigma: float = 1.0
    """attention_kernel=gaussian: sigma of every head (where gaussian_sigma_learned, its value
    at initialisation)."""
    gaussian_sigma_learned: bool = False
    """attention_kernel=gaussian: learn sigma per head (parameter `gaussian_log_sigma` [H],
    log sigma so it stays positive); false keeps gaussian_sigma fixed."""
    cudnn_max_segments: int = 32
    """attention_impl=cudnn (or auto on a GPU): the most packed documents per row that cuDNN
    takes as segment offsets; a batch with a fuller row runs the flash kernel for that step."""
    moe: MoEConfig = MoEConfig()
    """Mixture-of-experts feed-forward layers; dense unless moe.num_experts > 0."""
    mla: MLAConfig = MLAConfig()
    """Multi-head Latent Attention in every block instead of GQA when mla.kv_lora_rank > 0."""
    encoder: EncoderConfig = EncoderConfig()
    """BERT / RoBERTa parts of an encoder (kind=encoder): token types, embedding norm, position
    offset, MLM head, pooler."""
    relative: RelativeConfig = RelativeConfig()
    """T5 relative position buckets (`position=relative`)."""
    linear_attention: LinearAttentionConfig = LinearAttentionConfig()
    """The linear-attention token mixer of the blocks `layer_pattern` marks `linear`."""
    layer_pattern: tuple[str, ...] = ()
    """Token mixer per block, repeated over the layers: `linear` (model.linear_attention) or
    `full` (softmax attention), e.g. [linear, linear, linear, full] (Qwen3-Next); its length
    must divide num_layers. []: every block is `full`."""
    attn_output_gate: bool = False
    """Gate softmax attention's output per channel by sigmoid(x W_gate) before the output
    projection (Qwen3-Next's full-attention layers; `gate_proj` [D, H, K])."""
    decoder_layers: int | None = None
    """kind=encoder_decoder: blocks of the decoder stack; null means num_layers (the encoder's)."""
    vision: VisionConfig | None = None
    """A vision tower whose image features replace the image tokens' embeddings (Qwen2.5-VL,
    `jaxllm.model.vlm`); needs rope.mrope_section. null: a text-only model."""

    moved_keys: ClassVar[dict[str, str]] = {
        f"rope_{f.name}": f"rope.{f.name}" for f in dataclasses.fields(RopeConfig)
    }
    """Keys that moved into a subsection (old name -> new name): loading names the new key."""

    @property
    def causal(self) -> bool:
        """Whether self-attention is causal (a decoder's) rather than bidirectional (an
        encoder's); `kind=encoder_decoder` is causal here (its decoder's)."""
        return self.kind != "encoder"

    @property
    def resolved_decoder_layers(self) -> int:
        return self.num_layers if self.decoder_layers is None else self.decoder_layers

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def rope_dim(self) -> int:
        """Channels of each query/key head that RoPE rotates."""
        if self.mla.enabled:
            return self.mla.qk_rope_head_dim
        return int(self.resolved_head_dim * self.rope.partial_factor)

    @property
    def resolved_expert_mlp_dim(self) -> int:
        return self.mlp_dim if self.moe.expert_mlp_dim is None else self.moe.expert_mlp_dim

    @property
    def gated_mlp(self) -> bool:
        return self.mlp_activation in ("swiglu", "geglu")

    @property
    def fp8(self) -> str | None:
        """`fp8_scaling` with `matmul_dtype=float8`, else None."""
        return self.fp8_scaling if self.matmul_dtype == "float8" else None

    def layer_windows(self) -> tuple[int, ...] | None:
        """Per layer: the sliding window, or 0 for a global layer; None without windows."""
        if self.sliding_window is None:
            return None
        every = self.global_every
        return tuple(
            0 if every and (i + 1) % every == 0 else self.sliding_window
            for i in range(self.num_layers)
        )

    def validate(self) -> ModelConfig:
        """Combinations of model keys no field type can express; returns self or raises
        ConfigError. `Config.validate` calls it, and so does building a model from it."""
        self._validate_shape()
        validate_encoder_decoder(self)
        self.encoder.validate(self.kind, self.position, self.mlp_activation)
        if self.kind == "encoder" and (self.head != "lm" or self.value_head):
            _fail(
                "model.head=score and model.value_head are decoder heads; an encoder "
                "(model.kind=encoder) ends in the LM (MLM) head."
            )
        self._validate_rope()
        validate_vision(self)
        validate_hybrid(self)
        if not 0 < self.rope.partial_factor <= 1 or (
            self.rope.partial_factor != 1 and self.mla.enabled
        ):
            _fail("model.rope.partial_factor must be in (0, 1], and 1 with MLA.")
        if self.mla.enabled:  # off, its widths are ignored (as moe.* without experts)
            validate_mla(self)
        if self.sliding_window is not None and self.sliding_window < 1:
            _fail(f"model.sliding_window must be >= 1 or null, not {self.sliding_window}.")
        if self.global_every < 0 or (self.global_every and self.sliding_window is None):
            _fail("model.global_every needs model.sliding_window and must be >= 0.")
        for name in ("attn_soft_cap", "final_soft_cap", "attn_scale"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                _fail(f"model.{name} must be positive or null.")
        if self.head == "score" and (self.tie_embeddings or self.final_soft_cap is not None):
            key = "tie_embeddings" if self.tie_embeddings else "final_soft_cap"
            _fail(
                f"model.{key} acts on the LM head, which a score model (model.head=score) has "
                f"not; set model.{key}={'false' if self.tie_embeddings else 'null'}."
            )
        if self.score_bias and self.head != "score":
            _fail("model.score_bias is the score head's bias; it needs model.head=score.")
        if self.value_head and self.head == "score":
            _fail(
                "model.value_head sits beside the LM head; a score model (model.head=score) "
                "has none: set model.value_head=false or model.head=lm."
            )
        if self.distill_proj and (
            len(self.distill_proj) != 2
            or min(self.distill_proj) < 1
            or self.kind == "encoder_decoder"
        ):
            _fail(
                f"model.distill_proj must be [] or [M, D_teacher] of positive sizes on a single "
                f"stack (not model.kind=encoder_decoder), not {list(self.distill_proj)} on "
                f"kind={self.kind}."
            )
        if not 0 <= self.dropout < 1:
            _fail(f"model.dropout must be in [0, 1), not {self.dropout}.")
        if self.position == "alibi" and self.attention_impl in ("flash", "cudnn"):
            _fail(
                f"model.position=alibi needs model.attention_impl=xla (or auto): the "
                f"{self.attention_impl} kernel has no ALiBi bias."
            )
        self._validate_kernel()
        if self.cudnn_max_segments < 1:
            _fail(f"model.cudnn_max_segments must be >= 1, not {self.cudnn_max_segments}.")
        if self.attention_impl == "cudnn" and self.attn_soft_cap is not None:
            _fail("model.attn_soft_cap needs model.attention_impl xla, flash or auto, not cudnn.")
        if self.attention_impl == "cudnn" and self.attention_sinks:
            _fail("model.attention_sinks needs model.attention_impl xla, flash or auto, not cudnn.")
        if self.attention_sinks and (self.mla.enabled or self.kind == "encoder_decoder"):
            _fail(
                "model.attention_sinks is part of grouped-query attention (decoders, encoders), "
                "not of MLA (model.mla) or an encoder-decoder."
            )
        validate_fp8(self)
        return self

    def _validate_shape(self) -> None:
        """Sizes, heads and dtypes: what every later check (and the head dim) relies on."""
        positive = {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "mlp_dim": self.mlp_dim,
            "max_seq_len": self.max_seq_len,
            "scan_unroll": self.scan_unroll,
            "head_dim": 1 if self.head_dim is None else self.head_dim,
        }
        for key, value in positive.items():
            if value < 1:
                _fail(f"model.{key} must be at least 1, not {value}.")
        if self.num_heads % self.num_kv_heads:
            _fail(
                f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
                f"({self.num_kv_heads}); pick num_kv_heads from the divisors of num_heads."
            )
        if self.head_dim is None and self.d_model % self.num_heads:
            _fail(
                f"model.d_model ({self.d_model}) is not divisible by model.num_heads "
                f"({self.num_heads}); change one of them so that head_dim = d_model / num_heads "
                "is an integer."
            )
        if self.moe.enabled:
            validate_moe(self)
        elif self.moe.num_experts < 0:
            _fail(f"model.moe.num_experts must be >= 0 (0: dense), not {self.moe.num_experts}.")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                _fail(
                    f"model.{name} must be float32, bfloat16 or float16, not "
                    f"{getattr(self, name)!r}."
                )

    def _validate_kernel(self) -> None:
        if self.attention_kernel == "softmax":
            if self.gaussian_sigma != 1.0 or self.gaussian_sigma_learned:
                _fail(
                    "model.gaussian_sigma and model.gaussian_sigma_learned apply to "
                    "model.attention_kernel=gaussian, not softmax."
                )
            return
        if self.gaussian_sigma <= 0:
            _fail(f"model.gaussian_sigma must be positive, not {self.gaussian_sigma}.")
        if self.attention_impl not in ("xla", "auto"):
            _fail(
                "model.attention_kernel=gaussian runs on the xla attention: set "
                f"model.attention_impl xla or auto, not {self.attention_impl}."
            )
        refused = {
            "model.mla": self.mla.enabled,
            "model.attn_scale": self.attn_scale is not None,
            "model.attn_soft_cap": self.attn_soft_cap is not None,
            "model.kind=encoder_decoder": self.kind == "encoder_decoder",
        }
        for key, bad in refused.items():
            if bad:
                _fail(f"model.attention_kernel=gaussian does not combine with {key}.")

    def _validate_rope(self) -> None:
        r = self.rope
        if self.position != "rope":
            changed = [
                f"model.rope.{f.name}"
                for f in dataclasses.fields(r)
                if getattr(r, f.name) != f.default
            ]
            if changed:
                _fail(f"{changed[0]} only applies to model.position=rope, not {self.position}.")
        if not r.truncate and r.scaling != "yarn":
            _fail("model.rope.truncate=false only applies to model.rope.scaling=yarn.")
        if r.scaling == "none" and r.factor != 1.0:
            _fail(
                "model.rope.factor needs model.rope.scaling (linear, ntk, dynamic, yarn or llama3)."
            )
        if r.scaling == "dynamic" and (self.mla.enabled or self.kind != "decoder"):
            _fail(
                "model.rope.scaling=dynamic is supported for decoders with GQA attention, not "
                f"with MLA or model.kind={self.kind}."
            )
        if r.factor <= 0 or r.theta <= 0:
            _fail("model.rope.factor and model.rope.theta must be positive.")
        if r.local_theta is not None and r.local_theta <= 0:
            _fail("model.rope.local_theta must be positive or null.")
        if r.local_theta is not None and self.sliding_window is None:
            _fail(
                "model.rope.local_theta is the RoPE base of windowed layers: it needs "
                "model.sliding_window."
            )
        if r.scaling == "llama3" and not 0 < r.low_freq_factor < r.high_freq_factor:
            _fail("model.rope.low_freq_factor must be positive and below high_freq_factor.")
        if self.position == "rope" and self.rope_dim % 2:
            what = "model.mla.qk_rope_head_dim" if self.mla.enabled else "model.head_dim"
            _fail(f"{what} ({self.rope_dim}) must be even for RoPE.")
        validate_mrope(r, self.rope_dim, self.mla.enabled, self.kind)
