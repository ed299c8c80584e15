"""scripts/compression_table.py on the tests' small run: one method and width, one KV dtype."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "compression_table.py"
    spec = importlib.util.spec_from_file_location("compression_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~25 s: two models, each evaluated, scored and decoded over two caches
def test_table_measures_the_float_and_a_quantized_run(small_run, tmp_path, capsys):
    out = tmp_path / "table.json"
    args = f"{small_run} --methods rtn --bits 8 --workdir {tmp_path / 'q'} --out {out} "
    args += "--kv int8 --score-rows 2 --prefix 4 --new-tokens 4 --repeats 1 --prompt-len 4"
    results = _script().main(args.split())
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(results["rows"]))
    float_row, q8 = results["rows"]
    assert [r["name"] for r in results["rows"]] == ["float", "rtn 8-bit"]
    assert q8["command"].startswith(f"jaxllm quantize {small_run} ")
    # int8 codes: about a quarter of the float32 projections' bytes; the float embedding stays
    assert q8["weights"]["total"] < float_row["weights"]["total"]
    assert q8["checkpoint_params_bytes"] < float_row["checkpoint_params_bytes"]
    assert q8["perplexity"] == pytest.approx(float_row["perplexity"], rel=0.01)
    for row in results["rows"]:
        assert set(row["kv"]) == {"bfloat16", "int8"}
        for kv in row["kv"].values():
            assert kv["new_tokens"] == 4 and kv["tokens_per_s"] > 0
            assert 1 < kv["cache_perplexity"] < 320
    assert not (tmp_path / "q" / "rtn-8").exists()  # removed once measured (no --keep)
    table = capsys.readouterr().out
    assert table.count("\n| rtn 8-bit |") == 2 and "| float | int8 | — |" in table
