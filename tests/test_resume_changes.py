"""What a command may change in a run it resumes, and what it must leave: a fresh optimizer
on purpose (`checkpoint.reset_optimizer`), a deliberate new start (`checkpoint.start_fresh`),
"nothing to do", an interrupted start-up, a torn metrics line at the checkpoint's step, and
unreadable checkpoints reported in one line without the libraries' noise."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import yaml
from conftest import cpu_env
from test_faults import tree_hash

from jaxllm import checkpoint
from jaxllm.cli import main
from jaxllm.metrics import read_jsonl

REPO = Path(__file__).resolve().parent.parent


def _copy(small_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    return run


def _config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def test_reset_optimizer_keeps_the_parameters_and_records_the_change(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    argv = ["train", str(run), "optim.name=sgd", "checkpoint.reset_optimizer=true"]
    assert main([*argv, "train.steps=6"]) == 0
    cfg = _config(run)
    assert cfg["optim"]["name"] == "sgd" and cfg["checkpoint"]["reset_optimizer"] is False
    rows = read_jsonl(run / "metrics.jsonl")
    reset = [r for r in rows if "optimizer_reset" in r]
    assert [r["step"] for r in reset] == [4]
    assert "optim.name 'adamw' -> 'sgd'" in reset[0]["optimizer_reset"]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[5] < losses[1] - 0.2  # step 5 trained on step 4's parameters, not new ones
    assert checkpoint.steps(run / "checkpoints")[-1] == 6
    assert main(["train", str(run), "train.steps=7"]) == 0  # its own config.yaml resumes it


def test_start_fresh_moves_the_old_run_aside(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    (run / ".jaxllm.lock").unlink()  # the lock file stays with the directory, not the run
    before = tree_hash(run)
    assert main(["train", str(run), "train.steps=2", "checkpoint.start_fresh=true"]) == 0
    old = tmp_path / "run.old"
    assert tree_hash(old) == before  # renamed, not changed
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert checkpoint.steps(run / "checkpoints") == [2]
    assert _config(run)["checkpoint"]["start_fresh"] is False
    assert main(["train", str(run), "train.steps=2", "checkpoint.start_fresh=true"]) == 0
    assert (tmp_path / "run.old2").is_dir() and tree_hash(old) == before


def test_nothing_to_do_changes_nothing(small_run, tmp_path, capsys):
    run = _copy(small_run, tmp_path)
    before = tree_hash(run)
    argv = ["train", str(run), "train.steps=3", "checkpoint.every=1", "checkpoint.keep=1"]
    assert main(argv) == 0
    assert "nothing to do: the checkpoint is at step 4" in capsys.readouterr().err
    assert tree_hash(run) == before


def test_a_torn_metrics_line_at_the_checkpoint_step_comes_back(small_run, tmp_path, capsys):
    run = _copy(small_run, tmp_path)
    metrics = run / "metrics.jsonl"
    rows = read_jsonl(metrics)
    assert rows[-1]["step"] == 4  # the checkpoint's step, written last
    text = metrics.read_text()
    metrics.write_text(text[: text.rindex('{"step": 4') + 12])  # a crash tore it
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # printed as a `jaxllm: warning:` line
        assert main(["train", str(run), "train.steps=5"]) == 0
    assert "metrics.jsonl:4 is not a whole JSON line" in capsys.readouterr().err
    after = read_jsonl(metrics)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert after[3] == rows[-1]


def _jaxllm(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxllm", *args],
        cwd=REPO,
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_an_interrupted_compile_leaves_config_yaml_as_it_was(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    before = tree_hash(run)
    proc = _jaxllm("train", str(run), "train.steps=8", "optim.lr=0.002", "checkpoint.every=1")
    for line in proc.stderr:  # the state is restored; the step compiles next
        if line.startswith("model:"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert tree_hash(run) == before


def _truncate(step_dir: Path) -> None:
    """Cuts the parameter arrays' data files short, as a disk that filled up would."""
    for f in (step_dir / "params").rglob("ocdbt.process_0/d/*"):
        f.write_bytes(f.read_bytes()[:50])


def test_unreadable_checkpoints_are_one_line_each(small_run, tmp_path):
    run = _copy(small_run, tmp_path)
    _truncate(run / "checkpoints" / "4")
    proc = _jaxllm("generate", str(run), "--prompt", "a", "--max-new-tokens", "2")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    said = [ln for ln in err.splitlines() if ln.strip()]
    assert len(said) <= 2 and "falling back to step 2" in said[0], err  # + its summary line
    _truncate(run / "checkpoints" / "2")
    before = tree_hash(run)
    proc = _jaxllm("train", str(run), "train.steps=6")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert len(lines) == 1 and "no checkpoint in" in lines[0], err
    assert "steps 2, 4" in lines[0] and "nothing was changed" in lines[0]
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert tree_hash(run) == before
