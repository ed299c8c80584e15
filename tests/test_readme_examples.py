"""The README's "Custom objectives" and "Use the pieces" examples run as written: the objective
file trains through `jaxllm train train.objective=FILE.py:NAME` and through the Python API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_RUN

from jaxllm import config, objectives
from jaxllm.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)


@pytest.fixture
def objective_file(tmp_path) -> Path:
    (block,) = _python_blocks("Custom objectives")
    path = tmp_path / "my_objectives.py"
    path.write_text(block)
    return path


def test_the_readme_objective_trains_through_the_cli(objective_file, tmp_path):
    run = tmp_path / "run"
    spec = f"train.objective={objective_file}:label_smoothed"
    assert main(["train", *SMALL_RUN, "train.steps=6", spec, f"run.dir={run}"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "smoothed_loss" in r]
    assert len(steps) == 6
    # label smoothing puts mass off the target: the smoothed loss exceeds the plain one, and
    # both fall as the model learns
    assert all(r["smoothed_loss"] > r["loss"] for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_the_readme_pieces_run(objective_file):
    (block,) = _python_blocks("Use the pieces")
    env = {**os.environ, "PYTHONPATH": str(objective_file.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", block],
        cwd=objective_file.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "(2, 8, 64)"
    loss, smoothed = map(float, re.fullmatch(r"loss (\S+), smoothed (\S+)", lines[-1]).groups())
    assert 0 < loss < smoothed < 10


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nothing", "use one of next_token"),
        ("no_such_module_here:fn", "cannot be loaded"),
        ("/no/such/file.py:fn", "cannot be loaded"),
        ("json:__name__", "is not a function"),
    ],
)
def test_an_unknown_objective_is_a_config_error(spec, message):
    cfg = config.Config(train=config.TrainConfig(objective=spec))
    with pytest.raises(config.ConfigError, match=message):
        objectives.from_config(cfg)


def test_z_loss_with_a_custom_objective_is_refused(objective_file):
    cfg = config.Config(
        train=config.TrainConfig(objective=f"{objective_file}:label_smoothed", z_loss=1e-4)
    )
    with pytest.raises(config.ConfigError, match="train.z_loss belongs to the next_token"):
        objectives.from_config(cfg)
