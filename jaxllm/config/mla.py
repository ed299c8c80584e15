"""The `model.mla` subsection: Multi-head Latent Attention (`MLAConfig`) and the checks of its
keys against the rest of the model (`validate_mla`)."""

from __future__ import annotations

import dataclasses

from jaxllm.config.errors import fail as _fail


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434; V3); off at kv_lora_rank 0.

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


def validate_mla(m) -> None:
    """The checks of `m.mla` (m: the `ModelConfig`, MLA enabled) against the attention keys."""
    a = m.mla
    dims = dict(
        q_lora_rank=a.q_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
    )
    for name, value in dims.items():
        if value < (0 if name == "q_lora_rank" else 1):
            _fail(f"model.mla.{name} must be positive, not {value}.")
    if m.position != "rope":
        _fail(
            f"MLA carries position in its decoupled RoPE key: model.position must be rope, "
            f"not {m.position}."
        )
    if m.num_kv_heads != m.num_heads or m.head_dim is not None:
        _fail(
            "MLA gives every query head its own key and value from the latent: set "
            f"model.num_kv_heads = model.num_heads ({m.num_heads}) and leave "
            "model.head_dim null (widths are model.mla.*_head_dim)."
        )
    if m.qk_norm or m.qkv_bias:
        _fail(
            "model.qk_norm and model.qkv_bias are not part of MLA (it normalises its "
            "latents); turn them off."
        )
