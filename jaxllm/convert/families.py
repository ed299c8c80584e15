"""Hugging Face model families: `config.json` <-> `ModelConfig`, and tensor names <-> parameters.

A `Family` (`links.py`) knows one `model_type`: how its config.json maps to `ModelConfig` fields
(`to_model`, refusing with ConfigError what the knobs cannot express), the config.json of a
model (`to_hf`), and the `Link`s between its safetensors names and our parameter paths. Every
transform is a reshape, a transpose or a split/concatenation, so importing and exporting give
back the same bytes. This module holds the Llama-like, Mixtral, Gemma and GPT-2 families, the
registry `FAMILIES` (DeepSeek's families live in `deepseek.py`), and the checks that an exported
config.json says what the model is.
"""

from __future__ import annotations

import dataclasses
import math

from jaxllm import config as config_lib
from jaxllm.config import ConfigError, ModelConfig, MoEConfig
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
from jaxllm.convert.deepseek import (
    _beyond_last_layer,
    _deepseek_links,
    _deepseek_v2_hf,
    _deepseek_v2_model,
    _deepseek_v3_hf,
    _deepseek_v3_model,
)
from jaxllm.convert.links import Family, Link

# ModelConfig fields that are training or compute choices, not part of a checkpoint.
NOT_ARCHITECTURE = frozenset(
    {"dtype", "param_dtype", "scan_unroll", "remat", "attention_impl", "init_std", "dropout"}
)
# MoEConfig fields of the same kind: how experts are dispatched and the balancing losses.
MOE_NOT_ARCHITECTURE = frozenset(
    {"dispatch", "capacity_factor", "aux_loss_weight", "router_z_loss_weight", "bias_update_rate"}
)
# ModelConfig fields of the dense MLP, which a model whose every block is MoE does not use.
DENSE_MLP = frozenset({"mlp_dim", "mlp_activation", "gelu_approximate", "mlp_bias"})


def _llama_like_model(hf: dict, *, tie_default: bool) -> dict:
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // h
    return {
        "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["num_hidden_layers"],
        "num_heads": h, "num_kv_heads": hf.get("num_key_value_heads") or h,
        "head_dim": None if head_dim * h == d else head_dim,
        "mlp_dim": hf["intermediate_size"], "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", tie_default)),
        **_rope(hf),
    }  # fmt: skip


def _llama_like_hf(cfg: ModelConfig) -> dict:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.mlp_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": _activation_name(cfg), "dtype": _dtype_name(cfg), **_rope_to_hf(cfg),
    }  # fmt: skip


def _llama_like_links(cfg: ModelConfig, *, sandwich: bool = False, block: str = "layers/",
                      dense_mlp: bool = True) -> list[Link]:  # fmt: skip
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
        links += [Link(p + f"mlp.{x}_proj.weight", (mlp + f"{x}_proj",), "linear")
                  for x in ("gate", "up", "down")]  # fmt: skip
    if sandwich:
        links += [
            Link(p + "post_attention_layernorm.weight", (block + "post_attn_norm/scale",)),
            Link(p + "pre_feedforward_layernorm.weight", (block + "mlp_norm/scale",)),
            Link(p + "post_feedforward_layernorm.weight", (block + "post_mlp_norm/scale",)),
        ]
    else:
        links.append(Link(p + "post_attention_layernorm.weight", (block + "mlp_norm/scale",)))
    if cfg.qkv_bias:
        links += [Link(p + f"self_attn.{x}_proj.bias", (attn + f"{x}_bias",), "flat")
                  for x in "qkv"]  # fmt: skip
    if cfg.o_bias:
        links.append(Link(p + "self_attn.o_proj.bias", (attn + "o_bias",)))
    if cfg.qk_norm:
        links += [Link(p + f"self_attn.{x}_norm.weight", (f"{attn}{x}_norm/scale",))
                  for x in "qk"]  # fmt: skip
    if cfg.mlp_bias and dense_mlp:
        links += [Link(p + f"mlp.{x}_proj.bias", (f"{mlp}{x}_bias",))
                  for x in ("gate", "up", "down")]  # fmt: skip
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    return links


def _llama_model(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {**_llama_like_model(hf, tie_default=False), **_activation(hf.get("hidden_act", "silu"), True),
            "qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}  # fmt: skip


def _llama_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_hf(cfg), "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


def _mistral_model(hf: dict) -> dict:
    return {**_llama_like_model(hf, tie_default=False), **_activation(hf.get("hidden_act", "silu"), True),
            **_windows(hf, all_sliding_default=True)}  # fmt: skip


def _mistral_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_hf(cfg), "sliding_window": cfg.sliding_window}


def _mixtral_model(hf: dict) -> dict:
    """Mixtral (Jiang et al. 2024, arXiv:2401.04088): Mistral attention, every block a top-k
    of E SwiGLU experts with a softmax router renormalised over the chosen k, as
    `jaxllm.model.moe.route` with router_score=softmax and normalize_top_k."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _fail(f"Mixtral with hidden_act={act!r}: jaxllm's experts are SwiGLU (silu) only.")
    if hf.get("router_jitter_noise") or 0.0:
        _fail(f"router_jitter_noise={hf['router_jitter_noise']} (multiplicative noise on the "
              "expert inputs in training) is not supported; set it to 0.")  # fmt: skip
    experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        _fail(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={experts}.")
    moe = {
        "num_experts": experts, "experts_per_token": top_k,
        "expert_mlp_dim": hf["intermediate_size"], "num_shared_experts": 0,
        "first_dense_layers": 0, "moe_every": 1, "router_score": "softmax",
        "normalize_top_k": True, "route_scale": 1.0, "bias_update_rate": 0.0,
        "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.001)),
    }  # fmt: skip
    return {**_llama_like_model(hf, tie_default=False), "mlp_activation": "swiglu",
            **_windows(hf, all_sliding_default=True), "moe": moe}  # fmt: skip


def _mixtral_hf(cfg: ModelConfig) -> dict:
    """config.json of a Mixtral. `output_router_logits` stays false as in released Mixtral
    checkpoints (it turns on transformers' aux loss in training); the coefficient is ours."""
    if not cfg.moe.enabled:
        _fail("a dense model (model.moe.num_experts=0) has no Mixtral checkpoint; export it as "
              "llama or mistral.")  # fmt: skip
    return {
        **_llama_like_hf(cfg), "intermediate_size": cfg.resolved_expert_mlp_dim,
        "hidden_act": "silu", "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.experts_per_token,
        "router_aux_loss_coef": cfg.moe.aux_loss_weight, "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }  # fmt: skip


def _mixtral_links(cfg: ModelConfig) -> list[Link]:
    """Released Mixtral checkpoints (and transformers 5's `save_pretrained`): the router and
    every expert's w1 (gate), w3 (up), w2 (down) as separate torch Linear weights."""
    p, moe = "model.layers.{i}.block_sparse_moe.", "moe_layers/moe/mlp/"
    return [
        *_llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
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
        *_llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link(p + "gate.weight", (moe + "router",), "linear"),
        Link(p + "experts.gate_up_proj", gate_up, "linear", axis=-2, n_lead=1),
        Link(p + "experts.down_proj", (moe + "down_proj",), "linear", n_lead=1),
    ]


def _qwen_model(hf: dict, qwen3: bool) -> dict:
    if hf.get("use_sliding_window") and hf.get("layer_types") is None:
        _fail("Qwen use_sliding_window without layer_types is not supported.")
    out = {**_llama_like_model(hf, tie_default=False), **_activation(hf.get("hidden_act", "silu"), True),
           **_windows(hf, all_sliding_default=False)}  # fmt: skip
    if qwen3:
        bias = bool(hf.get("attention_bias", False))
        return {**out, "qk_norm": True, "qkv_bias": bias, "o_bias": bias}
    return {**out, "qkv_bias": True}


def _qwen_hf(cfg: ModelConfig, qwen3: bool) -> dict:
    out = {**_llama_like_hf(cfg), "sliding_window": cfg.sliding_window,
           "use_sliding_window": cfg.sliding_window is not None,
           "layer_types": _layer_types(cfg), "max_window_layers": cfg.num_layers}  # fmt: skip
    if qwen3:
        out["attention_bias"] = cfg.qkv_bias
    return out


def _gemma2_model(hf: dict) -> dict:
    windows = _windows(hf, all_sliding_default=False)
    if hf.get("layer_types") is None and hf.get("sliding_window") is not None:
        windows = {"sliding_window": int(hf["sliding_window"]), "global_every": 2}
    cap = hf.get("attn_logit_softcapping")
    final = hf.get("final_logit_softcapping")
    return {
        **_llama_like_model(hf, tie_default=True),
        **_activation(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
                      True),
        **windows,
        "norm_placement": "sandwich", "norm_offset": 1.0, "scale_embeddings": True,
        "attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_soft_cap": None if cap is None else float(cap),
        "final_soft_cap": None if final is None else float(final),
    }  # fmt: skip


def _gemma2_hf(cfg: ModelConfig) -> dict:
    out = _llama_like_hf(cfg)
    out.pop("hidden_act")
    scalar = (cfg.attn_scale or cfg.resolved_head_dim**-0.5) ** -2
    return {
        **out, "hidden_activation": _activation_name(cfg),
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "attn_logit_softcapping": cfg.attn_soft_cap, "final_logit_softcapping": cfg.final_soft_cap,
        "sliding_window": cfg.sliding_window, "layer_types": _layer_types(cfg),
    }  # fmt: skip


def _gemma3_model(hf: dict) -> dict:
    """Gemma 3 text: Gemma 2's block with QK-norm, windows from `layer_types` (or the older
    `sliding_window_pattern`, default 6), and RoPE per layer type: global layers take
    rope_theta with the scaling, sliding ones rope_local_theta unscaled."""
    if hf.get("use_bidirectional_attention"):
        _fail("Gemma 3 use_bidirectional_attention=true (a non-causal encoder) is not supported.")
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("sliding_window_pattern") or 6
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(hf["num_hidden_layers"])]  # fmt: skip
    global_p, local_p = _gemma3_rope_parameters(hf)
    rope_hf = {**hf, "rope_parameters": global_p, "rope_scaling": None}
    out = {
        **_gemma2_model({**rope_hf, "layer_types": types,
                         "sliding_window": hf.get("sliding_window", 4096)}),
        "qk_norm": True, "qkv_bias": bool(hf.get("attention_bias", False)),
        "o_bias": bool(hf.get("attention_bias", False)),
    }  # fmt: skip
    local = _rope({**hf, "rope_parameters": local_p, "rope_scaling": None})
    if set(local) != {"rope_theta"}:
        _fail(f"Gemma 3 sliding-layer RoPE {local_p} is not supported: windowed layers take "
              "an unscaled base (model.rope_local_theta).")  # fmt: skip
    if out.get("sliding_window") is not None:
        out["rope_local_theta"] = local["rope_theta"]
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
    local_theta = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    return {
        **_gemma2_hf(cfg), "attention_bias": cfg.qkv_bias,
        "rope_parameters": {
            "full_attention": rope["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "rope_local_base_freq": local_theta,  # with rope_theta / rope_scaling: older readers
    }  # fmt: skip


def _gpt2_model(hf: dict) -> dict:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        _fail("GPT-2 scale_attn_by_inverse_layer_idx=true (a per-layer scale) is not supported.")
    d = hf["n_embd"]
    return {
        "vocab_size": hf["vocab_size"], "d_model": d, "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"], "num_kv_heads": hf["n_head"], "mlp_dim": hf.get("n_inner") or 4 * d,
        "max_seq_len": hf["n_positions"], "position": "learned", "norm": "layernorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        **_activation(hf.get("activation_function", "gelu_new"), gated=False),
        "qkv_bias": True, "o_bias": True, "mlp_bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "attn_scale": None if hf.get("scale_attn_weights", True) else 1.0,
    }  # fmt: skip


def _gpt2_hf(cfg: ModelConfig) -> dict:
    acts = {"gelu": "gelu_new" if cfg.gelu_approximate else "gelu", "relu": "relu"}
    act = acts.get(cfg.mlp_activation, "gelu_new")  # others: named by the round-trip check
    return {
        "vocab_size": cfg.vocab_size, "n_embd": cfg.d_model, "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads, "n_inner": cfg.mlp_dim, "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps, "activation_function": act,
        "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": cfg.attn_scale != 1.0,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": _dtype_name(cfg),
    }  # fmt: skip


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


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", _llama_model, _llama_hf, _llama_like_links),
        Family("mistral", "MistralForCausalLM", _mistral_model, _mistral_hf, _llama_like_links),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            lambda hf: _qwen_model(hf, False),
            lambda c: _qwen_hf(c, False),
            _llama_like_links,
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            lambda hf: _qwen_model(hf, True),
            lambda c: _qwen_hf(c, True),
            _llama_like_links,
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            _gemma2_model,
            _gemma2_hf,
            lambda c: _llama_like_links(c, sandwich=True),
        ),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            _gemma3_model,
            _gemma3_hf,
            lambda c: _llama_like_links(c, sandwich=True),
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            _mixtral_model,
            _mixtral_hf,
            _mixtral_links,
            other_links=(_mixtral_fused_links,),
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            _deepseek_v3_model,
            _deepseek_v3_hf,
            _deepseek_links,
            other_links=(lambda c: _deepseek_links(c, fused=True),),
            skip=_beyond_last_layer,
        ),
        Family(
            "deepseek_v2",
            "DeepseekV2ForCausalLM",
            _deepseek_v2_model,
            _deepseek_v2_hf,
            _deepseek_links,
            other_links=(lambda c: _deepseek_links(c, fused=True),),
        ),
        Family(
            "gpt2",
            "GPT2LMHeadModel",
            _gpt2_model,
            _gpt2_hf,
            _gpt2_links,
            ignore=(".attn.bias", ".attn.masked_bias"),
        ),
    )  # fmt: skip
}


def family_of(hf: dict) -> Family:
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        _fail(f"model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}.")
    return FAMILIES[kind]


def model_fields(hf: dict, source="config.json") -> dict:
    """The ModelConfig fields of a config.json (architecture only). A key the family needs that
    the file (`source`) lacks, or a value of the wrong type, is a ConfigError naming it rather
    than a KeyError or TypeError from deep inside the mapping."""
    family = family_of(hf)
    try:
        return family.to_model(hf)
    except ConfigError:
        raise
    except KeyError as e:
        raise ConfigError(
            f"{source} has no {e.args[0]!r}, which a {family.name} config.json needs; use the "
            "model's complete config.json."
        ) from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ConfigError(
            f"{source} holds a value of the wrong type or range ({first_line(e)}); compare it "
            "with the model's original config.json."
        ) from None


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (ConfigError messages are one line)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def guess_family(cfg: ModelConfig) -> Family:
    """The family a model exports as when none is named: the one its knobs point to."""
    if cfg.mla.enabled and cfg.moe.enabled and cfg.moe.router_score == "softmax":
        return FAMILIES["deepseek_v2"]
    if cfg.mla.enabled:
        return FAMILIES["deepseek_v3"]
    if cfg.moe.enabled:
        return FAMILIES["mixtral"]
    if cfg.position == "learned":
        return FAMILIES["gpt2"]
    if cfg.norm_placement == "sandwich":  # Gemma 2 has neither QK-norm nor a local RoPE base
        gemma3 = cfg.rope_local_theta is not None or cfg.qk_norm
        return FAMILIES["gemma3_text" if gemma3 else "gemma2"]
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.qkv_bias and not cfg.o_bias:
        return FAMILIES["qwen2"]
    if cfg.sliding_window is not None:
        return FAMILIES["mistral"]
    return FAMILIES["llama"]


def hf_config(cfg: ModelConfig, family: Family) -> dict:
    """config.json of `cfg` as `family`; ConfigError naming the knobs the family cannot hold
    (found by reading the written config back and comparing)."""
    out = {"architectures": [family.architecture], "model_type": family.name, **family.to_hf(cfg)}
    try:
        back = config_lib.from_dict({"model": family.to_model(out)}).model
    except ConfigError as e:
        _fail(f"this model cannot be expressed in a {family.name} checkpoint: {e}")
    diff = _differences(cfg, back)
    if diff:
        _fail(f"{', '.join(diff)} cannot be expressed in a {family.name} checkpoint; export as "
              f"another family (--family) or change the model.")  # fmt: skip
    return out


def _differences(cfg: ModelConfig, back: ModelConfig) -> list[str]:
    """The architecture knobs of `cfg` that `back` (its config.json read back) lost."""
    skip = NOT_ARCHITECTURE | {"moe"}
    if not (_has_dense_blocks(cfg) or _has_dense_blocks(back)):
        skip |= DENSE_MLP
    diff = [
        f"model.{f.name}={getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in skip and not _same(f.name, getattr(cfg, f.name), getattr(back, f.name), cfg)
    ]  # fmt: skip
    if not (cfg.moe.enabled or back.moe.enabled):
        return diff
    if cfg.moe.enabled != back.moe.enabled:  # the other MoE knobs mean nothing to a dense side
        return [*diff, f"model.moe.num_experts={cfg.moe.num_experts}"]
    diff += [
        f"model.moe.{f.name}={getattr(cfg.moe, f.name)!r}"
        for f in dataclasses.fields(MoEConfig)
        if f.name not in MOE_NOT_ARCHITECTURE | {"router_bias"}
        and not (f.name == "expert_mlp_dim"
                 and cfg.resolved_expert_mlp_dim == back.resolved_expert_mlp_dim)
        and not _same(f.name, getattr(cfg.moe, f.name), getattr(back.moe, f.name), cfg)
    ]  # fmt: skip
    if cfg.moe.has_router_bias != back.moe.has_router_bias:  # a bias the family lacks, or needs
        rate = cfg.moe.bias_update_rate
        diff.append(f"model.moe.bias_update_rate={rate!r}" if rate > 0
                    else f"model.moe.router_bias={cfg.moe.router_bias!r}")  # fmt: skip
    return diff


def _has_dense_blocks(cfg: ModelConfig) -> bool:
    moe = cfg.moe
    return not moe.enabled or moe.first_dense_layers > 0 or moe.moe_every > 1


def _same(name: str, a, b, cfg: ModelConfig) -> bool:
    if name == "head_dim":
        return cfg.resolved_head_dim == (b or cfg.d_model // cfg.num_heads)
    if name == "rope_local_theta" and cfg.rope_scaling == "none":  # null: rope_theta
        return math.isclose(a or cfg.rope_theta, b or cfg.rope_theta)
    if name == "rope_original_max_len":
        return (a or cfg.max_seq_len) == (b or cfg.max_seq_len)
    if name == "attn_scale":
        default = (cfg.mla.qk_head_dim if cfg.mla.enabled else cfg.resolved_head_dim) ** -0.5
        return math.isclose(a or default, b or default)
    if name.startswith("rope_") and cfg.position != "rope":
        return True
    if name == "group_score" and cfg.moe.groups_per_token == cfg.moe.num_groups:
        return True  # no group limit: how groups would be ranked does not matter
    if name == "gelu_approximate" and cfg.mlp_activation not in ("gelu", "geglu"):
        return True
    if name == "global_every" and cfg.sliding_window is None:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b
