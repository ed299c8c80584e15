"""Faults a run survives: a damaged newest checkpoint (healed by training, skipped by every
reader), stray entries under checkpoints/, a torn metrics line, a failing plot, a lock left by
a dead process, signals during start-up, an update that would make the parameters non-finite,
a full disk and a checkpoints directory removed mid-run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import SMALL_RUN, cpu_env, tiny_model
from test_faults import tree_hash

import jaxllm
from jaxllm import JaxllmWarning, checkpoint, config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.metrics import read_jsonl
from jaxllm.model import abstract_model
from jaxllm.objectives import next_token
from jaxllm.train import step as step_lib
from jaxllm.train.loop import to_global
from jaxllm.train.run_dir import RunLock
from jaxllm.train.state import init_state

REPO = Path(__file__).resolve().parent.parent


def _damage(ckpt: Path) -> None:
    for f in (ckpt / "params").rglob("*"):
        if f.is_file():
            f.unlink()


def _warnings_printed(err: str) -> str:
    return "\n".join(ln for ln in err.splitlines() if ln.startswith("jaxllm: warning:"))


def test_resume_heals_a_damaged_run(small_run, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    ckpts = run / "checkpoints"
    _damage(ckpts / "4")
    (ckpts / "999").mkdir()  # strays: never restored, never counted by checkpoint.keep
    (ckpts / "notes.txt").write_text("keep me\n")
    (ckpts / "3.orbax-checkpoint-tmp-17").mkdir()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # a crash tore the last line

    def broken_plot(*a, **k):
        raise OSError("no fonts")

    monkeypatch.setattr("jaxllm.train.loop.plot_losses", broken_plot)
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # printed as `jaxllm: warning:` lines
        code = main(["train", str(run), "train.steps=6", "checkpoint.keep=2"])
    said = _warnings_printed(capsys.readouterr().err)
    assert code == 0
    assert "step 4" in said and "moved it to 4.damaged, falling back to step 2" in said
    assert "metrics.jsonl:" in said and "not a whole JSON line" in said
    assert "could not draw" in said  # ... after the final checkpoint was written
    assert checkpoint.steps(ckpts) == [4, 6]  # step 4 redone and saved; 2 pruned, not 999
    assert {"4.damaged", "999", "notes.txt", "3.orbax-checkpoint-tmp-17"} <= {
        p.name for p in ckpts.iterdir()
    }
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    jaxllm.load_model(run)  # reads step 6 with no warning: the run is healthy again
    assert main(["train", str(run), "train.steps=6"]) == 0  # nothing to do, nothing to heal


def test_every_reader_falls_back_and_moves_nothing(small_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    _damage(run / "checkpoints" / "4")
    before = tree_hash(run)
    commands = {
        "eval": ["eval", str(run), "--batches", "1"],
        "generate": [
            "generate",
            str(run),
            "--prompt",
            "a",
            "--prompt",
            "b",
            "--max-new-tokens",
            "2",
        ],
        "export": ["convert", "export", str(run), str(tmp_path / "hf")],
    }
    for name, argv in commands.items():
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            assert main(argv) == 0, name
        out, err = capsys.readouterr()
        said = _warnings_printed(err)
        assert "step 4" in said and "unreadable" in said and "falling back to step 2" in said
        assert "step 2" in out + err.replace(said, ""), (name, out, err)
    with pytest.warns(JaxllmWarning, match="falling back to step 2"):
        jaxllm.load_model(run)
    assert tree_hash(run) == before


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = {"pid": 999999, "host": "old-host", "since": "2026-01-01T00:00:00+00:00"}
    (tmp_path / ".jaxllm.lock.json").write_text(json.dumps(dead))
    lock = RunLock(tmp_path)
    with pytest.warns(JaxllmWarning, match="pid 999999 on old-host, which is no longer running"):
        lock.acquire()
    assert lock.holder()["pid"] == os.getpid()
    with pytest.raises(config.RunError, match=f"pid {os.getpid()}"):
        RunLock(tmp_path).acquire()  # a second writer, while this one holds it
    lock.release()
    assert lock.holder() is None
    RunLock(tmp_path).acquire()  # free again, and no warning: the holder left cleanly


def _start(args, shell_setup: str = ""):
    """`python -m jaxllm train ARGS` in a child process (after `shell_setup` in bash, whose
    limits and ignored signals the program inherits)."""
    env = cpu_env()
    cmd = [sys.executable, "-m", "jaxllm", "train", *args]
    if shell_setup:
        cmd = ["bash", "-c", f'{shell_setup}; exec "$0" "$@"', *cmd]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_exits_at_once_and_leaves_nothing(tmp_path, sig, code):
    run = tmp_path / "run"
    proc = _start([*SMALL_RUN, "train.steps=3", f"run.dir={run}"])
    for line in proc.stderr:  # start-up: the data are read, the state and step compile next
        if line.startswith("data:"):
            break
    proc.send_signal(sig)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert time.monotonic() - t0 < 10, "the signal waited for the compiler"
    assert f"{signal.Signals(sig).name} during start-up" in err and "Traceback" not in err
    assert not run.exists()


def test_an_update_that_makes_parameters_non_finite_is_not_applied():
    cfg = config.Config(
        model=tiny_model(vocab_size=258),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8),
    )
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    tx = optax.sgd(float("nan"))  # finite loss and gradients, NaN update
    state = init_state(cfg.model, tx, mesh, seed=0)
    before = jax.device_get(state.params)
    graphdef = abstract_model(cfg.model)[0]
    step = jax.jit(
        lambda s, b: step_lib.train_step(
            s, b, graphdef=graphdef, tx=tx, lr_schedule=lambda _: 0.0, objective=next_token()
        )
    )
    batch = to_global(synthetic_batch(cfg), sharding.named(mesh, step_lib.BATCH_AXES))
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["nonfinite"]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_full_disk_is_one_line_and_keeps_the_newest_checkpoint(small_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)

    # writes past 100 KiB fail as on a full disk (EFBIG; SIGXFSZ ignored, so no signal death)
    proc = _start([str(run), "train.steps=6"], shell_setup="trap '' XFSZ; ulimit -f 100")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "step 4 is the newest finished one" in _one_line(err)
    assert checkpoint.steps(run / "checkpoints") == [2, 4]
    jaxllm.load_model(run)  # step 4 is intact


@pytest.mark.slow
def test_a_checkpoints_directory_removed_mid_run_is_one_line(tmp_path):
    run = tmp_path / "run"
    args = [*SMALL_RUN, "train.steps=400", "checkpoint.every=20", "checkpoint.async_save=false"]
    proc = _start([*args, f"run.dir={run}"])
    metrics = run / "metrics.jsonl"
    while not metrics.is_file() or metrics.read_text().count("\n") < 25:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    shutil.rmtree(run / "checkpoints")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "disappeared while training" in _one_line(err)


def test_resuming_on_other_data_warns_naming_the_sources(small_run, tmp_path):
    """A run.dir reused with other data resumes (training on new data is allowed) but says so:
    that is also what reusing a run.dir for a new run by mistake looks like."""
    from jaxllm.train.run_dir import check_resume

    run = [*SMALL_RUN, "train.steps=4", "checkpoint.every=2", f"run.dir={small_run}"]
    ckpts = small_run / "checkpoints"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_resume(config.load_args(run), ckpts)  # the same data: nothing to say
    other = config.load_args([*run, f"data.sources=[{{path: {tmp_path}/mine.jsonl}}]"])
    with pytest.warns(JaxllmWarning, match="from step 4 on other data") as said:
        check_resume(other, ckpts)
    assert f"(['stdlib'] there, ['{tmp_path}/mine.jsonl'] here)" in str(said[0].message)
