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
from jaxllm.config import GenerateConfig, MeshConfig, MoEConfig
from jaxllm.convert import families
from jaxllm.convert import hf as convert_hf
from jaxllm.infer import generate

REPO = Path(__file__).resolve().parents[1]
VOCAB, LEN = 320, 20
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip

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


def test_streams_each_shard_onto_the_mesh(tmp_path, monkeypatch):
    """On a data x fsdp x tensor mesh every parameter arrives in its shards, equal to the
    single-device import; the embedding (same layout) is read one shard-sized slice at a time."""
    src = _save(_hf_model("llama2"), tmp_path / "hf")
    cfg = convert_hf.model_config(src, ["model.dtype=float32"])
    reads = []
    real_read = convert_hf.Reader.read

    def spy(self, name, index=None):
        out = real_read(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(convert_hf.Reader, "read", spy)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    params, _ = convert_hf.load_params(src, cfg.model, mesh)
    embed_reads = {shape for name, shape in reads if name == "model.embed_tokens.weight"}
    ref, _ = convert_hf.load_params(src, cfg.model, sharding.make_mesh(MeshConfig(),
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


def test_mixtral_imports_per_expert_and_fused_layouts_reading_only_its_experts(
    tmp_path, monkeypatch
):
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
    reads = []
    real_read = convert_hf.Reader.read

    def spy(self, name, index=None):
        out = real_read(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(convert_hf.Reader, "read", spy)
    mesh = sharding.make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    from_legacy, report = convert_hf.load_params(legacy, cfg.model, mesh)
    assert any("experts.{j}.w1.weight x2 layers x4 experts" in str(m) for m in report)
    gate = from_legacy["moe_layers"]["moe"]["mlp"]["gate_proj"]
    assert gate.sharding.spec[1] == "expert"
    shards = {tuple((s.start, s.stop) for s in index)
              for index in gate.sharding.devices_indices_map(gate.shape).values()}  # fmt: skip
    want = sum(len(range(2)[slice(*s[0])]) * len(range(4)[slice(*s[1])]) for s in shards)
    assert sum(".w1." in name for name, _ in reads) == want == 8 * 2 * 2  # 2 of 4 experts each

    reads.clear()
    from_fused, _ = convert_hf.load_params(fused, cfg.model, mesh)
    fused_reads = {shape for name, shape in reads if name.endswith("gate_up_proj")}
    assert fused_reads == {(2, 256, 64)}
    for a, b in zip(jax.tree.leaves(from_legacy), jax.tree.leaves(from_fused)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    got = jaxllm.load_model(legacy, overrides=["model.dtype=float32"])(_tokens(1))
    np.testing.assert_allclose(got, _hf_logits(model, _tokens(1)), atol=1e-4, rtol=1e-4)


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


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
