"""Gemma 2 and Gemma 3 text (`gemma2`, `gemma3_text`): the Llama-like checkpoint layout with
sandwich norms (a norm after attention and after the MLP), norm scales stored as scale - 1,
scaled embeddings, logit soft caps, alternating sliding-window and global layers, and for
Gemma 3 QK-norm and a RoPE base of its own for the windowed layers."""

from __future__ import annotations

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import (
    _activation,
    _activation_name,
    _fail,
    _layer_types,
    _rope,
    _rope_to_hf,
    _windows,
)
from jaxllm.convert.links import Family
from jaxllm.convert.llama import llama_like_hf, llama_like_links, llama_like_model


def _gemma2_model(hf: dict) -> dict:
    windows = _windows(hf, all_sliding_default=False)
    if hf.get("layer_types") is None and hf.get("sliding_window") is not None:
        windows = {"sliding_window": int(hf["sliding_window"]), "global_every": 2}
    cap = hf.get("attn_logit_softcapping")
    final = hf.get("final_logit_softcapping")
    return {
        **llama_like_model(hf, tie_default=True),
        **_activation(
            hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh", True
        ),
        **windows,
        "norm_placement": "sandwich",
        "norm_offset": 1.0,
        "scale_embeddings": True,
        "attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_soft_cap": None if cap is None else float(cap),
        "final_soft_cap": None if final is None else float(final),
    }


def _gemma2_hf(cfg: ModelConfig) -> dict:
    out = llama_like_hf(cfg)
    out.pop("hidden_act")
    scalar = (cfg.attn_scale or cfg.resolved_head_dim**-0.5) ** -2
    return {
        **out,
        "hidden_activation": _activation_name(cfg),
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "attn_logit_softcapping": cfg.attn_soft_cap,
        "final_logit_softcapping": cfg.final_soft_cap,
        "sliding_window": cfg.sliding_window,
        "layer_types": _layer_types(cfg),
    }


def _gemma3_model(hf: dict) -> dict:
    """Gemma 3 text: Gemma 2's block with QK-norm, windows from `layer_types` (or the older
    `sliding_window_pattern`, default 6), and RoPE per layer type: global layers take
    rope.theta with the scaling, sliding ones rope.local_theta unscaled."""
    if hf.get("use_bidirectional_attention"):
        _fail("Gemma 3 use_bidirectional_attention=true (a non-causal encoder) is not supported.")
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern") or 6
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    global_p, local_p = _gemma3_rope_parameters(hf)
    rope_hf = {**hf, "rope_parameters": global_p, "rope_scaling": None}
    out = {
        **_gemma2_model(
            {**rope_hf, "layer_types": types, "sliding_window": hf.get("sliding_window", 4096)}
        ),
        "qk_norm": True,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
    }
    local = _rope({**hf, "rope_parameters": local_p, "rope_scaling": None})
    if set(local) != {"theta"}:
        _fail(
            f"Gemma 3 sliding-layer RoPE {local_p} is not supported: windowed layers take "
            "an unscaled base (model.rope.local_theta)."
        )
    if out.get("sliding_window") is not None:
        out["rope"]["local_theta"] = local["theta"]
    return out


def _gemma3_rope_parameters(hf: dict) -> tuple[dict, dict]:
    """(global, sliding) RoPE parameters: transformers 5 keys `rope_parameters` by layer type;
    older config.json files have rope_theta + rope_scaling and rope_local_base_freq."""
    p = hf.get("rope_parameters") or {}
    if "full_attention" in p or "sliding_attention" in p:
        global_p = {"rope_theta": 1e6, **(p.get("full_attention") or {})}
        local_p = {"rope_theta": 1e4, **(p.get("sliding_attention") or {})}
        return global_p, local_p
    global_p = {**(hf.get("rope_scaling") or {}), **p}
    global_p.setdefault("rope_theta", hf.get("rope_theta") or 1e6)
    return global_p, {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq") or 1e4}


def _gemma3_hf(cfg: ModelConfig) -> dict:
    rope = _rope_to_hf(cfg)
    local_theta = cfg.rope.theta if cfg.rope.local_theta is None else cfg.rope.local_theta
    return {
        **_gemma2_hf(cfg),
        "attention_bias": cfg.qkv_bias,
        "rope_parameters": {
            "full_attention": rope["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "rope_local_base_freq": local_theta,  # with rope_theta / rope_scaling: older readers
    }


GEMMA2 = Family(
    "gemma2",
    "Gemma2ForCausalLM",
    _gemma2_model,
    _gemma2_hf,
    lambda c: llama_like_links(c, sandwich=True),
)
GEMMA3 = Family(
    "gemma3_text",
    "Gemma3ForCausalLM",
    _gemma3_model,
    _gemma3_hf,
    lambda c: llama_like_links(c, sandwich=True),
)
