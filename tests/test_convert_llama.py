"""Hugging Face conversion of the Llama-like and Gemma families: a directory loads directly,
every parameter streams onto a mesh in its shards (Mixtral: each shard reads only its experts,
from the per-expert or the fused layout), and what the knobs cannot express is refused (Mixtral,
Gemma 3's RoPE per layer type)."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import (
    FAMILIES,
    REPO,
    SMALL,
    VOCAB,
    hf_logits,
    hf_model,
    sample_tokens,
    save_hf,
)
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import config, sharding
from jaxllm.config import MeshConfig, MoEConfig
from jaxllm.convert import families
from jaxllm.convert import hf as convert_hf
from jaxllm.convert.reader import Reader


def test_load_model_reads_a_hugging_face_directory(tmp_path):
    model = hf_model("qwen3")
    src = save_hf(model, tmp_path / "hf")
    got = jaxllm.load_model(src, overrides=["model.dtype=float32"])(sample_tokens(1)).logits
    np.testing.assert_allclose(got, hf_logits(model, sample_tokens(1)), atol=1e-4, rtol=1e-4)


@pytest.fixture
def reads(monkeypatch):
    """(name, shape) of every tensor slice the importer reads, in order."""
    log = []
    real_read = Reader.read

    def spy(self, name, index=None):
        out = real_read(self, name, index)
        log.append((name, out.shape))
        return out

    monkeypatch.setattr(Reader, "read", spy)
    return log


def test_streams_each_shard_onto_the_mesh(tmp_path, reads):
    """On a data x fsdp x tensor mesh every parameter arrives in its shards, equal to the
    single-device import; the embedding (same layout) is read one shard-sized slice at a time."""
    src = save_hf(hf_model("llama2"), tmp_path / "hf")
    cfg = convert_hf.model_config(src, ["model.dtype=float32"])
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    params, _, _ = convert_hf.load_params(src, cfg.model, mesh)
    embed_reads = {shape for name, shape in reads if name == "model.embed_tokens.weight"}
    ref, _, _ = convert_hf.load_params(
        src, cfg.model, sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    )
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
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text((fused_dir / "config.json").read_text())
    return path


def test_mixtral_imports_per_expert_and_fused_layouts_reading_only_its_experts(tmp_path, reads):
    """Released Mixtral checkpoints hold one tensor per expert, transformers 5 keeps (and can
    save) the experts fused per layer; both import to the same parameters, and on a mesh with
    experts split in two each shard reads only its experts' tensors (or slice)."""
    model = hf_model("mixtral")
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
    shards = {
        tuple((s.start, s.stop) for s in index)
        for index in gate.sharding.devices_indices_map(gate.shape).values()
    }
    want = sum(len(range(2)[slice(*s[0])]) * len(range(4)[slice(*s[1])]) for s in shards)
    assert sum(".w1." in name for name, _ in reads) == want == 8 * 2 * 2  # 2 of 4 experts each

    reads.clear()
    from_fused, _, _ = convert_hf.load_params(fused, cfg.model, mesh)
    fused_reads = {shape for name, shape in reads if name.endswith("gate_up_proj")}
    assert fused_reads == {(2, 256, 64)}
    for a, b in zip(jax.tree.leaves(from_legacy), jax.tree.leaves(from_fused)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    got = jaxllm.load_model(legacy, overrides=["model.dtype=float32"])(sample_tokens(1)).logits
    np.testing.assert_allclose(got, hf_logits(model, sample_tokens(1)), atol=1e-4, rtol=1e-4)

    # a fine-tune with bias balancing: the bias Mixtral does not have starts at zero
    moe = dataclasses.replace(cfg.model.moe, bias_update_rate=1e-3)
    _, state, _ = convert_hf.load_params(legacy, dataclasses.replace(cfg.model, moe=moe), mesh)
    bias = state["moe_layers"]["moe"]["mlp"]["router_bias"]
    assert bias.shape == (2, 4) and not np.asarray(bias).any()


def test_mixtral_refuses_what_the_knobs_cannot_express():
    hf_cfg = json.loads(hf.MixtralConfig(**SMALL, num_local_experts=4).to_json_string())
    for extra, message in [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"num_experts_per_tok": 5}, "between 1 and num_local_experts=4"),
    ]:
        with pytest.raises(config.ConfigError, match=message):
            families.model_fields({**hf_cfg, **extra})

    tiny = config.load(REPO / "configs/models/tiny_mixtral.yaml").model  # mlp_dim != experts'
    assert families.guess_family(tiny).name == "mixtral"
    out = families.hf_config(tiny, families.FAMILIES["mixtral"])
    assert (out["intermediate_size"], out["num_local_experts"], out["router_aux_loss_coef"]) == (
        320,
        8,
        0.02,
    )
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
        families.hf_config(
            dataclasses.replace(tiny, sliding_window=8, global_every=2),
            families.FAMILIES["mixtral"],
        )
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
    rope = got["rope"]
    assert (
        rope["theta"],
        rope["scaling"],
        rope["factor"],
        rope["local_theta"],
        got["sliding_window"],
        got["global_every"],
        got["qk_norm"],
    ) == (1000.0, "linear", 4.0, 10.0, 6, 2, True)
    legacy = {k: v for k, v in hf_cfg.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(
        num_hidden_layers=12,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    old = families.model_fields(legacy)  # older config.json: pattern 6, flat RoPE keys
    old_rope = old["rope"]
    assert (
        old_rope["theta"],
        old_rope["factor"],
        old_rope["local_theta"],
        old["global_every"],
    ) == (1e6, 8.0, 1e4, 6)
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
    no_local = dataclasses.replace(cfg.rope, local_theta=None)
    all_global = dataclasses.replace(cfg, sliding_window=None, global_every=0, rope=no_local)
    assert families.guess_family(all_global).name == "gemma3_text"  # by its QK-norm
    assert (
        families.hf_config(all_global, families.FAMILIES["gemma3_text"])["layer_types"]
        == ["full_attention"] * 2
    )
    gemma2 = dataclasses.replace(cfg, rope=no_local, qk_norm=False)
    assert families.guess_family(gemma2).name == "gemma2"
    with pytest.raises(config.ConfigError, match="model.rope.local_theta=10.0"):
        families.hf_config(cfg, families.FAMILIES["gemma2"])
    # windowed layers with the global scaled RoPE: Gemma 3 never scales its sliding layers
    windowed_scaled = dataclasses.replace(cfg, rope=no_local)
    with pytest.raises(config.ConfigError, match="model.rope.local_theta=None"):
        families.hf_config(windowed_scaled, families.FAMILIES["gemma3_text"])


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
