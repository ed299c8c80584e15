"""scripts/compression_pipeline.py end to end at toy sizes: teacher, distilled student, pruned,
pruned+quantized, each measured."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import SMALL_RUN

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# Toy sizes: the tests' 8 CPU devices shard the batch over fsdp (as SMALL_RUN does); the data
# and vocabulary are SMALL_RUN's, so the session's small_run can be the teacher.
COMMON = [o for o in SMALL_RUN if o.split("=")[0].split(".")[0] in ("data", "mesh")]
COMMON += ["train.global_batch_size=8", "train.eval_batches=1", "model.vocab_size=320"]
# Orbax's files of a checkpoint written from 8 shards vary by tens of KB between identical runs
# (how the chunks fall into files); a student of ~100K parameters keeps each stage's saving
# (~100 KB and more) above that.
STUDENT = ["model.num_layers=1", "model.d_model=64", "model.mlp_dim=256"]
TEACHER = ["model.num_layers=2", "model.d_model=64", "model.mlp_dim=128", "model.dtype=float32"]


def _run(tmp_path, monkeypatch, extra: list[str]) -> tuple[dict, Path]:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # its `from compression_table import ...`
    path = SCRIPTS / "compression_pipeline.py"
    spec = importlib.util.spec_from_file_location("compression_pipeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, png = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    args = [f"--workdir={tmp_path / 'w'}", "--steps=3", "--samples=8", "--eval-batches=1"]
    args += ["--new-tokens=4", "--repeats=1", "--prompt-len=4", f"--out={out}", f"--chart={png}"]
    args += [*COMMON, *(f"--student-set={o}" for o in STUDENT), *extra]
    results = module.main(args)
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    assert png.read_bytes().startswith(b"\x89PNG")
    return results, out


def _check(rows: list[dict]) -> None:
    assert [r["stage"] for r in rows] == ["teacher", "student", "pruned", "pruned+quantized"]
    for r in rows:
        for key in ("params", "checkpoint_params_bytes", "weights_bytes", "tokens_per_s"):
            assert r[key] > 0, (r["stage"], key)
        assert 1 < r["perplexity"] < 2 * 320 and r["new_tokens"] == 4
    teacher, student, pruned, quantized = rows
    assert student["params"] < teacher["params"]
    # channels at 0.5: half of the one layer's MLP (128 of 256) gone, 3 x 64 x 128 parameters
    assert student["params"] - pruned["params"] == 3 * 64 * 128
    assert quantized["params"] == pruned["params"]  # counted before packing
    for smaller in (pruned, quantized):
        assert smaller["checkpoint_params_bytes"] < student["checkpoint_params_bytes"]
        assert smaller["weights_bytes"] < student["weights_bytes"]
    assert quantized["weights_bytes"] < pruned["weights_bytes"]


@pytest.mark.slow
def test_pipeline_from_a_trained_teacher(small_run, tmp_path, monkeypatch, capsys):
    # RTN (no calibration) keeps it fast; the slow test quantizes by the default GPTQ
    results, _ = _run(tmp_path, monkeypatch, [f"--teacher={small_run}", "--quantize=rtn"])
    _check(results["rows"])
    assert results["rows"][0]["run"] == str(small_run) and not (tmp_path / "w/teacher").exists()
    table = capsys.readouterr().out
    assert table.count("\n| pruned") == 2 and table.startswith("| stage |")


@pytest.mark.slow  # ~50 s on 2 cores alone: two training runs, GPTQ
def test_pipeline_trains_the_teacher_too(tmp_path, monkeypatch):
    results, _ = _run(tmp_path, monkeypatch, [f"--teacher-set={o}" for o in TEACHER])
    _check(results["rows"])
    assert results["rows"][0]["run"] == str(tmp_path / "w" / "teacher")
