"""Pieces of the config.json <-> `ModelConfig` mapping that several families share:
activations, RoPE parameters (with YaRN's mscale), sliding-window patterns, dtypes, and the
ConfigError every refusal raises."""

from __future__ import annotations

import math

from jaxllm.config import ConfigError, ModelConfig


def _fail(msg: str):
    raise ConfigError(msg)


def _activation(name: str, gated: bool) -> dict:
    if name == "silu" and gated:
        return {"mlp_activation": "swiglu"}
    gelu = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
    if name in gelu:
        return {"mlp_activation": "geglu" if gated else "gelu", "gelu_approximate": gelu[name]}
    if name == "relu" and not gated:
        return {"mlp_activation": "relu"}
    _fail(f"activation {name!r} has no jaxllm model.mlp_activation equivalent here.")


def _activation_name(cfg: ModelConfig) -> str:
    if cfg.mlp_activation == "swiglu":
        return "silu"
    if cfg.mlp_activation in ("gelu", "geglu"):
        return "gelu_pytorch_tanh" if cfg.gelu_approximate else "gelu"
    return "silu"  # relu / relu2 in a gated family: the round-trip check names the mismatch


def _rope(hf: dict) -> dict:
    """`model.rope` fields from `rope_parameters` (transformers 5) or `rope_theta` +
    `rope_scaling`."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in p.values()):
        _fail("per-layer-type RoPE parameters (Gemma 3 style) are not supported.")
    theta = p.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = p.get("rope_type", p.get("type", "default"))
    if p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        _fail("partial_rotary_factor != 1 (RoPE on part of the head) is not supported.")
    out: dict = {"theta": float(theta)}
    original = p.get("original_max_position_embeddings")
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "scaling": "linear", "factor": float(p["factor"])}
    if kind == "dynamic":  # transformers' original context is max_position_embeddings
        original = hf["max_position_embeddings"]
        return {
            **out,
            "scaling": "dynamic",
            "factor": float(p["factor"]),
            "original_max_len": original,
        }
    if kind == "llama3":
        return {
            **out,
            "scaling": "llama3",
            "factor": float(p["factor"]),
            "low_freq_factor": float(p.get("low_freq_factor", 1.0)),
            "high_freq_factor": float(p.get("high_freq_factor", 4.0)),
            "original_max_len": original,
        }
    if kind == "yarn":
        factor = p.get("factor") or hf["max_position_embeddings"] / original
        attention = p.get("attention_factor")
        if attention is None and p.get("mscale") and p.get("mscale_all_dim"):
            # transformers' rule (DeepSeek-V2/V3 configs): the two temperatures' ratio
            mscale, all_dim = p["mscale"], p["mscale_all_dim"]
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        return {
            **out,
            "scaling": "yarn",
            "factor": float(factor),
            "beta_fast": float(p.get("beta_fast") or 32.0),
            "beta_slow": float(p.get("beta_slow") or 1.0),
            "attention_factor": None if attention is None else float(attention),
            "original_max_len": original,
            "truncate": bool(p.get("truncate", True)),
        }
    _fail(f"RoPE type {kind!r} is not supported (none, linear, dynamic, llama3 and yarn are).")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1), as
    transformers' `get_mscale` and DeepSeek's `yarn_get_mscale` compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_to_hf(cfg: ModelConfig) -> dict:
    """config.json's RoPE keys of `model.rope`: `rope_parameters` (transformers 5) and the
    older `rope_theta` + `rope_scaling`."""
    r = cfg.rope
    p: dict = {"rope_type": "default" if r.scaling == "none" else r.scaling, "rope_theta": r.theta}
    original = r.original_max_len or cfg.max_seq_len
    if r.scaling == "ntk":
        _fail("model.rope.scaling=ntk has no Hugging Face rope_type (its `dynamic` differs).")
    if r.scaling in ("linear", "dynamic"):
        p["factor"] = r.factor
    elif r.scaling == "llama3":
        p.update(
            factor=r.factor,
            low_freq_factor=r.low_freq_factor,
            high_freq_factor=r.high_freq_factor,
            original_max_position_embeddings=original,
        )
    elif r.scaling == "yarn":
        p.update(
            factor=r.factor,
            beta_fast=r.beta_fast,
            beta_slow=r.beta_slow,
            original_max_position_embeddings=original,
        )
        if r.attention_factor is not None:
            p["attention_factor"] = r.attention_factor
        if not r.truncate:
            p["truncate"] = False
    legacy = None if r.scaling == "none" else {k: v for k, v in p.items() if k != "rope_theta"}
    out = {"rope_parameters": p, "rope_theta": r.theta, "rope_scaling": legacy}
    if r.scaling == "dynamic":  # transformers' `dynamic` scales past max_position_embeddings
        out["max_position_embeddings"] = original
    return out


def _windows(hf: dict, all_sliding_default: bool) -> dict:
    """sliding_window / global_every from `layer_types` (transformers 5) or the family's rule."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    n = hf["num_hidden_layers"]
    if types is None:
        if window is None or not all_sliding_default:
            return {}
        types = ["sliding_attention"] * n
    sliding = [t == "sliding_attention" for t in types]
    if set(types) - {"sliding_attention", "full_attention"}:
        _fail(f"layer_types {sorted(set(types))} are not supported.")
    if not any(sliding):
        return {}
    if window is None:
        _fail("layer_types has sliding_attention layers but sliding_window is null.")
    every = 0 if all(sliding) else sliding.index(False) + 1
    if sliding != [not (every and (i + 1) % every == 0) for i in range(n)]:
        _fail(f"layer_types {types} is not a periodic pattern of sliding and global layers.")
    return {"sliding_window": int(window), "global_every": every}


def _layer_types(cfg: ModelConfig) -> list[str]:
    windows = cfg.layer_windows() or (0,) * cfg.num_layers
    return ["sliding_attention" if w else "full_attention" for w in windows]


def _dtype_name(cfg: ModelConfig) -> str:
    return cfg.param_dtype
