"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 (`deepseek_v2`, `deepseek_v3`): Multi-head Latent
Attention, dense-then-MoE blocks (two stacks here, `Link.offset` numbers the MoE stack's HF
layers), softmax (V2) or sigmoid (V3) routing with group limits, and V3's routing bias, which is
model state (`RouterBias`), not a parameter."""

from __future__ import annotations

import math

from jaxllm.config import ModelConfig
from jaxllm.convert.config_map import _dtype_name, _fail, _rope, _rope_to_hf, _yarn_mscale
from jaxllm.convert.links import Family, Link


def _shared_experts(hf: dict, default: int, version: str) -> int:
    shared = hf.get("n_shared_experts", default)
    if not shared:
        _fail(
            f"DeepSeek-{version} with n_shared_experts=0 is not supported (transformers builds "
            "zero-width shared experts); jaxllm needs at least one shared expert here."
        )
    return shared


def _deepseek_v3_model(hf: dict) -> dict:
    """DeepSeek-V3 (arXiv:2412.19437) as transformers runs it: Multi-head Latent Attention in
    every block (`model.mla`, RoPE on interleaved channel pairs unless rope_interleave=false),
    the first `first_k_dense_replace` blocks with a dense SwiGLU MLP and the rest MoE: sigmoid
    router scores plus the `e_score_correction_bias` for the choice (a frozen `RouterBias`),
    group-limited top-k (n_group / topk_group), renormalised weights times
    routed_scaling_factor, and shared experts. With YaRN, `mscale_all_dim` sharpens the
    softmax (attn_scale) and mscale / mscale_all_dim set the cos/sin factor."""
    out = _deepseek_mla_model(hf, "DeepSeek-V3")
    out["rope"]["interleave"] = bool(hf.get("rope_interleave", True))
    return {**out, "moe": _deepseek_moe(hf)}


def _deepseek_mla_model(hf: dict, name: str) -> dict:
    """The fields DeepSeek-V2 and V3 config.json share (all but RoPE's pair order and the
    MoE): MLA shapes, YaRN and its softmax scale, SwiGLU MLPs without biases."""
    if hf.get("hidden_act", "silu") != "silu":
        _fail(
            f"{name} with hidden_act={hf['hidden_act']!r}: jaxllm's experts and shared "
            "experts are SwiGLU (silu) only."
        )
    if hf.get("attention_bias"):
        _fail(
            f"{name} with attention_bias=true (biases on q_a / kv_a / o projections) is "
            "not supported: jaxllm's MLA has no projection biases."
        )
    h = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or h) != h:
        _fail(
            f"{name} with num_key_value_heads={hf['num_key_value_heads']} != "
            f"num_attention_heads={h}: MLA expands the latent into every head."
        )
    mla = {
        "kv_lora_rank": hf["kv_lora_rank"],
        "q_lora_rank": hf.get("q_lora_rank") or 0,
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
    }
    rope = _rope(hf)
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": h,
        "num_kv_heads": h,
        "head_dim": None,
        "mlp_dim": hf["intermediate_size"],
        "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "mlp_activation": "swiglu",
        "attn_scale": _deepseek_scale(hf, rope),
        "mla": mla,
        "rope": rope,
    }


def _deepseek_scale(hf: dict, rope: dict) -> float | None:
    """transformers' `yarn_apply_mscale`: with a scaled RoPE (any rope_type but default) and
    `mscale_all_dim`, the softmax scale qk_head_dim^-0.5 is multiplied by
    mscale(factor, mscale_all_dim)^2; null (the default scale) otherwise."""
    p = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    all_dim = p.get("mscale_all_dim")
    if rope.get("scaling", "none") == "none" or not all_dim:
        return None
    m = _yarn_mscale(rope["factor"], all_dim)
    return None if m == 1 else (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5 * m * m


def _deepseek_moe(hf: dict) -> dict:
    """model.moe of a DeepSeek-V3 config.json; {} (dense) when every block is dense. Only what
    transformers (and DeepSeek's own code for V3) runs is accepted: sigmoid scores, the
    `noaux_tc` choice, every block after the dense ones MoE."""
    first, n = hf.get("first_k_dense_replace", 3), hf["num_hidden_layers"]
    if first is None:
        _fail("DeepSeek-V3 first_k_dense_replace=null: give the number of leading dense blocks.")
    if first >= n:
        return {}
    only = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    for key, want in only.items():
        if hf.get(key, want) != want:
            _fail(
                f"DeepSeek-V3 with {key}={hf[key]!r} is not supported: transformers' DeepSeek-V3 "
                f"(and jaxllm's import) runs {key}={want!r} only."
            )
    experts, top_k = hf.get("n_routed_experts", 256), hf.get("num_experts_per_tok", 8)
    groups, keep = hf.get("n_group", 8), hf.get("topk_group", 4)
    if groups is None or keep is None:
        _fail("DeepSeek-V3 MoE blocks need n_group and topk_group (1 and 1: no groups).")
    shared = _shared_experts(hf, 1, "V3")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_mlp_dim": hf.get("moe_intermediate_size", 2048),
        "num_shared_experts": shared,
        "first_dense_layers": first,
        "moe_every": 1,
        "router_score": "sigmoid",
        "normalize_top_k": bool(hf.get("norm_topk_prob", True)),
        "route_scale": float(hf.get("routed_scaling_factor", 2.5)),
        "num_groups": groups,
        "groups_per_token": keep,
        "router_bias": True,
        # training choices: the imported bias stays frozen, and DeepSeek-V3 balances by that
        # bias rather than by jaxllm's batch-level aux loss or a z-loss
        "bias_update_rate": 0.0,
        "aux_loss_weight": 0.0,
        "router_z_loss_weight": 0.0,
    }


def _deepseek_v2_model(hf: dict) -> dict:
    """DeepSeek-V2 / V2-Lite (arXiv:2405.04434) as transformers' `DeepseekV2ForCausalLM` runs
    it: DeepSeek-V3's MLA blocks (always RoPE on interleaved channel pairs, as complex
    numbers; no rope_interleave key), the first `first_k_dense_replace` blocks dense and the
    rest MoE with softmax router scores, plain top-k (`greedy`) or top-k within the best
    topk_group of n_group groups ranked by their highest score (`group_limited_greedy`), the
    chosen scores times routed_scaling_factor without renormalising, and shared experts."""
    if hf.get("mlp_bias"):
        _fail(
            "DeepSeek-V2 with mlp_bias=true is not supported: jaxllm's SwiGLU MLPs and "
            "experts have no biases."
        )
    out = _deepseek_mla_model(hf, "DeepSeek-V2")
    out["rope"]["interleave"] = True
    return {**out, "moe": _deepseek_v2_moe(hf)}


def _deepseek_v2_moe(hf: dict) -> dict:
    """model.moe of a DeepSeek-V2 config.json; {} (dense) when every block is dense. Refused:
    what transformers' DeepSeek-V2 ignores where DeepSeek's own code would act on it
    (moe_layer_freq != 1, norm_topk_prob=true), so the two runs would disagree."""
    first, n = hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"]
    if first is None or first >= n:
        return {}
    for key, want in {"scoring_func": "softmax", "moe_layer_freq": 1}.items():
        if hf.get(key, want) != want:
            _fail(
                f"DeepSeek-V2 with {key}={hf[key]!r} is not supported: transformers' "
                f"DeepSeek-V2 (and jaxllm's import) runs {key}={want!r} only."
            )
    if hf.get("norm_topk_prob"):
        _fail(
            "DeepSeek-V2 with norm_topk_prob=true is not supported: transformers' DeepSeek-V2 "
            "never renormalises the top-k weights while DeepSeek's own code does."
        )
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        _fail(
            f"DeepSeek-V2 with topk_method={method!r} is not supported (greedy and "
            "group_limited_greedy are)."
        )
    groups = {"num_groups": 1, "groups_per_token": 1}
    if method == "group_limited_greedy":
        if hf.get("n_group") is None or hf.get("topk_group") is None:
            _fail("DeepSeek-V2 topk_method='group_limited_greedy' needs n_group and topk_group.")
        groups = {
            "num_groups": hf["n_group"],
            "groups_per_token": hf["topk_group"],
            "group_score": "max",
        }
    if hf.get("num_experts_per_tok") is None:
        _fail("DeepSeek-V2 MoE blocks need num_experts_per_tok (the top-k).")
    shared = _shared_experts(hf, 2, "V2")
    return {
        "num_experts": hf.get("n_routed_experts", 64),
        "experts_per_token": hf["num_experts_per_tok"],
        "expert_mlp_dim": hf.get("moe_intermediate_size", 1407),
        "num_shared_experts": shared,
        "first_dense_layers": first,
        "moe_every": 1,
        "router_score": "softmax",
        "normalize_top_k": False,
        "route_scale": float(hf.get("routed_scaling_factor", 1.0)),
        **groups,
    }


def _deepseek_v2_hf(cfg: ModelConfig) -> dict:
    """config.json of a DeepSeek-V2: `greedy` routing without groups, else
    `group_limited_greedy` (exact also when topk_group = n_group, which limits nothing)."""
    out = _deepseek_mla_hf(cfg, "deepseek_v2")
    moe = cfg.moe
    if moe.enabled:
        limited = moe.num_groups > 1
        out.update(
            {
                **_deepseek_moe_hf(cfg),
                "scoring_func": "softmax",
                "topk_method": "group_limited_greedy" if limited else "greedy",
                "n_group": moe.num_groups if limited else None,
                "topk_group": moe.groups_per_token if limited else None,
            }
        )
    return out


def _deepseek_v3_hf(cfg: ModelConfig) -> dict:
    """config.json of a DeepSeek-V3. No multi-token-prediction module is written
    (num_nextn_predict_layers=0): jaxllm models have none."""
    out = {
        **_deepseek_mla_hf(cfg, "deepseek_v3"),
        "rope_interleave": cfg.rope.interleave,
        "num_nextn_predict_layers": 0,
    }
    moe = cfg.moe
    if moe.enabled:
        out.update(
            {
                **_deepseek_moe_hf(cfg),
                "n_group": moe.num_groups,
                "topk_group": moe.groups_per_token,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
            }
        )
    return out


def _deepseek_mla_hf(cfg: ModelConfig, family: str) -> dict:
    """The config.json keys DeepSeek-V2 and V3 share (the inverse of `_deepseek_mla_model`);
    every block dense (first_k_dense_replace = layers) until `_deepseek_moe_hf` says else."""
    if not cfg.mla.enabled:
        _fail(
            f"a model without MLA (model.mla.kv_lora_rank=0) has no {family} checkpoint; "
            "export it as another family."
        )
    a, h = cfg.mla, cfg.num_heads
    out = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": h,
        "num_key_value_heads": h,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": _dtype_name(cfg),
        "kv_lora_rank": a.kv_lora_rank,
        "q_lora_rank": a.q_lora_rank or None,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "first_k_dense_replace": cfg.num_layers,
        **_rope_to_hf(cfg),
    }
    all_dim = _mscale_all_dim(cfg)
    if all_dim is not None:
        for key in ("rope_parameters", "rope_scaling"):
            out[key] = {**out[key], "mscale_all_dim": all_dim}
    return out


def _deepseek_moe_hf(cfg: ModelConfig) -> dict:
    """The MoE keys DeepSeek-V2 and V3 share: sizes, dense blocks, the weights' scaling."""
    moe = cfg.moe
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": cfg.resolved_expert_mlp_dim,
        "n_shared_experts": moe.num_shared_experts,
        "first_k_dense_replace": moe.first_dense_layers,
        "moe_layer_freq": 1,
        "routed_scaling_factor": moe.route_scale,
        "norm_topk_prob": moe.normalize_top_k,
    }


def _mscale_all_dim(cfg: ModelConfig) -> float | None:
    """The `mscale_all_dim` that makes transformers' softmax scale model.attn_scale (the
    inverse of `_deepseek_scale`); None for the default scale, or when no YaRN factor can
    carry it (the read-back check then names model.attn_scale)."""
    default = cfg.mla.qk_head_dim**-0.5
    if cfg.attn_scale is None or math.isclose(cfg.attn_scale, default):
        return None
    if cfg.rope.scaling != "yarn" or cfg.rope.factor <= 1:
        return None
    m = math.sqrt(cfg.attn_scale / default)
    return float(f"{(m - 1) / (0.1 * math.log(cfg.rope.factor)):.12g}")


def _deepseek_links(cfg: ModelConfig, fused: bool = False) -> list[Link]:
    """DeepSeek-V2 and V3 checkpoints (the same names; V2 has no routing bias): blocks numbered 0..N-1 across our two stacks (`layers` for the
    first_k_dense_replace dense blocks, `moe_layers/moe` for the rest). `fused`: transformers
    5's in-memory experts (`save_pretrained(save_original_format=False)`), else one tensor per
    expert as released checkpoints and the default `save_pretrained` hold them."""
    first = cfg.moe.first_dense_layers if cfg.moe.enabled else cfg.num_layers
    links = [
        Link("model.embed_tokens.weight", ("embed/embedding",)),
        Link("model.norm.weight", ("final_norm/scale",)),
    ]
    if not cfg.tie_embeddings:
        links.append(Link("lm_head.weight", ("lm_head",), "linear"))
    if first:
        links += _deepseek_block_links(cfg, "layers/", 0)
    if cfg.moe.enabled:
        links += _deepseek_block_links(cfg, "moe_layers/moe/", first, moe=True, fused=fused)
    return links


def _deepseek_block_links(
    cfg: ModelConfig, block: str, offset: int, moe: bool = False, fused: bool = False
) -> list[Link]:
    """One stack of DeepSeek-V2/V3 blocks (HF layers offset, offset + 1, ...): MLA, norms, and
    the dense MLP or the MoE layer."""
    attn, mlp = block + "attn/", block + "mlp/"

    def link(hf: str, ours: str | tuple[str, ...], kind: str = "same", **kw) -> Link:
        ours = (ours,) if isinstance(ours, str) else ours
        return Link("model.layers.{i}." + hf, ours, kind, offset=offset, **kw)

    links = [
        link("input_layernorm.weight", block + "attn_norm/scale"),
        link("post_attention_layernorm.weight", block + "mlp_norm/scale"),
        link("self_attn.kv_a_proj_with_mqa.weight", attn + "kv_a_proj", "linear"),
        link("self_attn.kv_a_layernorm.weight", attn + "kv_a_norm/scale"),
        link("self_attn.kv_b_proj.weight", attn + "kv_b_proj", "linear"),
        link("self_attn.o_proj.weight", attn + "o_proj", "linear", n_in=2),
    ]
    if cfg.mla.q_lora_rank:
        links += [
            link("self_attn.q_a_proj.weight", attn + "q_a_proj", "linear"),
            link("self_attn.q_a_layernorm.weight", attn + "q_a_norm/scale"),
            link("self_attn.q_b_proj.weight", attn + "q_b_proj", "linear"),
        ]
    else:
        links.append(link("self_attn.q_proj.weight", attn + "q_proj", "linear"))
    projections = ("gate", "up", "down")
    if not moe:
        return links + [
            link(f"mlp.{x}_proj.weight", f"{mlp}{x}_proj", "linear") for x in projections
        ]
    links.append(link("mlp.gate.weight", mlp + "router", "linear"))
    if cfg.moe.has_router_bias:
        links.append(link("mlp.gate.e_score_correction_bias", mlp + "router_bias"))
    if cfg.moe.num_shared_experts:
        links += [
            link(f"mlp.shared_experts.{x}_proj.weight", f"{mlp}shared/{x}_proj", "linear")
            for x in projections
        ]
    if fused:
        return links + [
            link(
                "mlp.experts.gate_up_proj",
                (mlp + "gate_proj", mlp + "up_proj"),
                "linear",
                axis=-2,
                n_lead=1,
            ),
            link("mlp.experts.down_proj", mlp + "down_proj", "linear", n_lead=1),
        ]
    return links + [
        link(f"mlp.experts.{{j}}.{x}_proj.weight", f"{mlp}{x}_proj", "linear") for x in projections
    ]


def _beyond_last_layer(cfg: ModelConfig, name: str) -> bool:
    """Tensors of blocks past num_hidden_layers: DeepSeek-V3's multi-token-prediction module
    (`model.layers.61.*` in the released checkpoint), which transformers does not load
    either."""
    parts = name.split(".")
    layer = parts[2] if name.startswith("model.layers.") else ""
    return layer.isdigit() and int(layer) >= cfg.num_layers


DEEPSEEK_V3 = Family(
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    _deepseek_v3_model,
    _deepseek_v3_hf,
    _deepseek_links,
    other_links=(lambda c: _deepseek_links(c, fused=True),),
    skip=_beyond_last_layer,
)
DEEPSEEK_V2 = Family(
    "deepseek_v2",
    "DeepseekV2ForCausalLM",
    _deepseek_v2_model,
    _deepseek_v2_hf,
    _deepseek_links,
    other_links=(lambda c: _deepseek_links(c, fused=True),),
)
