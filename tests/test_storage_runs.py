"""Models through a bucket (moto's S3 server, `tests/objectstore.py`): a tiny training reads
its data and its starting point (`checkpoint.init_from`) from s3://, and a run goes out to a
Hugging Face directory in a bucket and comes back (`convert export` / `import`, `load_model`,
`jaxllm eval` of a URL) with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from conftest import SMALL_RUN

import jaxllm
from jaxllm import storage
from jaxllm.cli import main


def _logits(model) -> np.ndarray:
    tokens = np.arange(1, 17, dtype=np.int32).reshape(2, 8) % 300
    return np.asarray(model(tokens).logits)


def _params(path) -> list[np.ndarray]:
    from flax import nnx

    model = jaxllm.load_model(path)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def test_training_reads_data_and_init_from_a_bucket(s3_env, small_run, tmp_path, capsys):
    bucket = s3_env.bucket()
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n"
            for i in range(60)
        )
    )
    storage.publish(data, f"{bucket}/data.jsonl", "k")
    storage.publish(small_run, f"{bucket}/run", "k", last=["_CHECKPOINT_METADATA", "config.yaml"])
    run = tmp_path / "ft"
    source = f"data.sources=[{{path: {bucket}/data.jsonl, format: jsonl}}]"
    argv = [*SMALL_RUN, source, f"checkpoint.init_from={bucket}/run", f"run.dir={run}"]
    argv += ["train.steps=1", "optim.lr=0.0", "optim.warmup_steps=0"]
    capsys.readouterr()
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err
    assert "initialized parameters from" in err, err
    for a, b in zip(_params(run), _params(small_run)):  # lr 0: the starting weights
        np.testing.assert_array_equal(a, b)
    recorded = jaxllm.config.load(run / "config.yaml")  # the URLs, not the local copies
    assert recorded.checkpoint.init_from == f"{bucket}/run"
    assert recorded.data.sources[0].path == f"{bucket}/data.jsonl"


def test_a_run_round_trips_through_a_bucket(s3_env, small_run, tmp_path, capsys):
    bucket = s3_env.bucket()
    hf, run = f"{bucket}/hf", f"{bucket}/imported"
    assert main(["convert", "export", str(small_run), hf]) == 0
    keys = s3_env.keys(hf)
    assert "hf/config.json" in keys and "hf/model.safetensors" in keys
    want = _logits(jaxllm.load_model(small_run))
    np.testing.assert_allclose(_logits(jaxllm.load_model(hf)), want, rtol=1e-6, atol=1e-6)

    assert main(["convert", "import", hf, run, "model.dtype=float32"]) == 0
    assert "imported/config.yaml" in s3_env.keys(run)
    np.testing.assert_allclose(_logits(jaxllm.load_model(run)), want, rtol=1e-6, atol=1e-6)
    capsys.readouterr()
    assert main(["eval", run, "data.max_files=20", "data.eval_fraction=0.2", "--batches", "1"]) == 0
    assert "eval loss" in capsys.readouterr().out

    # a finished output is refused without --overwrite and left as it was; with it, replaced
    before = s3_env.keys(hf)
    assert main(["convert", "export", str(small_run), hf]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert s3_env.keys(hf) == before
    assert main(["convert", "export", str(small_run), hf, "--overwrite"]) == 0
    assert s3_env.keys(hf) == before


def test_every_model_key_is_read_from_its_local_copy(s3_env, small_run):
    """`jaxllm train` hands the loop a config whose models in a bucket (init_from, teacher,
    reference, a reward model) are their local copies; other values stay as they are."""
    from jaxllm.config import CheckpointConfig, Config, TrainConfig
    from jaxllm.load import fetched_inputs, resolve

    bucket = s3_env.bucket()
    storage.publish(small_run, f"{bucket}/run", "k")
    storage.publish(small_run, f"{bucket}/rm", "k")
    cfg = Config(
        train=TrainConfig(teacher=f"{bucket}/run", reference=str(small_run), reward=f"{bucket}/rm"),
        checkpoint=CheckpointConfig(init_from=f"{bucket}/run/checkpoints/4"),
    )
    got = fetched_inputs(cfg)
    assert got.train.reference == str(small_run)
    assert got.train.teacher == str(storage.local_cache(f"{bucket}/run"))
    assert resolve(got.train.teacher)[0] == storage.local_cache(f"{bucket}/run")
    assert resolve(got.checkpoint.init_from)[2] == 4
    assert (Path(got.train.reward) / "config.yaml").is_file()
    plain = Config(train=TrainConfig(reward="exact_match"))
    assert fetched_inputs(plain) is plain
