"""Qwen3-VL (Hugging Face `Qwen3VLForConditionalGeneration`, `model_type` qwen3_vl) and
Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, qwen3_vl_moe): a Qwen3 decoder (QK-norm,
dense or every block a top-k mixture of SwiGLU experts with a softmax router renormalised over
the chosen k) with interleaved multimodal RoPE, and Qwen3-VL's vision tower (`model.vision`
with window_size=0, norm=layer, mlp_activation=gelu_tanh, patch_bias, position_embeddings and
DeepStack mergers), as `jaxllm.model.vlm.VisionLanguageModel`. Tensors: the decoder under
`model.language_model.`, the tower under `model.visual.`, the head `lm_head.weight`. MoE
experts are written as transformers 5 keeps them (per layer `gate_up_proj` [E, 2F, D],
`down_proj` [E, D, F]); import also reads the released files' [E, D, 2F] and [E, F, D].
"""

from __future__ import annotations

import dataclasses

from jaxllm.config import ModelConfig
from jaxllm.config.vision import VisionConfig
from jaxllm.convert.config_map import _fail
from jaxllm.convert.links import Family, Link
from jaxllm.convert.llama import _qwen_hf, _qwen_model, llama_like_links
from jaxllm.convert.qwen2_5_vl import PatchLink

MOE = "moe_layers/moe/mlp/"


def _vision_model(v: dict) -> dict:
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        _fail(f"Qwen3-VL vision hidden_act={act!r}: the tower's MLP is tanh GELU.")
    sizes = {
        k: v.get(k, 16 if k == "patch_size" else 2) for k in ("patch_size", "temporal_patch_size")
    }
    if any(not isinstance(s, int) for s in sizes.values()):
        _fail(f"Qwen3-VL vision patch sizes {sizes} must be integers (square patches).")
    return dict(
        **sizes,
        in_channels=int(v.get("in_channels", 3)),
        depth=int(v.get("depth", 27)),
        width=int(v.get("hidden_size", 1152)),
        heads=int(v.get("num_heads", 16)),
        mlp_dim=int(v.get("intermediate_size", 4304)),
        spatial_merge=int(v.get("spatial_merge_size", 2)),
        out_dim=int(v.get("out_hidden_size", 3584)),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        window_size=0,
        fullatt_block_indexes=(),
        norm="layer",
        mlp_activation="gelu_tanh",
        patch_bias=True,
        position_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))),
    )


def _model(hf: dict, moe: bool) -> dict:
    text = hf["text_config"]
    fields = _qwen_model(text, True)
    p = text.get("rope_parameters") or {}
    if not p.get("mrope_section"):
        _fail("a Qwen3-VL config.json without rope_parameters.mrope_section is not supported.")
    section = tuple(int(s) for s in p["mrope_section"])
    fields["rope"] = {**fields["rope"], "mrope_section": section, "mrope_interleaved": True}
    fields["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    if moe:
        fields["moe"] = _moe(text)
    fields["vision"] = {
        **_vision_model(hf["vision_config"]),
        "image_token_id": hf["image_token_id"],
        "vision_start_token_id": hf["vision_start_token_id"],
    }
    return fields


def _moe(text: dict) -> dict:
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
        _fail(
            "Qwen3-VL-MoE with dense blocks (mlp_only_layers, decoder_sparse_step != 1) is not "
            "supported: every block must be a mixture of experts."
        )
    experts = text.get("num_experts", text.get("num_local_experts", 60))
    top_k = text.get("num_experts_per_tok", 4)
    if not 1 <= top_k <= experts:
        _fail(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}.")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_mlp_dim": text["moe_intermediate_size"],
        "num_shared_experts": 0,
        "first_dense_layers": 0,
        "moe_every": 1,
        "router_score": "softmax",
        "normalize_top_k": True,
        "route_scale": 1.0,
        "bias_update_rate": 0.0,
        "aux_loss_weight": float(text.get("router_aux_loss_coef", 0.001)),
    }


def _hf(cfg: ModelConfig, moe: bool) -> dict:
    v: VisionConfig = cfg.vision
    if v is None or cfg.rope.mrope_section is None or not cfg.rope.mrope_interleaved:
        _fail(
            "a Qwen3-VL checkpoint needs model.vision, model.rope.mrope_section and "
            "model.rope.mrope_interleaved=true."
        )
    kind = "qwen3_vl_moe" if moe else "qwen3_vl"
    text = {**_qwen_hf(cfg, True), "model_type": f"{kind}_text"}
    for key in ("sliding_window", "use_sliding_window", "layer_types", "max_window_layers"):
        text.pop(key)
    if cfg.sliding_window is not None:
        _fail("model.sliding_window has no place in a Qwen3-VL checkpoint.")
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": [*cfg.rope.mrope_section],
        "mrope_interleaved": True,
    }
    if moe:
        if not cfg.moe.enabled:
            _fail("a dense model (model.moe.num_experts=0) has no qwen3_vl_moe checkpoint.")
        text.update(
            num_experts=cfg.moe.num_experts,
            num_experts_per_tok=cfg.moe.experts_per_token,
            moe_intermediate_size=cfg.resolved_expert_mlp_dim,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=cfg.moe.aux_loss_weight,
        )
    vision = {
        "model_type": f"{kind}_vision",
        "depth": v.depth,
        "hidden_size": v.width,
        "num_heads": v.heads,
        "intermediate_size": v.mlp_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "in_channels": v.in_channels,
        "spatial_merge_size": v.spatial_merge,
        "out_hidden_size": v.out_dim,
        "num_position_embeddings": v.position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack_indexes),
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": v.image_token_id,
        "vision_start_token_id": v.vision_start_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _merger_links(hf: str, ours: str) -> list[Link]:
    return [
        Link(hf + "norm.weight", (ours + "norm/scale",)),
        Link(hf + "norm.bias", (ours + "norm/bias",)),
        Link(hf + "linear_fc1.weight", (ours + "fc1",), "linear"),
        Link(hf + "linear_fc1.bias", (ours + "fc1_bias",)),
        Link(hf + "linear_fc2.weight", (ours + "fc2",), "linear"),
        Link(hf + "linear_fc2.bias", (ours + "fc2_bias",)),
    ]


def vision_links(v: VisionConfig, prefix: str = "model.visual.") -> list[Link]:
    """Qwen3-VL's tower (`prefix`) and our parameters (`visual/`)."""
    conv = (v.width, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    links: list[Link] = [
        PatchLink(
            prefix + "patch_embed.proj.weight", ("visual/patch_embed",), "patch", conv_shape=conv
        ),
        Link(prefix + "patch_embed.proj.bias", ("visual/patch_bias",)),
        Link(prefix + "pos_embed.weight", ("visual/pos_embed",)),
        *_merger_links(prefix + "merger.", "visual/merger/"),
    ]
    for k in range(len(v.deepstack_indexes)):
        links += _merger_links(f"{prefix}deepstack_merger_list.{k}.", f"visual/deepstack/{k}/")
    for i in range(v.depth):
        hf, ours = f"{prefix}blocks.{i}.", f"visual/blocks/{i}/"
        a, m = ours + "attn/", ours + "mlp/"
        links += [
            *(Link(hf + f"{n}.weight", (ours + f"{n}/scale",)) for n in ("norm1", "norm2")),
            *(Link(hf + f"{n}.bias", (ours + f"{n}/bias",)) for n in ("norm1", "norm2")),
            Link(hf + "attn.qkv.weight", tuple(a + f"{x}_proj" for x in "qkv"), "linear", axis=0),
            Link(hf + "attn.qkv.bias", tuple(a + f"{x}_bias" for x in "qkv"), "flat", axis=0),
            Link(hf + "attn.proj.weight", (a + "o_proj",), "linear", n_in=2),
            Link(hf + "attn.proj.bias", (a + "o_bias",)),
            Link(hf + "mlp.linear_fc1.weight", (m + "up_proj",), "linear"),
            Link(hf + "mlp.linear_fc1.bias", (m + "up_bias",)),
            Link(hf + "mlp.linear_fc2.weight", (m + "down_proj",), "linear"),
            Link(hf + "mlp.linear_fc2.bias", (m + "down_bias",)),
        ]
    return links


def _language_model(links: list[Link]) -> list[Link]:
    """Llama-style names moved under `model.language_model.` (the head stays `lm_head`)."""
    return [
        dataclasses.replace(k, hf="model.language_model." + k.hf.removeprefix("model."))
        if k.hf.startswith("model.")
        else k
        for k in links
    ]


def _links(cfg: ModelConfig, released: bool = False) -> list[Link]:
    if not cfg.moe.enabled:
        return [*_language_model(llama_like_links(cfg)), *vision_links(cfg.vision)]
    p, gate_up = "model.layers.{i}.mlp.", (MOE + "gate_proj", MOE + "up_proj")
    experts = (
        [  # the released files: [E, D, 2F] and [E, F, D], as ours per expert
            Link(p + "experts.gate_up_proj", gate_up, axis=-1),
            Link(p + "experts.down_proj", (MOE + "down_proj",)),
        ]
        if released
        else [
            Link(p + "experts.gate_up_proj", gate_up, "linear", axis=-2, n_lead=1),
            Link(p + "experts.down_proj", (MOE + "down_proj",), "linear", n_lead=1),
        ]
    )
    lm = [
        *llama_like_links(cfg, block="moe_layers/moe/", dense_mlp=False),
        Link(p + "gate.weight", (MOE + "router",), "linear"),
        *experts,
    ]
    return [*_language_model(lm), *vision_links(cfg.vision)]


QWEN3_VL = Family(
    "qwen3_vl",
    "Qwen3VLForConditionalGeneration",
    lambda hf: _model(hf, False),
    lambda cfg: _hf(cfg, False),
    _links,
)
QWEN3_VL_MOE = Family(
    "qwen3_vl_moe",
    "Qwen3VLMoeForConditionalGeneration",
    lambda hf: _model(hf, True),
    lambda cfg: _hf(cfg, True),
    _links,
    other_links=(lambda cfg: _links(cfg, released=True),),
)
