"""Hugging Face conversion of DeepSeek-V2 / V2-Lite and DeepSeek-V3: both expert layouts, the
routing that changes logits (group limits, the routing bias), the released config.json files
against the presets, refusals, and generation through the latent cache."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import (
    DEEPSEEK_MOE,
    REPO,
    SMALL,
    hf_logits,
    hf_model,
    run_cli,
    sample_tokens,
    save_hf,
)
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import config, sharding
from jaxllm.config import GenerateConfig, MeshConfig, MLAConfig
from jaxllm.convert import families
from jaxllm.convert import hf as convert_hf
from jaxllm.infer import generate


def test_deepseek_v3_layouts_mtp_layers_and_the_routing_that_matters(tmp_path):
    """transformers' default `save_pretrained` writes one tensor per expert (as the released
    DeepSeek-V3 does), `save_original_format=False` the fused experts: both import to the same
    parameters and routing bias, and blocks past num_hidden_layers (the released checkpoint's
    multi-token-prediction layer 61) are left unread. The parity model's logits depend on the
    group limit and on the bias, so the parity test checks both; the bias reaches the model
    state of a run directory and of a fine-tune's train state."""
    import optax

    from jaxllm.load import load_weights
    from jaxllm.train.state import init_state_from

    model = hf_model("deepseek_v3")
    per_expert = save_hf(model, tmp_path / "hf")
    tensors = load_file(str(per_expert / "model.safetensors"))
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in tensors
    tensors["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)  # an MTP layer
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((32, 64), np.float32)
    save_file(tensors, str(per_expert / "model.safetensors"), metadata={"format": "pt"})
    fused = tmp_path / "fused"
    model.save_pretrained(fused, save_original_format=False)
    assert "model.layers.2.mlp.experts.gate_up_proj" in load_file(str(fused / "model.safetensors"))

    cfg = convert_hf.model_config(per_expert, ["model.dtype=float32"])
    mesh = sharding.make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    params, state, report = convert_hf.load_params(per_expert, cfg.model, mesh)
    assert any(
        "experts.{j}.gate_proj.weight x2 layers x8 experts (from layer 1)" in str(m) for m in report
    )
    fused_params, fused_state, _ = convert_hf.load_params(fused, cfg.model, mesh)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((fused_params, fused_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    bias = np.stack([g.e_score_correction_bias.detach().numpy() for g in gates])
    np.testing.assert_array_equal(state["moe_layers"]["moe"]["mlp"]["router_bias"], bias)

    tokens = sample_tokens()
    want = hf_logits(model, tokens)
    for g in gates:  # every group open: other experts win
        g.topk_group = g.num_group
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3
    for g in gates:  # the group limit back, the bias zeroed: other experts win again
        g.topk_group = 1
        g.e_score_correction_bias.zero_()
    assert np.abs(hf_logits(model, tokens) - want).max() > 1e-3

    assert run_cli("convert", "import", per_expert, tmp_path / "run") == 0
    for source in (per_expert, tmp_path / "run"):
        params, state = load_weights(source, cfg.model, mesh)
        train = init_state_from(params, cfg.model, optax.sgd(0.1), mesh, 0, state)
        got = jax.device_get(train.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
        np.testing.assert_array_equal(got, bias)


# The released DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), less auto_map.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_deepseek_v3_config_json_maps_to_the_preset(tmp_path):
    """The released config maps to configs/models/deepseek_v3.yaml (YaRN x40 with
    mscale = mscale_all_dim = 1: cos/sin unscaled, the softmax sharpened by
    (0.1 ln 40 + 1)^2), and the preset writes it back; its FP8 weights are refused."""
    from jaxllm.metrics import param_counts

    imported = config.from_dict({"model": families.model_fields(DEEPSEEK_V3_CONFIG)}).model
    imported.validate()
    preset = config.load(None, ["model=deepseek_v3"]).model
    assert families._differences(preset, imported) == []
    assert imported.attn_scale == pytest.approx(192**-0.5 * (0.1 * np.log(40) + 1) ** 2)
    assert (imported.rope.attention_factor, imported.moe.num_groups) == (1.0, 8)
    # 671B without the 58 x 256 routing biases (model state) and the MTP module
    assert param_counts(preset)["total"] == 671_026_404_352

    out = families.hf_config(preset, families.FAMILIES["deepseek_v3"])
    keys = [
        "hidden_size",
        "num_hidden_layers",
        "q_lora_rank",
        "kv_lora_rank",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "n_routed_experts",
        "moe_intermediate_size",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
    ]
    assert {k: out[k] for k in keys} == {k: DEEPSEEK_V3_CONFIG[k] for k in keys}
    rope = out["rope_parameters"]
    assert (rope["factor"], rope["attention_factor"], rope["mscale_all_dim"]) == (40, 1.0, 1.0)
    assert out["num_nextn_predict_layers"] == 0  # no multi-token-prediction weights exported

    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    with pytest.raises(config.ConfigError, match="quantized checkpoint .*quant_method fp8"):
        convert_hf.model_config(tmp_path / "fp8")


def test_deepseek_v3_refuses_what_the_knobs_cannot_express():
    hf_cfg = json.loads(hf.DeepseekV3Config(**{**SMALL, **DEEPSEEK_MOE}).to_json_string())
    for extra, message in [
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
    ]:
        with pytest.raises(config.ConfigError, match=message):
            families.model_fields({**hf_cfg, **extra})
    fields = families.model_fields({**hf_cfg, "n_group": 4, "topk_group": 1})  # 2 per group
    assert fields["moe"]["num_groups"] == 4
    with pytest.raises(config.ConfigError, match="raise groups_per_token"):
        config.from_dict(
            {
                "model": {**fields, "moe": {**fields["moe"], "experts_per_token": 3}},
                "data": {"seq_len": 16},
            }
        ).validate()

    deepseek = families.FAMILIES["deepseek_v3"]
    tiny = config.load(REPO / "configs/models/tiny_deepseek.yaml").model  # GQA, not MLA
    with pytest.raises(config.ConfigError, match="has no deepseek_v3 checkpoint"):
        families.hf_config(tiny, deepseek)
    mla = dataclasses.replace(
        tiny,
        num_kv_heads=4,
        mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    )
    assert families.guess_family(mla).name == "deepseek_v3"
    out = families.hf_config(mla, deepseek)  # its trained bias is the correction bias
    assert (out["first_k_dense_replace"], out["q_lora_rank"], out["n_group"]) == (1, None, 1)
    for changes, message in [
        (dict(router_score="softmax"), "model.moe.router_score='softmax'"),
        (dict(moe_every=3), "model.moe.moe_every=3"),
        (dict(bias_update_rate=0.0), "model.moe.router_bias=False"),
        (dict(num_shared_experts=0), "n_shared_experts=0"),
    ]:
        changed = dataclasses.replace(mla, moe=dataclasses.replace(mla.moe, **changes))
        with pytest.raises(config.ConfigError, match=message):
            families.hf_config(changed, deepseek)
    with pytest.raises(config.ConfigError, match="model.attn_scale=0.1"):  # no YaRN to carry it
        families.hf_config(dataclasses.replace(mla, attn_scale=0.1), deepseek)


def test_imported_deepseek_v3_generates_like_transformers_through_the_latent_cache(tmp_path):
    """MLA decoding in latent space (absorbed), group-limited routing and the imported routing
    bias together: greedy tokens equal transformers' `generate`."""
    model = hf_model("deepseek_v3")
    assert (
        run_cli(
            "convert",
            "import",
            save_hf(model, tmp_path / "hf"),
            tmp_path / "run",
            "model.dtype=float32",
        )
        == 0
    )
    prompts = [[5, 17, 99, 3], [7, 1, 250, 12, 8, 40, 2]]
    ours = generate(
        jaxllm.load_model(tmp_path / "run"),
        prompts,
        GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32"),
    )
    for prompt, got in zip(prompts, ours.tokens):
        with torch.no_grad():
            theirs = model.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )
        assert got == theirs[0, len(prompt) :].tolist()


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
