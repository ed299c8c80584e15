"""The default run in float16 (dynamic loss scaling) and with FP8 matmuls lands near bfloat16:
within 2% and 3% of its final eval loss. bfloat16's is the reference run of
docs/default_run_losses.jsonl, which `jaxllm train` reproduces bit for bit. Each run takes
minutes on 2 CPU cores (fp8 and float16 are emulated there), so these run with -m slow."""

import json
from pathlib import Path

import pytest

from jaxllm.cli import main

REPO = Path(__file__).resolve().parent.parent


def _final_eval(path: Path) -> float:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [r["eval_loss"] for r in rows if "eval_loss" in r][-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "tolerance"),
    [(["model.dtype=float16"], 0.02), (["model.matmul_dtype=float8"], 0.03)],
    ids=["float16", "fp8"],
)
def test_default_run_in_lower_precision_lands_near_bfloat16(
    overrides, tolerance, tmp_path, monkeypatch
):
    monkeypatch.chdir(REPO)  # the default run's presets live under ./configs
    assert main(["train", *overrides, "train.sample_tokens=0", f"run.dir={tmp_path}"]) == 0
    want = _final_eval(REPO / "docs" / "default_run_losses.jsonl")
    got = _final_eval(tmp_path / "metrics.jsonl")
    assert abs(got / want - 1) < tolerance, (got, want)
