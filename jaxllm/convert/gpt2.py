"""GPT-2 (`gpt2`): learned absolute positions, LayerNorm, a plain GELU MLP, biases on every
projection, and `Conv1D` weights stored [in, out] with q, k and v fused into one `c_attn`."""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import _activation, _dtype_name, _fail
from jaxllm.convert.links import Family, Link


def _gpt2_model(hf: dict) -> dict:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        _fail("GPT-2 scale_attn_by_inverse_layer_idx=true (a per-layer scale) is not supported.")
    d = hf["n_embd"]
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": d,
        "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"],
        "num_kv_heads": hf["n_head"],
        "mlp_dim": hf.get("n_inner") or 4 * d,
        "max_seq_len": hf["n_positions"],
        "position": "learned",
        "norm": "layernorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        **_activation(hf.get("activation_function", "gelu_new"), gated=False),
        "qkv_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "attn_scale": None if hf.get("scale_attn_weights", True) else 1.0,
    }


def _gpt2_hf(cfg: ModelConfig) -> dict:
    acts = {"gelu": "gelu_new" if cfg.gelu_approximate else "gelu", "relu": "relu"}
    act = acts.get(cfg.mlp_activation, "gelu_new")  # others: named by the round-trip check
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.mlp_dim,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": act,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": cfg.attn_scale != 1.0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "dtype": _dtype_name(cfg),
    }


def _gpt2_links(cfg: ModelConfig) -> list[Link]:
    p, attn, mlp = "transformer.h.{i}.", "layers/attn/", "layers/mlp/"
    links = [
        Link("transformer.wte.weight", ("embed/embedding",)),
        Link("transformer.wpe.weight", ("pos_embed",)),
        Link(p + "ln_1.weight", ("layers/attn_norm/scale",)),
        Link(p + "ln_1.bias", ("layers/attn_norm/bias",)),
        Link(p + "attn.c_attn.weight", tuple(attn + f"{x}_proj" for x in "qkv"), "conv", axis=1),
        Link(p + "attn.c_attn.bias", tuple(attn + f"{x}_bias" for x in "qkv"), "flat", axis=0),
        Link(p + "attn.c_proj.weight", (attn + "o_proj",), "conv", n_in=2),
        Link(p + "attn.c_proj.bias", (attn + "o_bias",)),
        Link(p + "ln_2.weight", ("layers/mlp_norm/scale",)),
        Link(p + "ln_2.bias", ("layers/mlp_norm/bias",)),
        Link(p + "mlp.c_fc.weight", (mlp + "up_proj",), "conv"),
        Link(p + "mlp.c_fc.bias", (mlp + "up_bias",)),
        Link(p + "mlp.c_proj.weight", (mlp + "down_proj",), "conv"),
        Link(p + "mlp.c_proj.bias", (mlp + "down_bias",)),
        Link("transformer.ln_f.weight", ("final_norm/scale",)),
        Link("transformer.ln_f.bias", ("final_norm/bias",)),
    ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    return links


GPT2 = Family(
    "gpt2",
    "GPT2LMHeadModel",
    _gpt2_model,
    _gpt2_hf,
    _gpt2_links,
    ignore=(".attn.bias", ".attn.masked_bias"),
)
