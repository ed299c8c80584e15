"""scripts/bench_quant_decode.py on its tiny model (the GPU's `quant_decode` and `decode_hbm`
steps at a CPU scale), and a run of random weights served by scripts/bench_serve.py (the
`serve_1b` step's path)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm import config
from jaxllm.infer import kv_cache

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_model_bf16_and_int4_decode_and_prefill(tmp_path, capsys):
    out = tmp_path / "q.json"
    args = "--model tiny --kinds bf16,int4 --batch 1,2 --new-tokens 4 --prompt-len 8 "
    args += f"--prefill-len 32 --iters 1 --out {out}"
    res = _script("bench_quant_decode").main(args.split())
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    bf16, int4 = res["rows"]
    assert [bf16["kind"], int4["kind"]] == ["bf16", "int4"]
    # the projections' codes at half a byte (plus group scales) against two bytes
    assert int4["weight_bytes"] < 0.6 * bf16["weight_bytes"]
    tiny = config.load(None, _script("bench_quant_decode").MODELS["tiny"][1])
    per_token = kv_cache.model_bytes_per_token(tiny.model, "bfloat16", 32)
    for row in res["rows"]:
        assert [d["batch"] for d in row["decode"]] == [1, 2]
        for d in row["decode"]:
            assert d["tokens_per_s"] == pytest.approx(d["batch"] * 4 / d["seconds"])
            assert d["kv_bytes"] == d["batch"] * (8 + 2) * per_token
            assert d["hbm_gb_per_s"] > d["weight_gb_per_s"] > 0 and d["peak_pct"] is None
        assert row["prefill"]["tokens"] == 32 and row["prefill"]["tokens_per_s"] > 0
    table = capsys.readouterr().out
    assert table.count("| int4 |") == 3 and table.count("| bf16 |") == 3


def test_bad_options_are_one_line():
    for bad in (["--kinds", "int5"], ["--batch", "x"]):
        r = subprocess.run(
            [sys.executable, str(SCRIPTS / "bench_quant_decode.py"), "--model", "tiny", *bad],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 2 and r.stderr.startswith("jaxllm: "), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # ~30 s on the shared 2-core CPU: a random run written, served and decoded
def test_random_run_is_served_with_every_token_streamed_as_text(tmp_path):
    run = tmp_path / "random"
    _script("bench_quant_decode").main(["--model", "tiny", "--write-run", str(run)])
    args = f"{run} --clients 2 --num-requests 3 --output-len 3:5 --prompt-len 2:4 --no-hf "
    args += "--system-prompt 4 --page-size 16 --chunk-size 4 --max-model-len 256 "
    args += "--kv-cache-dtype bfloat16"
    res = _script("bench_serve").main(args.split())
    serve = res["serve"]
    assert (
        serve["server_generated_tokens"] == serve["output_tokens"] == res["static"]["output_tokens"]
    )
    # the word tokenizer gives every id text, so each token arrives as its own chunk (the
    # byte tokenizer drops the ids past 255: most of a random model's tokens)
    assert serve["streamed_chunks"] == serve["output_tokens"]
    with pytest.raises(config.ConfigError, match="holds files"):
        _script("bench_quant_decode").main(["--model", "tiny", "--write-run", str(run)])


def test_engine_decode_step_beside_generate_and_smoothquant_on_random_words(capsys):
    args = "--model tiny --kinds bf16,w8a8-int8 --batch 2 --prompt-len 36 --new-tokens 4 "
    args += "--prefill-len 0 --iters 1 --engine --calibration-samples 2"
    res = _script("bench_quant_decode").main(args.split())
    bf16, w8a8 = res["rows"]
    # SmoothQuant's int8 codes (one byte against two; the embedding stays bf16)
    assert w8a8["weight_bytes"] < 0.7 * bf16["weight_bytes"]
    for row in res["rows"]:
        gen, eng = row["decode"]
        assert "engine" not in gen and eng["engine"] and "prefill" not in row
        assert eng["tokens_per_s"] == pytest.approx(2 / (eng["step_ms"] / 1e3))
        assert eng["hbm_gb_per_s"] > eng["weight_gb_per_s"] > 0
    out = capsys.readouterr()
    assert "| bf16 (engine) | " in out.out and "| w8a8-int8 (engine) | " in out.out
    assert [json.loads(line)["kind"] for line in out.err.splitlines() if line.startswith("{")] == [
        "bf16",
        "w8a8-int8",
    ]
