"""DeepSeek-V2 in and out: layouts, the routing that matters, the Lite preset, refusals."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import (
    DEEPSEEK_V2_GROUPS,
    SMALL,
    hf_logits,
    hf_model,
    sample_tokens,
    save_hf,
)
from safetensors.numpy import load_file

import jaxllm
from jaxllm import config, sharding
from jaxllm.config import MeshConfig
from jaxllm.convert import families
from jaxllm.convert import hf as convert_hf


def test_deepseek_v2_layouts_and_the_routing_that_matters(tmp_path):
    """DeepSeek-V2's per-expert `save_pretrained` and its fused layout import to the same
    parameters. The group-limited parity model's logits depend on the group limit and on
    ranking groups by their highest score (DeepSeek-V3's top-2 sum picks other experts), so
    the parity test checks both."""
    model = hf_model("deepseek_v2-groups")
    per_expert = save_hf(model, tmp_path / "hf")
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in load_file(
        str(per_expert / "model.safetensors")
    )
    fused = tmp_path / "fused"
    model.save_pretrained(fused, save_original_format=False)
    cfg = convert_hf.model_config(per_expert, ["model.dtype=float32"])
    assert (cfg.model.moe.group_score, cfg.model.moe.has_router_bias) == ("max", False)
    mesh = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    params, state, _ = convert_hf.load_params(per_expert, cfg.model, mesh)
    fused_params, _, _ = convert_hf.load_params(fused, cfg.model, mesh)
    assert state == {}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fused_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    tokens = sample_tokens()
    want = hf_logits(model, tokens)
    top2_sum = jaxllm.load_model(
        per_expert, overrides=["model.dtype=float32", "model.moe.group_score=top2_sum"]
    )
    assert np.abs(np.asarray(top2_sum(tokens).logits) - want).max() > 1e-3
    for layer in model.model.layers[1:]:  # every group open: other experts win
        layer.mlp.gate.topk_group = layer.mlp.gate.num_group
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3


# The released DeepSeek-V2-Lite config.json (deepseek-ai/DeepSeek-V2-Lite) as remembered, less
# auto_map and the keys neither side reads.
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def test_deepseek_v2_lite_config_json_maps_to_the_preset():
    """The V2-Lite config maps to configs/models/deepseek_v2_lite.yaml (YaRN x40 with
    mscale = mscale_all_dim = 0.707: cos/sin unscaled, the softmax sharpened by
    (0.0707 ln 40 + 1)^2; 15.7B parameters as the paper counts them), and the preset writes it
    back."""
    from jaxllm.metrics import param_counts

    imported = config.from_dict({"model": families.model_fields(DEEPSEEK_V2_LITE_CONFIG)}).model
    imported.validate()
    preset = config.load(None, ["model=deepseek_v2_lite"]).model
    assert families._differences(preset, imported) == []
    assert imported.attn_scale == pytest.approx(192**-0.5 * (0.0707 * np.log(40) + 1) ** 2)
    assert imported.rope.attention_factor == 1.0 and imported.mla.q_lora_rank == 0
    assert param_counts(preset)["total"] == pytest.approx(15.7e9, rel=0.005)
    assert families.guess_family(preset).name == "deepseek_v2"

    out = families.hf_config(preset, families.FAMILIES["deepseek_v2"])
    keys = [
        "hidden_size",
        "num_hidden_layers",
        "q_lora_rank",
        "kv_lora_rank",
        "topk_method",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "scoring_func",
        "moe_intermediate_size",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
    ]
    assert {k: out[k] for k in keys} == {k: DEEPSEEK_V2_LITE_CONFIG[k] for k in keys}
    rope = out["rope_parameters"]
    assert (rope["factor"], rope["attention_factor"]) == (40, 1.0)
    assert rope["mscale_all_dim"] == pytest.approx(0.707)


def test_deepseek_v2_refuses_what_the_knobs_cannot_express():
    hf_cfg = json.loads(hf.DeepseekV2Config(**{**SMALL, **DEEPSEEK_V2_GROUPS}).to_json_string())
    for extra, message in [
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
        ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"norm_topk_prob": True}, "norm_topk_prob=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"n_group": None}, "needs n_group and topk_group"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ]:
        with pytest.raises(config.ConfigError, match=message):
            families.model_fields({**hf_cfg, **extra})
    greedy = families.model_fields({**hf_cfg, "topk_method": "greedy"})["moe"]
    assert (greedy["num_groups"], greedy["groups_per_token"]) == (1, 1)  # n_group ignored

    v2 = families.FAMILIES["deepseek_v2"]
    model = config.from_dict({"model": families.model_fields(hf_cfg)}).model
    out = families.hf_config(model, v2)
    assert (out["topk_method"], out["n_group"], out["topk_group"]) == ("group_limited_greedy", 2, 1)
    for changes, message in [
        (dict(group_score="top2_sum"), "model.moe.group_score='top2_sum'"),
        (dict(router_bias=True), "model.moe.router_bias=True"),
        (dict(router_score="sigmoid"), "model.moe.router_score='sigmoid'"),
        (dict(normalize_top_k=True), "norm_topk_prob=true"),
    ]:
        changed = dataclasses.replace(model, moe=dataclasses.replace(model.moe, **changes))
        with pytest.raises(config.ConfigError, match=message):
            families.hf_config(changed, v2)
    with pytest.raises(config.ConfigError, match="model.rope.interleave=False"):
        rotate_half = dataclasses.replace(model.rope, interleave=False)
        families.hf_config(dataclasses.replace(model, rope=rotate_half), v2)
    no_limit = dataclasses.replace(model.moe, groups_per_token=2, group_score="top2_sum")
    assert families.hf_config(dataclasses.replace(model, moe=no_limit), v2)["topk_group"] == 2


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
