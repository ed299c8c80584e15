"""scripts/train_cost.py: tokens, FLOPs, timed seconds and projected GPU-hours of a run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from jaxllm import config as config_lib
from jaxllm.metrics import flops_per_token


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "train_cost.py"
    spec = importlib.util.spec_from_file_location("train_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cost_of_a_run_from_its_config_and_metrics(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    cfg = config_lib.load(
        None, ["model.d_model=64", "data.seq_len=32", "train.global_batch_size=4"]
    )
    config_lib.dump(cfg, run / "config.yaml")
    rows = [
        {"step": 10, "loss": 5.0, "step_time_s": 0.5},
        {"step": 20, "loss": 4.0, "step_time_s": 0.25, "eval_loss": 4.5},
        {"step": 25, "loss": 3.9, "step_time_s": 0.2},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (r,) = _script().main([str(run), "--mfu", "0.5"])
    assert r["steps"] == 25 and r["tokens"] == 25 * 4 * 32
    assert r["seconds"] == pytest.approx(10 * 0.5 + 10 * 0.25 + 5 * 0.2)
    per_token = flops_per_token(cfg.model, 32)["total"]
    assert per_token > 6 * 64 * 64 * 4  # at least the attention projections of 4 layers
    assert r["flops"] == pytest.approx(3200 * per_token)
    assert r["gpu_hours"] == pytest.approx(3200 * per_token / (0.5 * 989e12) / 3600)
    out = capsys.readouterr().out
    assert "| r | " in out and "| all 1 runs | | | 3,200 |" in out


def test_a_directory_that_is_not_a_run_exits_2_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _script().main([str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm: ") and "not a run directory" in err[0]
