"""The `model.linear_attention` subsection (`LinearAttentionConfig`) and the hybrid layer pattern
checks (`validate_hybrid`): which blocks mix tokens by linear attention instead of softmax
attention, and with what widths."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxllm.config.errors import fail as _fail

PATTERN_ENTRIES = ("linear", "full")


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Linear-attention token mixers (`jaxllm.model.linear_attention`), used by the blocks that
    `model.layer_pattern` marks `linear`. Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464),
    as in Qwen3-Next: short causal convolutions on q/k/v, L2-normalised q and k, a gated delta
    rule with a per-head decay and write strength (beta), an output gate and RMSNorm."""

    kind: Literal["none", "gated_deltanet"] = "none"
    """`gated_deltanet`, or `none` (no linear layers; model.layer_pattern stays [])."""
    num_k_heads: int = 2
    """Query/key heads of the delta rule (Qwen3-Next: 16)."""
    num_v_heads: int = 4
    """Value heads (Qwen3-Next: 32), a multiple of num_k_heads: each q/k head serves
    num_v_heads / num_k_heads consecutive value heads."""
    k_head_dim: int = 32
    """Per-head query/key width (Qwen3-Next: 128)."""
    v_head_dim: int = 32
    """Per-head value width, the width of each head's [k_head_dim, v_head_dim] state."""
    conv_kernel: int = 4
    """Taps of the causal depthwise convolution on q, k and v (Qwen3-Next: 4)."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked (training / prefill) form of the delta rule."""

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def layer_kinds(cfg) -> tuple[str, ...]:
    """Per block: `linear` or `full` (the pattern repeated over the layers; all `full` without
    one)."""
    pattern = cfg.layer_pattern or ("full",)
    return tuple(pattern[i % len(pattern)] for i in range(cfg.num_layers))


def validate_hybrid(cfg) -> None:
    """model.layer_pattern and model.linear_attention against the rest of the model."""
    la, pattern = cfg.linear_attention, cfg.layer_pattern
    bad = [e for e in pattern if e not in PATTERN_ENTRIES]
    if bad:
        _fail(f"model.layer_pattern entries must be linear or full, not {bad[0]!r}.")
    if pattern and cfg.num_layers % len(pattern):
        _fail(
            f"model.layer_pattern ({len(pattern)} entries) must divide model.num_layers "
            f"({cfg.num_layers})."
        )
    if ("linear" in pattern) != la.enabled:
        _fail(
            "model.layer_pattern with linear entries needs model.linear_attention.kind="
            "gated_deltanet, and that kind needs linear entries in model.layer_pattern."
        )
    if not pattern:
        return
    if cfg.kind != "decoder":
        _fail(f"model.layer_pattern needs model.kind=decoder, not {cfg.kind}.")
    if la.enabled:
        if cfg.mla.enabled:
            _fail("linear layers take no MLA (model.mla.kv_lora_rank > 0); set it to 0.")
        if cfg.attn_soft_cap is not None:
            _fail("linear layers have no attention logits to cap: set model.attn_soft_cap=null.")
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_kernel"):
            if getattr(la, name) < 1:
                _fail(f"model.linear_attention.{name} must be positive.")
        if la.num_v_heads % la.num_k_heads:
            _fail(
                f"model.linear_attention.num_v_heads ({la.num_v_heads}) must be a multiple "
                f"of num_k_heads ({la.num_k_heads})."
            )
        if la.chunk_size < 1:
            _fail("model.linear_attention.chunk_size must be positive.")
    moe = cfg.moe
    if moe.num_experts and (moe.first_dense_layers or moe.moe_every != 1):
        _fail(
            "with model.layer_pattern every block is MoE: set model.moe.first_dense_layers=0 "
            "and model.moe.moe_every=1."
        )
    if cfg.sliding_window is not None or cfg.position not in ("rope", "none"):
        _fail("model.layer_pattern takes position rope or none and no sliding window.")
