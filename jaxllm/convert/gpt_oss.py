"""gpt-oss (OpenAI 2025, `GptOssForCausalLM`; gpt-oss-20b / -120b): Llama-style attention with
biases on every projection, a learned sink logit per head (`model.attention_sinks`), layers
alternating between a sliding window and full attention (`layer_types`), YaRN RoPE without
truncation, and every block a mixture of experts: a router with a bias, softmax over the top-k
logits, experts with biases and the clamped SwiGLU (`model.moe.activation=swiglu_clamped`).

Tensors as transformers 5 names them: per layer `mlp.router.weight` [E, D] / `.bias` [E],
`mlp.experts.gate_up_proj` [E, D, 2F] with gate and up interleaved on the last axis (gate at
even, up at odd), `gate_up_proj_bias` [E, 2F] alike, `down_proj` [E, F, D], `down_proj_bias`
[E, D], and `self_attn.sinks` [H]. The released checkpoints store the expert matrices as MXFP4
(`*_blocks` / `*_scales`, `jaxllm.convert.mxfp4`), which import decodes.
"""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import _dtype_name, _fail, _layer_types, _windows
from jaxllm.convert.links import Family, Link
from jaxllm.convert.llama import llama_like_hf, llama_like_links, llama_like_model

MOE = "moe_layers/moe/mlp/"
LAYER_TYPES = ("sliding_attention", "full_attention")


def _model(hf: dict) -> dict:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _fail(f"gpt-oss with hidden_act={act!r}: its experts are the clamped SwiGLU (silu).")
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            _fail(f"layer_types entries {unknown} are not supported ({', '.join(LAYER_TYPES)}).")
    else:  # transformers' default: sliding first, then alternate
        hf = {**hf, "layer_types": [LAYER_TYPES[i % 2] for i in range(hf["num_hidden_layers"])]}
    experts, top_k = hf.get("num_local_experts", 128), hf.get("num_experts_per_tok", 4)
    if not 1 <= top_k <= experts:
        _fail(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={experts}.")
    bias = bool(hf.get("attention_bias", True))
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf = {**hf, "rope_parameters": _DEFAULT_ROPE}
    return {
        **llama_like_model(hf, tie_default=False),
        "mlp_activation": "swiglu",
        **_windows(hf, all_sliding_default=False),
        "qkv_bias": bias,
        "o_bias": bias,
        "attention_sinks": True,
        "moe": {
            "num_experts": experts,
            "experts_per_token": top_k,
            "expert_mlp_dim": hf["intermediate_size"],
            "num_shared_experts": 0,
            "first_dense_layers": 0,
            "moe_every": 1,
            "router_score": "softmax",  # softmax over the top-k logits, as renormalised here
            "normalize_top_k": True,
            "route_scale": 1.0,
            "bias_update_rate": 0.0,
            "router_logit_bias": True,
            "expert_bias": True,
            "activation": "swiglu_clamped",
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
        },
    }


# transformers' GptOssConfig default when config.json has no RoPE keys
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _hf(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    if not moe.enabled:
        _fail("a dense model (model.moe.num_experts=0) has no gpt-oss checkpoint.")
    return {
        **llama_like_hf(cfg),
        "intermediate_size": cfg.resolved_expert_mlp_dim,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "sliding_window": cfg.sliding_window,
        "layer_types": _layer_types(cfg),
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "swiglu_alpha": moe.swiglu_alpha,
        "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": moe.aux_loss_weight,
        "output_router_logits": False,
        "dtype": _dtype_name(cfg),
    }


def _links(cfg: ModelConfig) -> list[Link]:
    p = "model.layers.{i}.mlp."
    return [
        *llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link("model.layers.{i}.self_attn.sinks", ("moe_layers/moe/attn/sinks",)),
        Link(p + "router.weight", (MOE + "router",), "linear"),
        Link(p + "router.bias", (MOE + "router_logit_bias",)),
        Link(p + "experts.gate_up_proj", (MOE + "gate_proj", MOE + "up_proj"), interleave=True),
        Link(
            p + "experts.gate_up_proj_bias", (MOE + "gate_bias", MOE + "up_bias"), interleave=True
        ),
        Link(p + "experts.down_proj", (MOE + "down_proj",)),
        Link(p + "experts.down_proj_bias", (MOE + "down_bias",)),
    ]


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", _model, _hf, _links)
