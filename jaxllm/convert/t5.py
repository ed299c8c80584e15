"""T5 (`t5`, `T5ForConditionalGeneration`): an encoder–decoder (`model.kind=encoder_decoder`)
with T5 relative position buckets, RMSNorm without bias, no attention scaling, and v1.0's ReLU
MLP with a head tied to the shared embedding (`feed_forward_proj: relu`) or v1.1's gated GELU
with an untied head (`gated-gelu`). Its relative position table lives in the first block of
each stack; here each stack holds one (`encoder_bias`, `decoder_bias`)."""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import _dtype_name, _fail
from jaxllm.convert.links import Family, Link

# feed_forward_proj -> our MLP (T5's `gated-gelu` runs gelu_new, the tanh approximation)
_ACTIVATIONS = {
    "relu": {"mlp_activation": "relu"},
    "gated-gelu": {"mlp_activation": "geglu", "gelu_approximate": True},
}


def _t5_model(hf: dict) -> dict:
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in _ACTIVATIONS:
        _fail(f"T5 feed_forward_proj={proj!r} is not supported; use relu or gated-gelu.")
    n_dec = hf.get("num_decoder_layers")
    tie = bool(hf.get("tie_word_embeddings", True))
    return {
        "kind": "encoder_decoder",
        "vocab_size": hf["vocab_size"],
        "d_model": hf["d_model"],
        "num_layers": hf["num_layers"],
        "decoder_layers": None if n_dec in (None, hf["num_layers"]) else n_dec,
        "num_heads": hf["num_heads"],
        "num_kv_heads": hf["num_heads"],
        "head_dim": hf["d_kv"],
        "mlp_dim": hf["d_ff"],
        "max_seq_len": hf.get("n_positions", 512),
        "position": "relative",
        "relative": {
            "num_buckets": hf.get("relative_attention_num_buckets", 32),
            "max_distance": hf.get("relative_attention_max_distance", 128),
        },
        "norm": "rmsnorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-6)),
        **_ACTIVATIONS[proj],
        "attn_scale": 1.0,
        "tie_embeddings": tie,
        # transformers 5 writes scale_decoder_outputs; older files scale exactly when tied
        "scale_head_input": bool(hf.get("scale_decoder_outputs", tie)),
    }


def _t5_hf(cfg: ModelConfig) -> dict:
    proj = "gated-gelu" if cfg.mlp_activation == "geglu" else "relu"
    return {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.resolved_head_dim,
        "d_ff": cfg.mlp_dim,
        "num_layers": cfg.num_layers,
        "num_decoder_layers": cfg.resolved_decoder_layers,
        "num_heads": cfg.num_heads,
        "n_positions": cfg.max_seq_len,
        "relative_attention_num_buckets": cfg.relative.num_buckets,
        "relative_attention_max_distance": cfg.relative.max_distance,
        "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": proj,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": cfg.scale_head_input,
        "is_encoder_decoder": True,
        "dropout_rate": 0.0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "dtype": _dtype_name(cfg),
    }


def _attention(hf: str, ours: str) -> list[Link]:
    """q, k, v [H*K, D] and o [D, H*K] of one T5 attention (`hf`: its name prefix)."""
    return [
        *(Link(f"{hf}.{x}.weight", (f"{ours}/{x}_proj",), "linear") for x in "qkv"),
        Link(f"{hf}.o.weight", (f"{ours}/o_proj",), "linear", n_in=2),
    ]


def _mlp(hf: str, ours: str, gated: bool) -> list[Link]:
    ins = [("wi_0", "gate_proj"), ("wi_1", "up_proj")] if gated else [("wi", "up_proj")]
    return [
        *(Link(f"{hf}.{a}.weight", (f"{ours}/{b}",), "linear") for a, b in ins),
        Link(f"{hf}.wo.weight", (f"{ours}/down_proj",), "linear"),
    ]


def _t5_links(cfg: ModelConfig) -> list[Link]:
    gated = cfg.mlp_activation == "geglu"
    e, d = "encoder.block.{i}.layer.", "decoder.block.{i}.layer."
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    links = [
        Link("shared.weight", ("embed/embedding",)),
        Link(f"encoder.{bias}", ("encoder_bias/embedding",)),
        *_attention(e + "0.SelfAttention", "encoder/attn"),
        Link(e + "0.layer_norm.weight", ("encoder/attn_norm/scale",)),
        *_mlp(e + "1.DenseReluDense", "encoder/mlp", gated),
        Link(e + "1.layer_norm.weight", ("encoder/mlp_norm/scale",)),
        Link("encoder.final_layer_norm.weight", ("encoder_norm/scale",)),
        Link(f"decoder.{bias}", ("decoder_bias/embedding",)),
        *_attention(d + "0.SelfAttention", "decoder/attn"),
        Link(d + "0.layer_norm.weight", ("decoder/attn_norm/scale",)),
        *_attention(d + "1.EncDecAttention", "decoder/cross_attn"),
        Link(d + "1.layer_norm.weight", ("decoder/cross_norm/scale",)),
        *_mlp(d + "2.DenseReluDense", "decoder/mlp", gated),
        Link(d + "2.layer_norm.weight", ("decoder/mlp_norm/scale",)),
        Link("decoder.final_layer_norm.weight", ("final_norm/scale",)),
    ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    return links


T5 = Family(
    "t5",
    "T5ForConditionalGeneration",
    _t5_model,
    _t5_hf,
    _t5_links,
    ignore=("embed_tokens.weight",),  # copies of shared.weight in some files
)
