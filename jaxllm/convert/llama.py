"""Llama-like Hugging Face families: Llama, Mistral, Qwen2 / Qwen3 (dense) and Mixtral (every
block a mixture of experts). Their checkpoints share one naming of embedding, attention, norms
and head (`llama_like_links`, which Gemma's families reuse), and one config.json core
(`llama_like_model`, `llama_like_hf`)."""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import (
    _activation,
    _activation_name,
    _dtype_name,
    _fail,
    _layer_types,
    _rope,
    _rope_to_hf,
    _windows,
)
from jaxllm.convert.links import Family, Link


def llama_like_model(hf: dict, *, tie_default: bool) -> dict:
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // h
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": d,
        "num_layers": hf["num_hidden_layers"],
        "num_heads": h,
        "num_kv_heads": hf.get("num_key_value_heads") or h,
        "head_dim": None if head_dim * h == d else head_dim,
        "mlp_dim": hf["intermediate_size"],
        "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", tie_default)),
        "rope": _rope(hf),
    }


def llama_like_hf(cfg: ModelConfig) -> dict:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": _activation_name(cfg),
        "dtype": _dtype_name(cfg),
        **_rope_to_hf(cfg),
    }


def llama_like_links(
    cfg: ModelConfig, *, sandwich: bool = False, block: str = "layers/", dense_mlp: bool = True
) -> list[Link]:
    """Embedding, attention, norms and head of a Llama-style checkpoint; the blocks' stacked
    parameters live under `block` (`moe_layers/moe/` when every block is MoE), and their
    dense MLP is linked when `dense_mlp`."""
    p = "model.layers.{i}."
    attn, mlp = block + "attn/", block + "mlp/"
    links = [
        Link("model.embed_tokens.weight", ("embed/embedding",)),
        Link(p + "input_layernorm.weight", (block + "attn_norm/scale",)),
        Link(p + "self_attn.q_proj.weight", (attn + "q_proj",), "linear"),
        Link(p + "self_attn.k_proj.weight", (attn + "k_proj",), "linear"),
        Link(p + "self_attn.v_proj.weight", (attn + "v_proj",), "linear"),
        Link(p + "self_attn.o_proj.weight", (attn + "o_proj",), "linear", n_in=2),
        Link("model.norm.weight", ("final_norm/scale",)),
    ]
    if dense_mlp:
        links += [
            Link(p + f"mlp.{x}_proj.weight", (mlp + f"{x}_proj",), "linear")
            for x in ("gate", "up", "down")
        ]
    if sandwich:
        links += [
            Link(p + "post_attention_layernorm.weight", (block + "post_attn_norm/scale",)),
            Link(p + "pre_feedforward_layernorm.weight", (block + "mlp_norm/scale",)),
            Link(p + "post_feedforward_layernorm.weight", (block + "post_mlp_norm/scale",)),
        ]
    else:
        links.append(Link(p + "post_attention_layernorm.weight", (block + "mlp_norm/scale",)))
    if cfg.qkv_bias:
        links += [
            Link(p + f"self_attn.{x}_proj.bias", (attn + f"{x}_bias",), "flat") for x in "qkv"
        ]
    if cfg.o_bias:
        links.append(Link(p + "self_attn.o_proj.bias", (attn + "o_bias",)))
    if cfg.qk_norm:
        links += [Link(p + f"self_attn.{x}_norm.weight", (f"{attn}{x}_norm/scale",)) for x in "qk"]
    if cfg.mlp_bias and dense_mlp:
        links += [
            Link(p + f"mlp.{x}_proj.bias", (f"{mlp}{x}_bias",)) for x in ("gate", "up", "down")
        ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    return links


def _llama_model(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {
        **llama_like_model(hf, tie_default=False),
        **_activation(hf.get("hidden_act", "silu"), True),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def _llama_hf(cfg: ModelConfig) -> dict:
    return {**llama_like_hf(cfg), "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


def _mistral_model(hf: dict) -> dict:
    return {
        **llama_like_model(hf, tie_default=False),
        **_activation(hf.get("hidden_act", "silu"), True),
        **_windows(hf, all_sliding_default=True),
    }


def _mistral_hf(cfg: ModelConfig) -> dict:
    return {**llama_like_hf(cfg), "sliding_window": cfg.sliding_window}


def _mixtral_model(hf: dict) -> dict:
    """Mixtral (Jiang et al. 2024, arXiv:2401.04088): Mistral attention, every block a top-k
    of E SwiGLU experts with a softmax router renormalised over the chosen k, as
    `jaxllm.model.moe.route` with router_score=softmax and normalize_top_k."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _fail(f"Mixtral with hidden_act={act!r}: jaxllm's experts are SwiGLU (silu) only.")
    if hf.get("router_jitter_noise") or 0.0:
        _fail(
            f"router_jitter_noise={hf['router_jitter_noise']} (multiplicative noise on the "
            "expert inputs in training) is not supported; set it to 0."
        )
    experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        _fail(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={experts}.")
    moe = {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_mlp_dim": hf["intermediate_size"],
        "num_shared_experts": 0,
        "first_dense_layers": 0,
        "moe_every": 1,
        "router_score": "softmax",
        "normalize_top_k": True,
        "route_scale": 1.0,
        "bias_update_rate": 0.0,
        "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    return {
        **llama_like_model(hf, tie_default=False),
        "mlp_activation": "swiglu",
        **_windows(hf, all_sliding_default=True),
        "moe": moe,
    }


def _mixtral_hf(cfg: ModelConfig) -> dict:
    """config.json of a Mixtral. `output_router_logits` stays false as in released Mixtral
    checkpoints (it turns on transformers' aux loss in training); the coefficient is ours."""
    if not cfg.moe.enabled:
        _fail(
            "a dense model (model.moe.num_experts=0) has no Mixtral checkpoint; export it as "
            "llama or mistral."
        )
    return {
        **llama_like_hf(cfg),
        "intermediate_size": cfg.resolved_expert_mlp_dim,
        "hidden_act": "silu",
        "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.experts_per_token,
        "router_aux_loss_coef": cfg.moe.aux_loss_weight,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }


def _mixtral_links(cfg: ModelConfig) -> list[Link]:
    """Released Mixtral checkpoints (and transformers 5's `save_pretrained`): the router and
    every expert's w1 (gate), w3 (up), w2 (down) as separate torch Linear weights."""
    p, moe = "model.layers.{i}.block_sparse_moe.", "moe_layers/moe/mlp/"
    return [
        *llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link(p + "gate.weight", (moe + "router",), "linear"),
        Link(p + "experts.{j}.w1.weight", (moe + "gate_proj",), "linear"),
        Link(p + "experts.{j}.w3.weight", (moe + "up_proj",), "linear"),
        Link(p + "experts.{j}.w2.weight", (moe + "down_proj",), "linear"),
    ]


def _mixtral_fused_links(cfg: ModelConfig) -> list[Link]:
    """transformers 5's in-memory layout (`save_pretrained(save_original_format=False)`):
    per layer, `gate_up_proj` [E, 2F, D] (gate rows, then up rows) and `down_proj` [E, D, F]."""
    p, moe = "model.layers.{i}.mlp.", "moe_layers/moe/mlp/"
    gate_up = (moe + "gate_proj", moe + "up_proj")
    return [
        *llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link(p + "gate.weight", (moe + "router",), "linear"),
        Link(p + "experts.gate_up_proj", gate_up, "linear", axis=-2, n_lead=1),
        Link(p + "experts.down_proj", (moe + "down_proj",), "linear", n_lead=1),
    ]


def _qwen_model(hf: dict, qwen3: bool) -> dict:
    if hf.get("use_sliding_window") and hf.get("layer_types") is None:
        _fail("Qwen use_sliding_window without layer_types is not supported.")
    out = {
        **llama_like_model(hf, tie_default=False),
        **_activation(hf.get("hidden_act", "silu"), True),
        **_windows(hf, all_sliding_default=False),
    }
    if qwen3:
        bias = bool(hf.get("attention_bias", False))
        return {**out, "qk_norm": True, "qkv_bias": bias, "o_bias": bias}
    return {**out, "qkv_bias": True}


def _qwen_hf(cfg: ModelConfig, qwen3: bool) -> dict:
    out = {
        **llama_like_hf(cfg),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,
        "layer_types": _layer_types(cfg),
        "max_window_layers": cfg.num_layers,
    }
    if qwen3:
        out["attention_bias"] = cfg.qkv_bias
    return out


LLAMA = Family("llama", "LlamaForCausalLM", _llama_model, _llama_hf, llama_like_links)
MISTRAL = Family("mistral", "MistralForCausalLM", _mistral_model, _mistral_hf, llama_like_links)
QWEN2 = Family(
    "qwen2",
    "Qwen2ForCausalLM",
    lambda hf: _qwen_model(hf, False),
    lambda c: _qwen_hf(c, False),
    llama_like_links,
)
QWEN3 = Family(
    "qwen3",
    "Qwen3ForCausalLM",
    lambda hf: _qwen_model(hf, True),
    lambda c: _qwen_hf(c, True),
    llama_like_links,
)
MIXTRAL = Family(
    "mixtral",
    "MixtralForCausalLM",
    _mixtral_model,
    _mixtral_hf,
    _mixtral_links,
    other_links=(_mixtral_fused_links,),
)
