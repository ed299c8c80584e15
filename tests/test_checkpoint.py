"""Fault tolerance: exact resume after SIGKILL, resume on another mesh, SIGTERM, damaged
checkpoints, non-finite steps, and `jaxllm eval`. Real subprocesses and real signals."""

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cpu_env
from flax import nnx

import jaxllm
from jaxllm import JaxllmWarning, config
from jaxllm.data.packing import PackedRows
from jaxllm.data.pipeline import train_batches
from jaxllm.train.loop import train

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "data.max_files=60",
    "data.seq_len=64",
    "model.num_layers=2",
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def _start(args, devices=1, **kw):
    env = cpu_env(devices)
    return subprocess.Popen(
        [sys.executable, "-m", "jaxllm", "train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _run(args, devices=1):
    p = _start(args, devices)
    out = p.communicate(timeout=600)[0]
    return p.returncode, out


def _params(run_dir):
    return jax.device_get(nnx.to_pure_dict(nnx.state(jaxllm.load_model(run_dir), nnx.Param)))


def _losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _wait_for(path: Path, proc, timeout=300):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.1)


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    args = [*TINY, "train.steps=10", "checkpoint.every=2"]
    rc, out = _run([*args, f"run.dir={tmp_path / 'straight'}"])
    assert rc == 0, out
    victim = _start([*args, f"run.dir={tmp_path / 'killed'}"])
    _wait_for(tmp_path / "killed/checkpoints/6/commit_success.txt", victim)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert victim.returncode == -signal.SIGKILL
    rc, out = _run([str(tmp_path / "killed")])  # the run directory alone resumes it
    assert rc == 0, out
    assert "resumed from step" in out
    for a, b in zip(
        jax.tree.leaves(_params(tmp_path / "straight")),
        jax.tree.leaves(_params(tmp_path / "killed")),
    ):
        np.testing.assert_array_equal(a, b)
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "straight")  # no duplicated steps


def test_sigterm_checkpoints_and_exits_zero_then_resumes(tmp_path):
    args = [*TINY, "train.steps=400", f"run.dir={tmp_path}"]
    proc = _start(args)
    _wait_for(tmp_path / "metrics.jsonl", proc)
    while len((tmp_path / "metrics.jsonl").read_text().splitlines()) < 3:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    assert "stopping at step" in out and "signal" in out
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 3 <= saved[0] < 400
    assert max(_losses(tmp_path)) == saved[0]
    rc, out = _run([*args, "train.steps=" + str(saved[0] + 2)])
    assert rc == 0 and f"resumed from step {saved[0]}" in out, out


@pytest.mark.parametrize("damage", ["delete", pytest.param("truncate", marks=pytest.mark.slow)])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    args = [*TINY, "train.steps=4", "checkpoint.every=2", f"run.dir={tmp_path}"]
    assert _run(args)[0] == 0
    files = sorted(p for p in (tmp_path / "checkpoints/4/params").rglob("*") if p.is_file())
    for f in files:
        if damage == "delete":
            f.unlink()
        else:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    rc, out = _run([*args, "train.steps=6"])
    assert rc == 0, out
    assert "checkpoint at step 4" in out and "falling back to step 2" in out
    assert "resumed from step 2" in out


@pytest.mark.slow
def test_resume_on_another_mesh_and_device_count(tmp_path):
    args = [*TINY, "checkpoint.every=2"]
    rc, out = _run([*args, "train.steps=6", "mesh.fsdp=8", f"run.dir={tmp_path / 'ref'}"], 8)
    assert rc == 0, out
    rc, out = _run(
        [
            *args,
            "train.steps=6",
            "mesh.fsdp=8",
            f"run.dir={tmp_path / 'moved'}",
            "checkpoint.save_final=false",
            "checkpoint.every=4",
        ],
        8,
    )
    assert rc == 0, out
    shutil.copytree(tmp_path / "moved", tmp_path / "moved1")
    # fsdp8 on 8 devices -> dp2 x tp2 on 4, and -> 1 device
    rc, out = _run([str(tmp_path / "moved"), "mesh.fsdp=1", "mesh.data=2", "mesh.tensor=2"], 4)
    assert rc == 0 and "resumed from step 4" in out, out
    rc1, out1 = _run([str(tmp_path / "moved1"), "mesh.fsdp=1", "mesh.data=1"], 1)
    assert rc1 == 0 and "resumed from step 4" in out1, out1
    ref = _losses(tmp_path / "ref")
    for run in ("moved", "moved1"):
        got = _losses(tmp_path / run)
        assert sorted(got) == list(range(1, 7))
        np.testing.assert_allclose([got[s] for s in (5, 6)], [ref[s] for s in (5, 6)], rtol=1e-5)


def test_data_stream_continues_at_the_same_example_across_process_layouts():
    """Rows are numbered; a run of k batches on one process, then one resumed as two
    processes (each reading half of each batch) sees every row exactly as an uninterrupted run."""
    seq, batch = 8, 4
    rows = PackedRows([np.arange(10_000) % 200], seq, bos_id=256, eos_id=257)
    row_id = {
        int(rows[i]["inputs"][0]) * 1_000 + int(rows[i]["inputs"][1]): i for i in range(len(rows))
    }

    def ids(b):
        return [row_id[int(r[0]) * 1_000 + int(r[1])] for r in b["inputs"]]

    cfg = config.DataConfig(seq_len=seq, seed=3)
    straight = train_batches(rows, cfg, batch)
    expected = [ids(next(straight)) for _ in range(12)]
    first = train_batches(rows, cfg, batch)
    seen = [ids(next(first)) for _ in range(5)]
    state = first.get_state()
    halves = [
        train_batches(rows, cfg, batch, slice(0, 2)),
        train_batches(rows, cfg, batch, slice(2, 4)),
    ]
    for it in halves:
        it.set_state(state)
    for _ in range(7):
        seen.append(ids(next(halves[0])) + ids(next(halves[1])))
    assert seen == expected


def test_nonfinite_steps_never_touch_the_state_and_stop_the_run(tmp_path):
    # a learning rate of 1e9 makes step 1's update finite but step 2's loss infinite
    base = config.load(
        None,
        [
            *TINY,
            "optim.lr=1e9",
            "optim.warmup_steps=0",
            "train.steps=6",
            "optim.clip_norm=null",
            f"run.dir={tmp_path}",
        ],
    )
    result = train(base)
    # the bad step 2 is noticed while step 3 (dispatched asynchronously) runs
    assert result["stopped"] == "nonfinite" and result["step"] == 3
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] for r in rows] == [0.0, 1.0, 1.0]
    saved = _params(tmp_path)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(saved))

    skipping = config.load(
        None,
        [
            *TINY,
            "optim.lr=1e9",
            "optim.warmup_steps=0",
            "train.steps=3",
            "optim.clip_norm=null",
            f"run.dir={tmp_path / 'skip'}",
            "train.nonfinite=skip",
        ],
    )
    result = train(skipping)
    assert "stopped" not in result and result["step"] == 3
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_params(tmp_path / "skip"))):
        np.testing.assert_array_equal(a, b)  # steps 2 and 3 left the state as step 1 made it


def test_jaxllm_eval_reports_the_final_eval_loss(tmp_path):
    rc, out = _run([*TINY, "train.steps=3", "train.eval_every=3", f"run.dir={tmp_path}"])
    assert rc == 0, out
    final = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]
    env = cpu_env()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm", "eval", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"eval loss {final:.4f}" in proc.stdout
    assert "perplexity" in proc.stdout


@pytest.mark.slow  # the fallback itself is test_damaged_newest_checkpoint_falls_back_to_the_previous
def test_damaged_checkpoint_warning_is_a_jaxllm_warning(tmp_path):
    cfg = config.load(None, [*TINY, "train.steps=2", "checkpoint.every=1", f"run.dir={tmp_path}"])
    train(cfg)
    shutil.rmtree(tmp_path / "checkpoints/2/train")
    with pytest.warns(JaxllmWarning, match="step 2.*falling back to step 1"):
        train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3)))


def test_keeps_the_newest_k_plus_every_mth(tmp_path):
    cfg = config.load(
        None,
        [
            *TINY,
            "train.steps=7",
            "checkpoint.every=1",
            "checkpoint.keep=2",
            "checkpoint.keep_every=3",
            f"run.dir={tmp_path}",
        ],
    )
    train(cfg)
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [3, 6, 7]
    saved = json.loads((tmp_path / "checkpoints/7/config/metadata").read_text())
    assert saved["train"]["steps"] == 7  # the resolved config travels with the weights
    assert json.loads((tmp_path / "checkpoints/7/tokenizer/metadata").read_text())["name"] == "byte"
