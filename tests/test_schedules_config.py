"""The schedule keys and stability knobs at the config's edge: impossible values and keys that
would do nothing are refused in one line (exit 2), and a run with lr_scaling prints its
resolved rate and logs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_RUN, cpu_env

from jaxllm import config
from jaxllm.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["optim.schedule=step"], "optim.schedule=step needs optim.decay_every >= 1"),
        (["optim.schedule=exponential", "optim.decay_every=0"], "needs optim.decay_every"),
        (["optim.schedule=step", "optim.decay_every=10", "optim.decay_rate=1.5"], "decay_rate"),
        (["optim.schedule=exponential", "optim.decay_every=9", "optim.decay_rate=0"], "(0, 1)"),
        (["optim.schedule=step", "optim.decay_every=500"], "never decays"),
        (["optim.schedule=cosine_restarts"], "needs optim.restart_steps >= 1"),
        (
            ["optim.schedule=cosine_restarts", "optim.restart_steps=20", "optim.restart_mult=0.5"],
            "optim.restart_mult must be a finite number >= 1",
        ),
        (["optim.schedule=cosine_restarts", "optim.restart_steps=140"], "never restarts"),
        (["optim.decay_every=10"], "optim.decay_every does nothing with optim.schedule=cosine"),
        (["optim.schedule=step", "optim.decay_every=10", "optim.restart_mult=2"], "restart_mult"),
        (["optim.restart_steps=10"], "pick optim.schedule=cosine_restarts"),
        (["optim.clip_value=0"], "optim.clip_value must be a finite number > 0"),
        (["optim.clip_value=nan"], "optim.clip_value"),
        (["optim.grad_noise=-1"], "optim.grad_noise must be"),
        (["optim.grad_noise_gamma=1"], "grad_noise_gamma does nothing with optim.grad_noise=0"),
        (["optim.grad_noise=0.1", "optim.grad_noise_gamma=-1"], "grad_noise_gamma must be"),
        (["optim.lr_scaling=linear"], "needs optim.reference_batch_size"),
        (["optim.lr_scaling=sqrt"], "needs optim.reference_batch_size"),
        (["optim.reference_batch_size=16"], "does nothing with optim.lr_scaling=none"),
        (["optim.lr_scaling=linear", "optim.reference_batch_size=0"], ">= 1"),
    ],
)
def test_impossible_schedule_values_are_config_errors(overrides, needle):
    with pytest.raises(config.ConfigError) as e:
        config.load(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_new_keys_load_with_their_schedules():
    cfg = config.load(
        None,
        [
            "optim.schedule=cosine_restarts",
            "optim.restart_steps=30",
            "optim.restart_mult=2",
            "optim.clip_value=0.5",
            "optim.grad_noise=0.01",
            "optim.grad_noise_gamma=0.6",
            "optim.lr_scaling=sqrt",
            "optim.reference_batch_size=4",
            "train.deterministic=true",
        ],
    )
    assert cfg.optim.restart_mult == 2 and cfg.train.deterministic is True
    step = config.load(None, ["optim.schedule=step", "optim.decay_every=30"]).optim
    assert (step.decay_every, step.decay_rate) == (30, 0.5)


def _jaxllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxllm", "train", *args],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_refuses_lr_scaling_without_a_reference_in_one_line():
    proc = _jaxllm("optim.lr_scaling=linear")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("jaxllm: ") and "optim.reference_batch_size" in line


def test_a_scaled_run_prints_and_logs_its_resolved_rate(tmp_path):
    proc = _jaxllm(
        *SMALL_RUN,
        "train.steps=3",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "optim.lr_scaling=linear",
        "optim.reference_batch_size=2",
        f"run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "lr 0.004: optim.lr 0.001 x (8/2) (optim.lr_scaling=linear" in proc.stderr
    lrs = [r["lr"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "lr" in r]
    assert lrs == pytest.approx([4e-3] * 3)


@pytest.mark.slow
def test_a_noisy_run_resumes_bit_for_bit(tmp_path):
    """The noise key is optimizer state: checkpointed, restored, and drawn on from there."""
    run = [
        *SMALL_RUN,
        "model.num_layers=1",
        "optim.grad_noise=0.01",
        "optim.clip_value=0.5",
        "optim.schedule=cosine_restarts",
        "optim.restart_steps=2",
        "optim.warmup_steps=0",
    ]
    for steps, where in ((4, "resumed"), (6, "resumed"), (6, "straight")):
        proc = _jaxllm(*run, f"train.steps={steps}", f"run.dir={tmp_path / where}")
        assert proc.returncode == 0, proc.stderr
    rows = {
        w: [
            (r["loss"], r["grad_norm"])
            for r in read_jsonl(tmp_path / w / "metrics.jsonl")
            if "loss" in r
        ]
        for w in ("resumed", "straight")
    }
    assert len(rows["straight"]) == 6 and rows["resumed"] == rows["straight"]
