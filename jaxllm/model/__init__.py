"""Llama-style decoder in Flax NNX: math only, no mesh.

Shape legend used in names throughout (`q_BxLxHxK` is a query of shape [B, L, H, K]):

    B batch      L query length   S key/value length   D model width (d_model)
    H heads      G kv heads       R query heads per kv head (H / G)
    K head dim   F mlp hidden     V vocabulary          N layers
    E experts    X experts per token (top-k)             C capacity slots per expert
    T tokens (B * L, flattened)   A assignments (T * X)

Every parameter is an `nnx.Param` whose `axes` metadata names its logical axes
(`('embed', 'mlp')`); `jaxllm.sharding` alone maps those to mesh axes. What runs per device
under a mesh (kernels, ring attention, MoE dispatch) goes through `jaxllm.parallel`.
"""

from jaxllm.model.abstract import (
    abstract_frozen,
    abstract_model,
    abstract_model_state,
    fresh_where_missing,
)
from jaxllm.model.attention import Attention, dot_product_attention
from jaxllm.model.encoder_decoder import EncoderDecoder
from jaxllm.model.layers import Embed, LayerNorm, RMSNorm, logical_axes, make_norm, matmul
from jaxllm.model.mla import MLAttention, make_attention
from jaxllm.model.mlp import MLP
from jaxllm.model.moe import MoE, RouterBias
from jaxllm.model.mrope import mrope_positions, mrope_rows
from jaxllm.model.outputs import AttentionOutput, ModelOutput, MoEOutput
from jaxllm.model.positions import alibi_slopes, apply_rope, rope_frequencies
from jaxllm.model.transformer import (
    Block,
    Transformer,
    attach_peft,
    build,
    init_keys,
    merge_model,
    split_peft,
)
from jaxllm.model.vlm import VisionLanguageModel

__all__ = [
    "Attention",
    "AttentionOutput",
    "MLAttention",
    "Block",
    "Embed",
    "EncoderDecoder",
    "LayerNorm",
    "MLP",
    "RMSNorm",
    "Transformer",
    "VisionLanguageModel",
    "abstract_frozen",
    "abstract_model",
    "attach_peft",
    "abstract_model_state",
    "fresh_where_missing",
    "alibi_slopes",
    "apply_rope",
    "build",
    "init_keys",
    "merge_model",
    "split_peft",
    "dot_product_attention",
    "logical_axes",
    "make_attention",
    "make_norm",
    "matmul",
    "mrope_positions",
    "mrope_rows",
    "MoE",
    "MoEOutput",
    "ModelOutput",
    "RouterBias",
    "rope_frequencies",
]
