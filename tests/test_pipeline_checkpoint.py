"""Checkpoints across pipeline layouts: a run trained on pp2 x dp4 resumes as fsdp8 and the
reverse, each continuing exactly as the run that never changed its layout."""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxllm import config
from jaxllm.train.loop import train

BASE = [
    "data.max_files=20",
    "data.seq_len=32",
    "model.num_layers=4",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.dtype=float32",
    "model.param_dtype=float32",
    "train.global_batch_size=16",
    "train.grad_accum_steps=2",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "optim.warmup_steps=0",
    "optim.eps=1e-6",
    "optim.schedule=constant",
]
PP2_DP4 = ["mesh.stage=2", "mesh.data=4", "mesh.fsdp=1"]
FSDP8 = ["mesh.stage=1", "mesh.data=1", "mesh.fsdp=8"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _train(run_dir: Path, mesh: list[str], steps: int) -> None:
    train(config.load(None, [*BASE, *mesh, f"train.steps={steps}", f"run.dir={run_dir}"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, then", [(PP2_DP4, FSDP8), (FSDP8, PP2_DP4)], ids=["pp-fsdp", "fsdp-pp"]
)
def test_resume_on_another_layout(tmp_path, first, then):
    _train(tmp_path / "ref", then, 3)
    _train(tmp_path / "run", first, 2)
    _train(tmp_path / "run", then, 3)  # resumes from the step-2 checkpoint
    ref, got = _losses(tmp_path / "ref"), _losses(tmp_path / "run")
    assert sorted(got) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [ref[s] for s in (1, 2, 3)], rtol=1e-5)
