"""Hugging Face interop: for each family a tiny model built by `transformers` (CPU torch, no
download) is imported and gives the same logits; exported back it loads in `transformers` with
the same logits and the same tensors byte for byte. Also: refusals, sharded streaming, training
and generation from a converted checkpoint."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import cli, config, sharding
from jaxllm.config import GenerateConfig, MeshConfig
from jaxllm.convert import hf as convert_hf
from jaxllm.infer import generate

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
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    err = _stderr_of_failure(capsys, "convert", "import", src, tmp_path / "c")
    assert "model_type 'mixtral' is not supported" in err


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
