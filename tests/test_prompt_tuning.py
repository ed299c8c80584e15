"""Prompt tuning (`peft.method=prompt`): virtual tokens before every SFT example, the only
thing that trains, saved like adapters and used by generation."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

import jaxllm
from jaxllm import config
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.data.pipeline import load_splits
from jaxllm.infer import generate
from jaxllm.model import build, lora
from jaxllm.train.loop import train

PROMPT = PeftConfig(method="prompt", num_virtual_tokens=4)


def _chat(path, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for a, b in rng.integers(0, 50, (n, 2)).tolist():
            turns = [{"role": "user", "content": f"{a}+{b}="}]
            turns.append({"role": "assistant", "content": str(a + b)})
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def _data(tmp_path) -> list[str]:
    train_file, eval_file = _chat(tmp_path / "t.jsonl", 64, 0), _chat(tmp_path / "e.jsonl", 8, 1)
    return [
        f"data.sources=[{{path: {train_file}, format: chat}}]",
        f"data.eval_sources=[{{path: {eval_file}, format: chat}}]",
        "data.seq_len=96",
    ]


def test_virtual_tokens_start_every_example_untrained(tmp_path):
    cfg = config.load(None, [*_data(tmp_path), "peft.method=prompt", "peft.num_virtual_tokens=4"])
    rows, _ = load_splits(cfg.data, cfg.peft.virtual_tokens)
    row = rows[0]
    starts = np.flatnonzero(np.diff(row["segment_ids"], prepend=0) > 0)
    assert len(starts) >= 1
    for s in starts:  # each example: -1 .. -4, then its own tokens; nothing trains on them
        assert row["inputs"][s : s + 4].tolist() == [-1, -2, -3, -4]
        assert row["inputs"][s + 4] >= 0 and row["positions"][s] == 0
        assert not row["loss_mask"][s : s + 4].any()
    assert (row["targets"] >= 0).all()
    text = config.load(None, ["peft.method=prompt", "data.max_files=30"])  # the stdlib: text
    with pytest.raises(ConfigError, match="is text, but peft.method=prompt puts its virtual"):
        load_splits(text.data, text.peft.virtual_tokens)


def test_soft_prompt_is_the_embedding_of_the_virtual_tokens():
    cfg = tiny_model()
    model = build(cfg, 0, PROMPT)
    assert model.soft_prompt.shape == (4, cfg.d_model)
    tokens = jnp.asarray([[-1, -2, -3, -4, 5, 6, 7]])
    want = jnp.concatenate([model.soft_prompt[...], model.embed(tokens[:, 4:])[0]])[None]
    got = model(tokens).logits
    np.testing.assert_allclose(got, model(embeddings_BxLxD=want).logits, rtol=1e-6)
    # generation puts them before the prompt: its first token is the argmax after them
    out = generate(model, [[5, 6, 7]], config.GenerateConfig(max_new_tokens=2))
    assert out.tokens[0][0] == int(jnp.argmax(got[0, -1]))


def test_only_the_prompt_trains_and_loads_with_the_run(tmp_path):
    base = [
        "model.num_layers=2",
        "model.d_model=64",
        "model.mlp_dim=128",
        "model.dtype=float32",
        "train.global_batch_size=8",
        "train.sample_tokens=0",
        "train.eval_every=0",
        "train.eval_batches=1",
        "optim.warmup_steps=0",
        "mesh.data=1",
        "mesh.fsdp=-1",
    ]
    train(config.load(None, [*base, "data.max_files=20", "train.steps=2", f"run.dir={tmp_path}/b"]))
    args = [*base, *_data(tmp_path), "train.objective=sft", "peft.method=prompt"]
    args += ["peft.num_virtual_tokens=4", "optim.lr=0.1", f"checkpoint.init_from={tmp_path}/b"]
    train(config.load(None, [*args, "train.steps=6", "train.log_every=1", f"run.dir={tmp_path}/p"]))
    rows = [json.loads(x) for x in (tmp_path / "p/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    model = jaxllm.load_model(tmp_path / "p")
    base_model = jaxllm.load_model(tmp_path / "b")
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    frozen = nnx.to_pure_dict(nnx.state(base_model, nnx.Param))
    prompt = trained.pop("soft_prompt")
    ids = lora.prompt_token_ids(lora.peft_key(jax.random.split(jax.random.key(0))[0]), 4, 258)
    init = frozen["embed"]["embedding"][np.asarray(ids)]  # the base's embeddings of 4 tokens
    assert prompt.shape == init.shape and np.abs(prompt - init).min() > 1e-3
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(a, b)  # the base never moved
