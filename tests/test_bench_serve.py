"""scripts/bench_serve.py end to end at a tiny scale on the tests' small run: a served run under
two streaming clients, the static generator and transformers on the same requests."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.config import ConfigError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"


def _script():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 25 s to 3 min on the shared 2-core CPU: a server, compiles, three runs
@pytest.mark.torch
def test_serve_static_and_hf_on_the_same_requests(small_run, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = f"{small_run} --clients 2 --num-requests 5 --output-len 2:6 --prompt-len 2:5 "
    args += f"--system-prompt 9 --page-size 4 --chunk-size 4 --max-model-len 64 --out {out}"
    res = _script().main(args.split())
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    serve, static, hf = res["serve"], res["static"], res["hf"]
    wanted = serve["output_tokens"]
    assert 5 * 2 <= wanted <= 5 * 6 and static["output_tokens"] == hf["output_tokens"] == wanted
    # ignore_eos makes every output exactly its max_tokens, as the server itself counted
    assert serve["server_generated_tokens"] == wanted and serve["finished_by_length"] == 5
    # static batches of 2, 2, 1 each run to their longest request: never fewer tokens
    assert static["generated_tokens"] == hf["generated_tokens"] >= wanted
    assert len(static["batch_s"]) == len(hf["batch_s"]) == 3
    for r in (serve, static, hf):
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0 and r["wall_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "latency_ms"):
        p = serve[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], key
    # gaps between streamed texts: as many as chunks after each request's first
    assert 5 <= serve["streamed_chunks"] <= wanted
    assert (serve["itl_ms"]["p50"] is None) == (serve["streamed_chunks"] == 5)
    assert res["speedup_vs_static"] > 0 and res["speedup_vs_hf"] > 0
    assert 5 * (9 + 2) <= res["prompt_tokens"] <= 5 * (9 + 5)
    table = capsys.readouterr().out
    assert "| jaxllm serve |" in table and "| HF generate |" in table


def test_bad_settings_are_one_line(small_run):
    with pytest.raises(ConfigError, match="max_seq_len"):
        _script().main([str(small_run), "--system-prompt", "100000", "--no-static", "--no-hf"])
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(small_run), "--output-len", "8:4"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("jaxllm: ")
    assert len(r.stderr.strip().splitlines()) == 1
