"""`jaxllm convert import / export` for every family: a tiny `transformers` model imported
gives the same logits, and exported back it loads in `transformers` with the same logits and the
same tensors byte for byte; refusals print one line; a converted checkpoint trains and
generates like `transformers`."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from hf_models import (
    FAMILIES,
    hf_logits,
    hf_model,
    run_cli,
    sample_tokens,
    save_hf,
    stderr_of_failure,
)
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import config, sharding
from jaxllm.config import GenerateConfig, MeshConfig
from jaxllm.infer import generate


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_export_parity(family, tmp_path, capsys):
    model = hf_model(family)
    src = save_hf(model, tmp_path / "hf")
    tokens = sample_tokens()
    want = hf_logits(model, tokens)

    assert run_cli("convert", "import", src, tmp_path / "run", "model.dtype=float32") == 0
    report = capsys.readouterr().out
    assert "embed/embedding" in report and "x2 layers" in report
    got = np.asarray(jaxllm.load_model(tmp_path / "run")(tokens).logits)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    assert run_cli("convert", "export", tmp_path / "run", tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():  # same bytes: same dtype, shape and values
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name

    back = type(model).from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(back, tokens), want, atol=1e-4, rtol=1e-4)


def test_refuses_unmapped_tensors_shape_mismatches_and_unknown_families(tmp_path, capsys):
    src = save_hf(hf_model("llama2"), tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_scale"] = np.ones(4, np.float32)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "a")
    assert "model.layers.0.self_attn.rotary_scale" in err and "maps to no parameter" in err
    assert not (tmp_path / "a" / "checkpoints").exists()

    del tensors["model.layers.0.self_attn.rotary_scale"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "b", "model.mlp_dim=96")
    assert "mlp.gate_proj.weight has shape [128, 64]" in err

    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "c")
    assert "model_type 'falcon' is not supported" in err


def test_export_refuses_knobs_the_family_cannot_hold(tmp_path, capsys):
    src = save_hf(hf_model("llama2"), tmp_path / "hf")
    assert run_cli("convert", "import", src, tmp_path / "run") == 0
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "run")
    assert "already holds files" in err
    err = stderr_of_failure(
        capsys, "convert", "export", tmp_path / "run", tmp_path / "o", "--family", "gpt2"
    )
    assert "cannot be expressed in a gpt2 checkpoint" in err and "model.position='rope'" in err


def test_converted_checkpoint_trains_and_generates(tmp_path, capsys):
    """`checkpoint.init_from` starts training from the imported weights (with lr 0 they come
    out unchanged); the imported run decodes the same greedy tokens as `transformers`."""
    model = hf_model("llama2")
    src = save_hf(model, tmp_path / "hf")
    assert run_cli("convert", "import", src, tmp_path / "imported", "model.dtype=float32") == 0

    prompt = [5, 17, 99, 3]
    imported = jaxllm.load_model(tmp_path / "imported")
    ours = generate(imported, [prompt], GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32"))
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
        )
    assert ours.tokens[0] == theirs[0, len(prompt) :].tolist()
    # two prompts: no streaming (an ordered host callback, which needs a single device)
    assert (
        run_cli(
            "generate",
            tmp_path / "imported",
            "--prompt",
            "def",
            "--prompt",
            "x = ",
            "--max-new-tokens",
            "4",
        )
        == 0
    )

    run = tmp_path / "ft"
    overrides = [
        tmp_path / "imported" / "config.yaml",
        f"run.dir={run}",
        f"checkpoint.init_from={src}",
        "train.steps=2",
        "train.global_batch_size=8",
        "data.seq_len=32",
        "data.max_files=20",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "optim.lr=0.0",
        "optim.warmup_steps=0",
    ]
    capsys.readouterr()
    assert run_cli("train", *overrides) == 0
    assert "initialized parameters from" in capsys.readouterr().err
    trained = jaxllm.load_model(run)
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(np.asarray, _params(trained))),
        jax.tree.leaves(jax.tree.map(np.asarray, _params(imported))),
    ):
        np.testing.assert_array_equal(a, b)
    # training straight in the imported directory starts from its weights-only checkpoint
    assert (
        run_cli(
            "train",
            tmp_path / "imported",
            "train.steps=1",
            "train.global_batch_size=8",
            "data.seq_len=32",
            "data.max_files=20",
            "train.eval_batches=1",
            "train.sample_tokens=0",
        )
        == 0
    )
    assert "initialized parameters from" in capsys.readouterr().err
    bad = config.load(tmp_path / "imported" / "config.yaml", ["model.num_layers=3"])
    from jaxllm.load import load_weights

    with pytest.raises(config.ConfigError, match="other parameters"):
        load_weights(src, bad.model, sharding.make_mesh(MeshConfig()))


def test_an_import_names_its_final_directory(tmp_path, capsys):
    """The run is built in a hidden sibling and renamed: its config.yaml and checkpoint name
    the final directory and its own tokenizer.json, so it generates, trains and exports there."""
    from jaxllm import checkpoint
    from jaxllm.data import train_bpe

    src = save_hf(hf_model("llama2"), tmp_path / "hf")
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, 300, tmp_path / "bpe")
    (src / "tokenizer.json").write_bytes(bpe.read_bytes())
    run = tmp_path / "run"
    assert run_cli("convert", "import", src, run, "model.dtype=float32") == 0
    cfg = config.load(run / "config.yaml")
    assert (cfg.run.dir, cfg.data.tokenizer) == (str(run), str(run / "tokenizer.json"))
    saved = checkpoint.read_json_item(run / "checkpoints", 0, "config")
    assert saved["run"]["dir"] == str(run) and saved["data"]["tokenizer"] == cfg.data.tokenizer
    # (Orbax's commit_success.txt markers note where they were written; nothing reads that.)
    files = [f for f in run.rglob("*") if f.is_file() and f.name != "commit_success.txt"]
    assert not [f for f in files if b".partial-" in f.read_bytes()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe", "hf", "run"]
    assert run_cli("generate", run, "--prompt", "def", "--max-new-tokens", "3") == 0
    train = ["train.global_batch_size=8", "data.seq_len=32", "data.max_files=20"]
    train += ["train.eval_batches=1", "train.sample_tokens=0"]
    assert run_cli("train", run, "train.steps=1", *train) == 0
    assert "initialized parameters from" in capsys.readouterr().err
    assert run_cli("convert", "export", run, tmp_path / "out") == 0
    exported, trained = (
        json.loads(p.read_text())["model"] for p in (tmp_path / "out" / "tokenizer.json", bpe)
    )
    assert exported == trained


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
