"""Qwen2.5-VL (Hugging Face `Qwen2_5_VLForConditionalGeneration`, `model_type` qwen2_5_vl): a
Qwen2 decoder with multimodal RoPE (`text_config`, its `rope_parameters.mrope_section`) and the
vision tower of `qwen2_5_vl_vision.py` (`vision_config`, tensors under `visual.`), as
`jaxllm.model.vlm.VisionLanguageModel`. The decoder's tensors are named as Qwen2's
(`model.layers.{i}...`, `lm_head.weight`); the tower's blocks are one tensor each (not stacked),
the fused `qkv` split in q, k, v as Qwen2's separate projections are elsewhere.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.config.vision import VisionConfig
from jaxllm.convert.config_map import _fail
from jaxllm.convert.links import Family, Link
from jaxllm.convert.llama import _qwen_hf, _qwen_model, llama_like_links
from jaxllm.convert.qwen2_5_vl_vision import vision_config_from_hf


@dataclasses.dataclass(frozen=True)
class PatchLink(Link):
    """The Conv3d patch embedding [D, C, T, P, P] <-> ours [C T P P, D] (kind `patch`)."""

    conv_shape: tuple[int, ...] = ()

    def hf_shape(self, shapes):
        return self.conv_shape

    def to_ours(self, w, shapes):
        return [np.ascontiguousarray(w.reshape(w.shape[0], -1).T)]

    def to_hf(self, xs):
        return np.ascontiguousarray(xs[0].T.reshape(self.conv_shape))


def _model(hf: dict) -> dict:
    text = hf.get("text_config") or hf  # transformers < 5 kept the text keys at the top
    fields = _qwen_model(text, False)
    p = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    if not p.get("mrope_section"):
        _fail("a qwen2_5_vl config.json without rope_parameters.mrope_section is not supported.")
    fields["rope"] = {**fields["rope"], "mrope_section": tuple(int(s) for s in p["mrope_section"])}
    vision = hf["vision_config"]
    if vision.get("hidden_act", "silu") != "silu":
        _fail(f"Qwen2.5-VL vision hidden_act={vision['hidden_act']!r}: the tower's MLP is SwiGLU.")
    fields["vision"] = {
        **dataclasses.asdict(vision_config_from_hf(vision)),
        "image_token_id": hf["image_token_id"],
        "vision_start_token_id": hf["vision_start_token_id"],
    }
    return fields


def _hf(cfg: ModelConfig) -> dict:
    v: VisionConfig = cfg.vision
    text = {**_qwen_hf(cfg, False), "model_type": "qwen2_5_vl_text"}
    if v is None or cfg.rope.mrope_section is None:
        _fail("a qwen2_5_vl checkpoint needs model.vision and model.rope.mrope_section.")
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": [*cfg.rope.mrope_section],
    }
    return {
        "text_config": text,
        "vision_config": {
            "model_type": "qwen2_5_vl_vision",
            "depth": v.depth,
            "hidden_size": v.width,
            "num_heads": v.heads,
            "intermediate_size": v.mlp_dim,
            "hidden_act": "silu",
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "in_channels": v.in_channels,
            "spatial_merge_size": v.spatial_merge,
            "window_size": v.window_size,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "out_hidden_size": v.out_dim,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        },
        "image_token_id": v.image_token_id,
        "vision_start_token_id": v.vision_start_token_id,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def vision_links(v: VisionConfig) -> list[Link]:
    """The tower's tensors (`visual.`) and our parameters (`visual/`)."""
    conv = (v.width, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    m = "visual/merger/"
    links: list[Link] = [
        PatchLink(
            "visual.patch_embed.proj.weight", ("visual/patch_embed",), "patch", conv_shape=conv
        ),
        Link("visual.merger.ln_q.weight", (m + "norm/scale",)),
        Link("visual.merger.mlp.0.weight", (m + "fc1",), "linear"),
        Link("visual.merger.mlp.0.bias", (m + "fc1_bias",)),
        Link("visual.merger.mlp.2.weight", (m + "fc2",), "linear"),
        Link("visual.merger.mlp.2.bias", (m + "fc2_bias",)),
    ]
    for i in range(v.depth):
        hf, ours = f"visual.blocks.{i}.", f"visual/blocks/{i}/"
        a = ours + "attn/"
        links += [
            Link(hf + "norm1.weight", (ours + "norm1/scale",)),
            Link(hf + "norm2.weight", (ours + "norm2/scale",)),
            Link(hf + "attn.qkv.weight", tuple(a + f"{x}_proj" for x in "qkv"), "linear", axis=0),
            Link(hf + "attn.qkv.bias", tuple(a + f"{x}_bias" for x in "qkv"), "flat", axis=0),
            Link(hf + "attn.proj.weight", (a + "o_proj",), "linear", n_in=2),
            Link(hf + "attn.proj.bias", (a + "o_bias",)),
        ]
        for x in ("gate", "up", "down"):
            links += [
                Link(hf + f"mlp.{x}_proj.weight", (ours + f"mlp/{x}_proj",), "linear"),
                Link(hf + f"mlp.{x}_proj.bias", (ours + f"mlp/{x}_bias",)),
            ]
    return links


def _links(cfg: ModelConfig) -> list[Link]:
    return [*llama_like_links(cfg), *vision_links(cfg.vision)]


QWEN2_5_VL = Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _model, _hf, _links)
