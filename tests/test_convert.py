"""Hugging Face interop: for each family a tiny model built by `transformers` (CPU torch, no
download) is imported and gives the same logits; exported back it loads in `transformers` with
the same logits and the same tensors byte for byte. Also: refusals, sharded streaming, training
and generation from a converted checkpoint."""

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import cli, config, sharding
from jaxllm.config import GenerateConfig, MeshConfig, MLAConfig, MoEConfig
from jaxllm.convert import families
from jaxllm.convert import hf as convert_hf
from jaxllm.infer import generate

REPO = Path(__file__).resolve().parents[1]
VOCAB, LEN = 320, 20
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
# DeepSeek-V3 MLA in small: a kv latent of 16, a query latent of 24, heads of 16 + 8 RoPE
# query/key channels and 12 value channels; first_k_dense_replace = layers: every block dense.
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2)  # fmt: skip
# ... and its MoE blocks after one dense block: 8 experts in 2 groups, top-2 from the best group,
# a shared expert, and YaRN with DeepSeek's mscale / mscale_all_dim (unequal, so both the
# cos/sin factor and the softmax scale move).
DEEPSEEK_MOE = dict(MLA, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
                    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                    moe_intermediate_size=32, routed_scaling_factor=2.5, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 16, "mscale": 1.0,
                        "mscale_all_dim": 0.8})  # fmt: skip
# DeepSeek-V2-Lite in small: no query latent, plain top-2 of 8 softmax-scored experts (weights
# not renormalised), two shared experts, YaRN with the released mscale = mscale_all_dim; and a
# DeepSeek-V2 with a query latent and group_limited_greedy (top-2 within the best of 2 groups,
# groups ranked by their highest score), unequal mscales and routed_scaling_factor 2.
DEEPSEEK_V2_LITE = dict(MLA, q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                        moe_intermediate_size=32, topk_method="greedy", norm_topk_prob=False,
                        routed_scaling_factor=1.0, rope_parameters={
                            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "mscale": 0.707,
                            "mscale_all_dim": 0.707})  # fmt: skip
DEEPSEEK_V2_GROUPS = dict(DEEPSEEK_MOE, topk_method="group_limited_greedy", norm_topk_prob=False,
                          routed_scaling_factor=2.0)  # fmt: skip

FAMILIES = {
    "llama2": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama3.1": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-yarn": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral": (hf.MistralConfig, hf.MistralForCausalLM, dict(sliding_window=6)),
    "mixtral": (hf.MixtralConfig, hf.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM, dict(head_dim=32)),
    "gemma2": (hf.Gemma2Config, hf.Gemma2ForCausalLM, dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0)),
    # Gemma 3: a sliding then a global layer, each with its own RoPE (linear scaling global only)
    "gemma3_text": (hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})),
    "deepseek_v3-dense": (hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, MLA),
    "deepseek_v3-dense-q_lora_none-rotate_half": (
        hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM,
        dict(MLA, q_lora_rank=None, rope_interleave=False)),
    "deepseek_v3": (hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, DEEPSEEK_MOE),
    "deepseek_v2-lite": (hf.DeepseekV2Config, hf.DeepseekV2ForCausalLM, DEEPSEEK_V2_LITE),
    "deepseek_v2-groups": (hf.DeepseekV2Config, hf.DeepseekV2ForCausalLM, DEEPSEEK_V2_GROUPS),
    "gpt2": (hf.GPT2Config, hf.GPT2LMHeadModel, dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB)),
}  # fmt: skip


def _hf_model(family: str, seed: int = 0):
    cls_cfg, cls_model, extra = FAMILIES[family]
    kwargs = extra if family == "gpt2" else {**SMALL, **extra}
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():  # perturb everything: zero biases / unit norms would hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias is a saved buffer
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn_like(b))
    return model


def _save(model, path):
    model.save_pretrained(path)
    return path


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, LEN))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _run(*argv):
    return cli.main([str(a) for a in argv])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_export_parity(family, tmp_path, capsys):
    model = _hf_model(family)
    src = _save(model, tmp_path / "hf")
    tokens = _tokens()
    want = _hf_logits(model, tokens)

    assert _run("convert", "import", src, tmp_path / "run", "model.dtype=float32") == 0
    report = capsys.readouterr().out
    assert "embed/embedding" in report and "x2 layers" in report
    got = np.asarray(jaxllm.load_model(tmp_path / "run")(tokens))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    assert _run("convert", "export", tmp_path / "run", tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():  # same bytes: same dtype, shape and values
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name

    back = type(model).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(back, tokens), want, atol=1e-4, rtol=1e-4)


def test_load_model_reads_a_hugging_face_directory(tmp_path):
    model = _hf_model("qwen3")
    src = _save(model, tmp_path / "hf")
    got = jaxllm.load_model(src, overrides=["model.dtype=float32"])(_tokens(1))
    np.testing.assert_allclose(got, _hf_logits(model, _tokens(1)), atol=1e-4, rtol=1e-4)


def _stderr_of_failure(capsys, *argv) -> str:
    assert _run(*argv) == cli.EXIT_USER_ERROR
    return capsys.readouterr().err


def test_refuses_unmapped_tensors_shape_mismatches_and_unknown_families(tmp_path, capsys):
    src = _save(_hf_model("llama2"), tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_scale"] = np.ones(4, np.float32)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = _stderr_of_failure(capsys, "convert", "import", src, tmp_path / "a")
    assert "model.layers.0.self_attn.rotary_scale" in err and "maps to no parameter" in err
    assert not (tmp_path / "a" / "checkpoints").exists()

    del tensors["model.layers.0.self_attn.rotary_scale"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = _stderr_of_failure(capsys, "convert", "import", src, tmp_path / "b", "model.mlp_dim=96")
    assert "mlp.gate_proj.weight has shape [128, 64]" in err

    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    err = _stderr_of_failure(capsys, "convert", "import", src, tmp_path / "c")
    assert "model_type 'falcon' is not supported" in err


def test_export_refuses_knobs_the_family_cannot_hold(tmp_path, capsys):
    src = _save(_hf_model("llama2"), tmp_path / "hf")
    assert _run("convert", "import", src, tmp_path / "run") == 0
    err = _stderr_of_failure(capsys, "convert", "import", src, tmp_path / "run")
    assert "already holds checkpoints" in err
    err = _stderr_of_failure(capsys, "convert", "export", tmp_path / "run", tmp_path / "o",
                             "--family", "gpt2")  # fmt: skip
    assert "cannot be expressed in a gpt2 checkpoint" in err and "model.position='rope'" in err


@pytest.fixture
def reads(monkeypatch):
    """(name, shape) of every tensor slice the importer reads, in order."""
    log = []
    real_read = convert_hf.Reader.read

    def spy(self, name, index=None):
        out = real_read(self, name, index)
        log.append((name, out.shape))
        return out

    monkeypatch.setattr(convert_hf.Reader, "read", spy)
    return log


def test_streams_each_shard_onto_the_mesh(tmp_path, reads):
    """On a data x fsdp x tensor mesh every parameter arrives in its shards, equal to the
    single-device import; the embedding (same layout) is read one shard-sized slice at a time."""
    src = _save(_hf_model("llama2"), tmp_path / "hf")
    cfg = convert_hf.model_config(src, ["model.dtype=float32"])
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    params, _, _ = convert_hf.load_params(src, cfg.model, mesh)
    embed_reads = {shape for name, shape in reads if name == "model.embed_tokens.weight"}
    ref, _, _ = convert_hf.load_params(src, cfg.model, sharding.make_mesh(MeshConfig(),
                                                                       jax.devices()[:1]))  # fmt: skip
    q = params["layers"]["attn"]["q_proj"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 32, 2, 16)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert embed_reads == {(VOCAB // 2, 32)}


def _legacy_mixtral(model, fused_dir, path):
    """A released-Mixtral-style directory written by hand from transformers 5's fused
    in-memory experts: block_sparse_moe.gate and experts.{j}.w1 / w3 (gate_up_proj's halves),
    w2 (down_proj)."""
    f = model.config.intermediate_size
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.numpy()
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            for j, w in enumerate(t):
                tensors[name.replace("gate_up_proj", f"{j}.w1.weight")] = w[:f]
                tensors[name.replace("gate_up_proj", f"{j}.w3.weight")] = w[f:]
        elif name.endswith("experts.down_proj"):
            tensors.update(
                {name.replace("down_proj", f"{j}.w2.weight"): w for j, w in enumerate(t)}
            )
        else:
            tensors[name] = t
    path.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (path / "config.json").write_text((fused_dir / "config.json").read_text())
    return path


def test_mixtral_imports_per_expert_and_fused_layouts_reading_only_its_experts(tmp_path, reads):
    """Released Mixtral checkpoints hold one tensor per expert, transformers 5 keeps (and can
    save) the experts fused per layer; both import to the same parameters, and on a mesh with
    experts split in two each shard reads only its experts' tensors (or slice)."""
    model = _hf_model("mixtral")
    fused = tmp_path / "fused"
    model.save_pretrained(fused, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(str(fused / "model.safetensors"))
    legacy = _legacy_mixtral(model, fused, tmp_path / "legacy")
    cfg = convert_hf.model_config(legacy, ["model.dtype=float32"])
    assert cfg.model.moe.dispatch == "dropless"  # exact: no assignment dropped
    mesh = sharding.make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    from_legacy, _, report = convert_hf.load_params(legacy, cfg.model, mesh)
    assert any("experts.{j}.w1.weight x2 layers x4 experts" in str(m) for m in report)
    gate = from_legacy["moe_layers"]["moe"]["mlp"]["gate_proj"]
    assert gate.sharding.spec[1] == "expert"
    shards = {tuple((s.start, s.stop) for s in index)
              for index in gate.sharding.devices_indices_map(gate.shape).values()}  # fmt: skip
    want = sum(len(range(2)[slice(*s[0])]) * len(range(4)[slice(*s[1])]) for s in shards)
    assert sum(".w1." in name for name, _ in reads) == want == 8 * 2 * 2  # 2 of 4 experts each

    reads.clear()
    from_fused, _, _ = convert_hf.load_params(fused, cfg.model, mesh)
    fused_reads = {shape for name, shape in reads if name.endswith("gate_up_proj")}
    assert fused_reads == {(2, 256, 64)}
    for a, b in zip(jax.tree.leaves(from_legacy), jax.tree.leaves(from_fused)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    got = jaxllm.load_model(legacy, overrides=["model.dtype=float32"])(_tokens(1))
    np.testing.assert_allclose(got, _hf_logits(model, _tokens(1)), atol=1e-4, rtol=1e-4)

    # a fine-tune with bias balancing: the bias Mixtral does not have starts at zero
    moe = dataclasses.replace(cfg.model.moe, bias_update_rate=1e-3)
    _, state, _ = convert_hf.load_params(legacy, dataclasses.replace(cfg.model, moe=moe), mesh)
    bias = state["moe_layers"]["moe"]["mlp"]["router_bias"]
    assert bias.shape == (2, 4) and not np.asarray(bias).any()


def test_mixtral_refuses_what_the_knobs_cannot_express():
    hf_cfg = json.loads(hf.MixtralConfig(**SMALL, num_local_experts=4).to_json_string())
    for extra, message in [({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
                           ({"hidden_act": "gelu"}, "SwiGLU"),
                           ({"num_experts_per_tok": 5}, "between 1 and num_local_experts=4")]:  # fmt: skip
        with pytest.raises(config.ConfigError, match=message):
            families.model_fields({**hf_cfg, **extra})

    tiny = config.load(REPO / "configs/models/tiny_mixtral.yaml").model  # mlp_dim != experts'
    assert families.guess_family(tiny).name == "mixtral"
    out = families.hf_config(tiny, families.FAMILIES["mixtral"])
    assert (out["intermediate_size"], out["num_local_experts"], out["router_aux_loss_coef"]) == (
        320, 8, 0.02)  # fmt: skip
    for moe, message in [
        (dict(bias_update_rate=1e-3), "model.moe.bias_update_rate=0.001"),  # a bias it can't hold
        (dict(first_dense_layers=2), "model.moe.first_dense_layers=2"),
        (dict(num_shared_experts=1), "model.moe.num_shared_experts=1"),
        (dict(router_score="sigmoid"), "model.moe.router_score='sigmoid'"),
    ]:
        changed = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, **moe))
        with pytest.raises(config.ConfigError, match=message):
            families.hf_config(changed, families.FAMILIES["mixtral"])
    with pytest.raises(config.ConfigError, match="model.global_every=2"):
        families.hf_config(dataclasses.replace(tiny, sliding_window=8, global_every=2),
                           families.FAMILIES["mixtral"])  # fmt: skip
    with pytest.raises(
        config.ConfigError, match="model.moe.num_experts=8 cannot be expressed in a llama"
    ):
        families.hf_config(tiny, families.FAMILIES["llama"])
    dense = dataclasses.replace(tiny, moe=MoEConfig())
    with pytest.raises(config.ConfigError, match="has no Mixtral checkpoint"):
        families.hf_config(dense, families.FAMILIES["mixtral"])


def test_gemma3_text_rope_per_layer_type_and_refusals():
    hf_cfg = json.loads(hf.Gemma3TextConfig(**SMALL, **FAMILIES["gemma3_text"][2]).to_json_string())
    got = families.model_fields(hf_cfg)
    assert (got["rope_theta"], got["rope_scaling"], got["rope_factor"], got["rope_local_theta"],
            got["sliding_window"], got["global_every"], got["qk_norm"]) == (
        1000.0, "linear", 4.0, 10.0, 6, 2, True)  # fmt: skip
    legacy = {k: v for k, v in hf_cfg.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(num_hidden_layers=12, rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    old = families.model_fields(legacy)  # older config.json: pattern 6, flat RoPE keys
    assert (old["rope_theta"], old["rope_factor"], old["rope_local_theta"], old["global_every"]) == (
        1e6, 8.0, 1e4, 6)  # fmt: skip
    local_scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}
    for extra, message in [
        ({"layer_types": ["full_attention", "sliding_attention"]}, "not a periodic pattern"),
        (
            {"rope_parameters": {**hf_cfg["rope_parameters"], "sliding_attention": local_scaled}},
            "sliding-layer RoPE",
        ),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ]:
        with pytest.raises(config.ConfigError, match=message):
            families.model_fields({**hf_cfg, **extra})

    cfg = config.from_dict({"model": got}).model
    assert families.guess_family(cfg).name == "gemma3_text"
    all_global = dataclasses.replace(cfg, sliding_window=None, global_every=0,
                                     rope_local_theta=None)  # fmt: skip
    assert families.guess_family(all_global).name == "gemma3_text"  # by its QK-norm
    assert families.hf_config(all_global, families.FAMILIES["gemma3_text"])["layer_types"] == [
        "full_attention"] * 2  # fmt: skip
    gemma2 = dataclasses.replace(cfg, rope_local_theta=None, qk_norm=False)
    assert families.guess_family(gemma2).name == "gemma2"
    with pytest.raises(config.ConfigError, match="model.rope_local_theta=10.0"):
        families.hf_config(cfg, families.FAMILIES["gemma2"])
    # windowed layers with the global scaled RoPE: Gemma 3 never scales its sliding layers
    with pytest.raises(config.ConfigError, match="model.rope_local_theta=None"):
        families.hf_config(dataclasses.replace(cfg, rope_local_theta=None),
                           families.FAMILIES["gemma3_text"])  # fmt: skip


def test_deepseek_v3_layouts_mtp_layers_and_the_routing_that_matters(tmp_path):
    """transformers' default `save_pretrained` writes one tensor per expert (as the released
    DeepSeek-V3 does), `save_original_format=False` the fused experts: both import to the same
    parameters and routing bias, and blocks past num_hidden_layers (the released checkpoint's
    multi-token-prediction layer 61) are left unread. The parity model's logits depend on the
    group limit and on the bias, so the parity test checks both; the bias reaches the model
    state of a run directory and of a fine-tune's train state."""
    import optax

    from jaxllm.convert import load_params_from
    from jaxllm.train.state import init_state_from

    model = _hf_model("deepseek_v3")
    per_expert = _save(model, tmp_path / "hf")
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
    assert any("experts.{j}.gate_proj.weight x2 layers x8 experts (from layer 1)" in str(m)
               for m in report)  # fmt: skip
    fused_params, fused_state, _ = convert_hf.load_params(fused, cfg.model, mesh)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((fused_params, fused_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    bias = np.stack([g.e_score_correction_bias.detach().numpy() for g in gates])
    np.testing.assert_array_equal(state["moe_layers"]["moe"]["mlp"]["router_bias"], bias)

    tokens = _tokens()
    want = _hf_logits(model, tokens)
    for g in gates:  # every group open: other experts win
        g.topk_group = g.num_group
    assert np.abs(_hf_logits(model, tokens) - want).max() > 1e-3
    for g in gates:  # the group limit back, the bias zeroed: other experts win again
        g.topk_group = 1
        g.e_score_correction_bias.zero_()
    assert np.abs(_hf_logits(model, tokens) - want).max() > 1e-3

    assert _run("convert", "import", per_expert, tmp_path / "run") == 0
    for source in (per_expert, tmp_path / "run"):
        params, state = load_params_from(source, cfg.model, mesh)
        train = init_state_from(params, cfg.model, optax.sgd(0.1), mesh, 0, state)
        got = jax.device_get(train.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
        np.testing.assert_array_equal(got, bias)


# The released DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3), less auto_map.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


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
    assert (imported.rope_attention_factor, imported.moe.num_groups) == (1.0, 8)
    # 671B without the 58 x 256 routing biases (model state) and the MTP module
    assert param_counts(preset)["total"] == 671_026_404_352

    out = families.hf_config(preset, families.FAMILIES["deepseek_v3"])
    keys = ["hidden_size", "num_hidden_layers", "q_lora_rank", "kv_lora_rank", "n_group",
            "topk_group", "first_k_dense_replace", "routed_scaling_factor", "n_routed_experts",
            "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
            "vocab_size"]  # fmt: skip
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
    ]:  # fmt: skip
        with pytest.raises(config.ConfigError, match=message):
            families.model_fields({**hf_cfg, **extra})
    fields = families.model_fields({**hf_cfg, "n_group": 4, "topk_group": 1})  # 2 per group
    assert fields["moe"]["num_groups"] == 4
    with pytest.raises(config.ConfigError, match="raise groups_per_token"):
        config.from_dict({"model": {**fields, "moe": {**fields["moe"], "experts_per_token": 3}},
                          "data": {"seq_len": 16}}).validate()  # fmt: skip

    deepseek = families.FAMILIES["deepseek_v3"]
    tiny = config.load(REPO / "configs/models/tiny_deepseek.yaml").model  # GQA, not MLA
    with pytest.raises(config.ConfigError, match="has no deepseek_v3 checkpoint"):
        families.hf_config(tiny, deepseek)
    mla = dataclasses.replace(tiny, num_kv_heads=4, mla=MLAConfig(
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32))  # fmt: skip
    assert families.guess_family(mla).name == "deepseek_v3"
    out = families.hf_config(mla, deepseek)  # its trained bias is the correction bias
    assert (out["first_k_dense_replace"], out["q_lora_rank"], out["n_group"]) == (1, None, 1)
    for changes, message in [
        (dict(router_score="softmax"), "model.moe.router_score='softmax'"),
        (dict(moe_every=3), "model.moe.moe_every=3"),
        (dict(bias_update_rate=0.0), "model.moe.router_bias=False"),
        (dict(num_shared_experts=0), "n_shared_experts=0"),
    ]:  # fmt: skip
        changed = dataclasses.replace(mla, moe=dataclasses.replace(mla.moe, **changes))
        with pytest.raises(config.ConfigError, match=message):
            families.hf_config(changed, deepseek)
    with pytest.raises(config.ConfigError, match="model.attn_scale=0.1"):  # no YaRN to carry it
        families.hf_config(dataclasses.replace(mla, attn_scale=0.1), deepseek)


def test_deepseek_v2_layouts_and_the_routing_that_matters(tmp_path):
    """DeepSeek-V2's per-expert `save_pretrained` and its fused layout import to the same
    parameters. The group-limited parity model's logits depend on the group limit and on
    ranking groups by their highest score (DeepSeek-V3's top-2 sum picks other experts), so
    the parity test checks both."""
    model = _hf_model("deepseek_v2-groups")
    per_expert = _save(model, tmp_path / "hf")
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in load_file(
        str(per_expert / "model.safetensors"))  # fmt: skip
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

    tokens = _tokens()
    want = _hf_logits(model, tokens)
    top2_sum = jaxllm.load_model(per_expert, overrides=["model.dtype=float32",
                                                        "model.moe.group_score=top2_sum"])  # fmt: skip
    assert np.abs(np.asarray(top2_sum(tokens)) - want).max() > 1e-3
    for layer in model.model.layers[1:]:  # every group open: other experts win
        layer.mlp.gate.topk_group = layer.mlp.gate.num_group
    assert np.abs(_hf_logits(model, tokens) - want).max() > 1e-3


# The released DeepSeek-V2-Lite config.json (deepseek-ai/DeepSeek-V2-Lite) as remembered, less
# auto_map and the keys neither side reads.
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 100000,
    "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip


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
    assert imported.rope_attention_factor == 1.0 and imported.mla.q_lora_rank == 0
    assert param_counts(preset)["total"] == pytest.approx(15.7e9, rel=0.005)
    assert families.guess_family(preset).name == "deepseek_v2"

    out = families.hf_config(preset, families.FAMILIES["deepseek_v2"])
    keys = ["hidden_size", "num_hidden_layers", "q_lora_rank", "kv_lora_rank", "topk_method",
            "first_k_dense_replace", "routed_scaling_factor", "n_routed_experts",
            "n_shared_experts", "num_experts_per_tok", "norm_topk_prob", "scoring_func",
            "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
            "vocab_size"]  # fmt: skip
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
    ]:  # fmt: skip
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
    ]:  # fmt: skip
        changed = dataclasses.replace(model, moe=dataclasses.replace(model.moe, **changes))
        with pytest.raises(config.ConfigError, match=message):
            families.hf_config(changed, v2)
    with pytest.raises(config.ConfigError, match="model.rope_interleave=False"):
        families.hf_config(dataclasses.replace(model, rope_interleave=False), v2)
    no_limit = dataclasses.replace(model.moe, groups_per_token=2, group_score="top2_sum")
    assert families.hf_config(dataclasses.replace(model, moe=no_limit), v2)["topk_group"] == 2


def test_converted_checkpoint_trains_and_generates(tmp_path, capsys):
    """`checkpoint.init_from` starts training from the imported weights (with lr 0 they come
    out unchanged); the imported run decodes the same greedy tokens as `transformers`."""
    model = _hf_model("llama2")
    src = _save(model, tmp_path / "hf")
    assert _run("convert", "import", src, tmp_path / "imported", "model.dtype=float32") == 0

    prompt = [5, 17, 99, 3]
    imported = jaxllm.load_model(tmp_path / "imported")
    ours = generate(imported, [prompt], GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32"))
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                min_new_tokens=6)  # fmt: skip
    assert ours.tokens[0] == theirs[0, len(prompt) :].tolist()
    # two prompts: no streaming (an ordered host callback, which needs a single device)
    assert _run("generate", tmp_path / "imported", "--prompt", "def", "--prompt", "x = ",
                "--max-new-tokens", "4") == 0  # fmt: skip

    run = tmp_path / "ft"
    overrides = [
        tmp_path / "imported" / "config.yaml", f"run.dir={run}", f"checkpoint.init_from={src}",
        "train.steps=2", "train.global_batch_size=8", "data.seq_len=32", "data.max_files=20",
        "train.eval_batches=1", "train.sample_tokens=0", "optim.lr=0.0", "optim.warmup_steps=0",
    ]  # fmt: skip
    capsys.readouterr()
    assert _run("train", *overrides) == 0
    assert "initialized parameters from" in capsys.readouterr().err
    trained = jaxllm.load_model(run)
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, _params(trained))),
                    jax.tree.leaves(jax.tree.map(np.asarray, _params(imported)))):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    # training straight in the imported directory starts from its weights-only checkpoint
    assert _run("train", tmp_path / "imported", "train.steps=1", "train.global_batch_size=8",
                "data.seq_len=32", "data.max_files=20", "train.eval_batches=1",
                "train.sample_tokens=0") == 0  # fmt: skip
    assert "initialized parameters from" in capsys.readouterr().err
    bad = config.load(tmp_path / "imported" / "config.yaml", ["model.num_layers=3"])
    from jaxllm.convert import load_params_from

    with pytest.raises(config.ConfigError, match="other parameters"):
        load_params_from(src, bad.model, sharding.make_mesh(MeshConfig()))


def test_imported_deepseek_v3_generates_like_transformers_through_the_latent_cache(tmp_path):
    """MLA decoding in latent space (absorbed), group-limited routing and the imported routing
    bias together: greedy tokens equal transformers' `generate`."""
    model = _hf_model("deepseek_v3")
    assert _run("convert", "import", _save(model, tmp_path / "hf"), tmp_path / "run",
                "model.dtype=float32") == 0  # fmt: skip
    prompts = [[5, 17, 99, 3], [7, 1, 250, 12, 8, 40, 2]]
    ours = generate(jaxllm.load_model(tmp_path / "run"), prompts,
                    GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32"))  # fmt: skip
    for prompt, got in zip(prompts, ours.tokens):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                    min_new_tokens=6)  # fmt: skip
        assert got == theirs[0, len(prompt) :].tolist()


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
