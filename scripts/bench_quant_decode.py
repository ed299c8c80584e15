"""Decode and prefill speed of a model in bf16 and quantized, on random weights (no download).

    python scripts/bench_quant_decode.py [--model 1b|tiny]
        [--kinds bf16,int8,int4,w8a8-fp8,w8a8-int8] [--calibration-samples 4]
        [--batch 1,16] [--prompt-len 16] [--new-tokens 256] [--prefill-len 2048] [--iters 3]
        [--kv-cache-dtype bfloat16] [--out FILE.json]
    python scripts/bench_quant_decode.py --model 1b --write-run DIR

`--model 1b` is configs/models/llama3_2_1b.yaml with bf16 parameters; `tiny` a 2-layer model
of 128 wide for a CPU smoke test. Speed does not depend on the weights' values, so the weights
are random (`jaxllm.bench.random_weights`), and each kind quantizes them in memory as `jaxllm
quantize` does (`jaxllm.compress.quantize_params`): `int8` RTN per output channel, `int4` RTN
in groups of `--group-size` (128), `fp8` E4M3 weights (weight-only), `w8a8-fp8` E4M3 weights
and per-token E4M3 activations (an fp8 x fp8 dot: W8A8 with no calibration data), `w8a8-int8`
SmoothQuant (an int8 x int8 dot), calibrated on `--calibration-samples` rows of random words. Embeddings
stay in bf16 (Llama-3.2-1B's LM head is its tied embedding: 0.53 GB of every kind's bytes).

Each measurement is `jaxllm.infer.generate` (one jitted prefill + decode loop, greedy, no stop
tokens), timed by `jaxllm.bench.median_seconds` over `--iters` calls after a compiling one:

- decode, per batch B: a `--prompt-len`-token prompt continued by `--new-tokens` N tokens;
  tokens/s = B N / t, a step = t / N (the short prefill is in t, as one step more). Weight
  GB/s = the weights' bytes (codes and scales as stored) / step; HBM GB/s adds the KV cache
  one step reads (B x the mean context, prompt + N / 2, x the cache's bytes per token), and
  its share of the device's peak bandwidth where known (H100 3.35, H200 4.8 TB/s);
- with `--engine`, also the serving engine's decode step (`jaxllm.infer.engine.Engine`, its
  host scheduling included): B requests of `--prompt-len` random tokens prefilled, then
  `Engine.step` timed over `--engine-steps` steps in which every slot decodes one token;
- prefill: one `--prefill-len`-token prompt at batch 1 with one new token, less one batch-1
  decode step (0: no prefill row): prefill tokens/s.

Prints two markdown tables with the speed-up of each kind over bf16 (and each kind's row as a
JSON line on stderr as it is measured); `--out` writes the rows.
`--write-run DIR` instead writes the model's random weights as a run directory
(`jaxllm.bench.write_random_run`, with a word tokenizer) for `jaxllm serve` and
scripts/bench_serve.py, and measures nothing. Bad options: one `jaxllm: ...` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxllm import compress, config, sharding
from jaxllm.bench import (
    median_seconds,
    random_weights,
    script_main,
    word_tokenizer,
    write_random_run,
)
from jaxllm.compress.calibrate import quantize_calibrated
from jaxllm.config import ConfigError, GenerateConfig
from jaxllm.infer import kv_cache
from jaxllm.infer.engine import Engine, SamplingParams
from jaxllm.infer.generate import generate
from jaxllm.model.abstract import abstract_model
from jaxllm.model.transformer import merge_model

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "1b": (ROOT / "configs" / "models" / "llama3_2_1b.yaml", ["model.param_dtype=bfloat16"]),
    "tiny": (
        None,
        [
            "model.param_dtype=bfloat16",
            "model.vocab_size=512",
            "model.d_model=128",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.mlp_dim=256",
            "model.max_seq_len=512",
        ],
    ),
}
# Peak HBM bandwidth (bytes/s) by device kind substring (as scripts/bench_decode.py).
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def kinds(group: int) -> dict[str, list[str]]:
    """Each kind's `quantize.*` overrides (none: bf16)."""
    return {
        "bf16": [],
        "int8": ["quantize.method=rtn", "quantize.bits=8"],
        "int4": ["quantize.method=rtn", "quantize.bits=4", f"quantize.group_size={group}"],
        "fp8": ["quantize.method=fp8", "quantize.bits=8"],
        "w8a8-fp8": ["quantize.method=fp8", "quantize.bits=8", "quantize.fp8_activations=true"],
        "w8a8-int8": ["quantize.method=smoothquant", "quantize.bits=8"],
    }


def quantized(params, model_state, axes, ns, kind: str, mesh, tmp: Path):
    """`params` as `kind` stores them; SmoothQuant calibrated on `--calibration-samples` rows
    of 512 random words of a word tokenizer (speed does not depend on its scales)."""
    path, overrides = MODELS[ns.model]
    extra = kinds(ns.group_size)[kind]
    if not extra:
        return params
    if "quantize.method=smoothquant" in extra:
        n, vocab = ns.calibration_samples, config.load(path, overrides).model.vocab_size
        word_tokenizer(tmp / "tokenizer.json", vocab)
        words = np.random.default_rng(ns.seed).integers(0, vocab - 2, n * 512 + 64)
        (tmp / "calibration.txt").write_text(" ".join(f"w{i}" for i in words))
        extra = [*extra, f"data.tokenizer={tmp / 'tokenizer.json'}", "data.seq_len=512"]
        extra += [f"quantize.calibration={tmp / 'calibration.txt'}", f"quantize.samples={n}"]
    cfg = config.load(path, [*overrides, *extra])
    if cfg.quantize.calibrated:
        return quantize_calibrated(params, model_state, axes, cfg, mesh)
    return compress.quantize_params(params, axes, cfg.quantize, mesh)


def peak_bandwidth(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((p for name, p in PEAK_BANDWIDTH.items() if name in kind), None)


def nbytes(tree) -> int:
    """Bytes of every array of `tree` as stored (a quantized weight's codes and scales)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one `jaxllm: ...` line, exit 2, as every jaxllm command
        raise ConfigError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--kinds", default="bf16,int8,int4,w8a8-fp8,w8a8-int8")
    p.add_argument("--group-size", type=int, default=128, help="int4's group")
    p.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=2048, help="0: no prefill measurement")
    p.add_argument("--kv-cache-dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-samples", type=int, default=4, help="w8a8-int8's rows")
    p.add_argument("--engine", action="store_true", help="also time the engine's decode step")
    p.add_argument("--engine-steps", type=int, default=16)
    p.add_argument("--out", type=Path)
    p.add_argument("--write-run", type=Path, help="write the random model as a run, then stop")
    ns = p.parse_args(argv)
    table = kinds(ns.group_size)
    ns.kinds = ns.kinds.split(",")
    bad = [k for k in ns.kinds if k not in table]
    if bad:
        p.error(f"unknown kinds {bad}; this script has {', '.join(table)}")
    try:
        ns.batch = [int(b) for b in ns.batch.split(",")]
    except ValueError:
        p.error(f"--batch {ns.batch}: give whole numbers, comma-separated")
    if min(ns.batch) < 1 or min(ns.prompt_len, ns.new_tokens, ns.iters) < 1:
        p.error("--batch, --prompt-len, --new-tokens and --iters must be at least 1")
    return ns


def decode_row(model, ns, b: int, weights: int, kv_per_token: int, peak) -> dict:
    rng = np.random.default_rng(ns.seed + b)
    vocab = model.cfg.vocab_size
    prompts = rng.integers(0, vocab - 2, (b, ns.prompt_len)).tolist()
    gen = GenerateConfig(
        max_new_tokens=ns.new_tokens, temperature=0.0, kv_cache_dtype=ns.kv_cache_dtype
    )
    secs = median_seconds(lambda: generate(model, prompts, gen), iters=ns.iters)
    step = secs / ns.new_tokens
    kv = b * (ns.prompt_len + ns.new_tokens / 2) * kv_per_token
    row = {"batch": b, "seconds": secs, "tokens_per_s": b * ns.new_tokens / secs}
    row |= {"step_ms": step * 1e3, "weight_gb_per_s": weights / step / 1e9}
    row |= {"kv_bytes": kv, "hbm_gb_per_s": (weights + kv) / step / 1e9}
    return row | {"peak_pct": None if peak is None else 100 * (weights + kv) / step / peak}


def engine_row(model, ns, b: int, weights: int, kv_per_token: int, peak) -> dict:
    """The engine's decode step with `b` slots busy. A step whose block table grows past a
    power of two of pages compiles: a `--prompt-len` just past one (512 + 16: pages 33 .. 35
    of bucket 64) keeps the timed steps in one bucket."""
    rng = np.random.default_rng(ns.seed + b)
    steps, ps = ns.engine_steps, 16
    pages = -(-(ns.prompt_len + steps + 2) // ps)
    chunk = 1 << min(ns.prompt_len - 1, 1023).bit_length()  # one prefill step up to 1024
    engine = Engine(model, max_num_seqs=b, page_size=ps, num_pages=b * pages + 1,
                    chunk_size=chunk, kv_cache_dtype=ns.kv_cache_dtype)  # fmt: skip
    for prompt in rng.integers(0, model.cfg.vocab_size - 2, (b, ns.prompt_len)).tolist():
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8))
    for _ in range(ns.prompt_len + 2):  # prefill until every slot has decoded a token
        if len(engine.step().new_tokens) == b:
            break
    else:
        raise RuntimeError(f"the engine's {b} slots never decoded together")
    secs = median_seconds(engine.step, iters=steps)  # its first call: the decode compile
    kv = b * (ns.prompt_len + steps / 2 + 2) * kv_per_token
    row = {"batch": b, "engine": True, "seconds": secs * steps, "tokens_per_s": b / secs}
    row |= {"step_ms": secs * 1e3, "weight_gb_per_s": weights / secs / 1e9}
    row |= {"kv_bytes": kv, "hbm_gb_per_s": (weights + kv) / secs / 1e9}
    return row | {"peak_pct": None if peak is None else 100 * (weights + kv) / secs / peak}


def prefill_row(model, ns, step_s: float) -> dict:
    rng = np.random.default_rng(ns.seed)
    prompt = rng.integers(0, model.cfg.vocab_size - 2, (1, ns.prefill_len)).tolist()
    gen = GenerateConfig(max_new_tokens=1, temperature=0.0, kv_cache_dtype=ns.kv_cache_dtype)
    secs = median_seconds(lambda: generate(model, prompt, gen), iters=ns.iters)
    prefill = max(secs - step_s, 1e-9)
    return {"tokens": ns.prefill_len, "seconds": secs, "prefill_s": prefill} | {
        "tokens_per_s": ns.prefill_len / prefill
    }


def measure(ns) -> dict:
    path, overrides = MODELS[ns.model]
    cfg = config.load(path, overrides)
    mesh = sharding.make_mesh(cfg.mesh)
    graphdef, _, axes = abstract_model(cfg.model)
    params, model_state = random_weights(cfg, mesh, ns.seed)
    device = jax.devices()[0]
    peak = peak_bandwidth(device)
    kv_per_token = kv_cache.model_bytes_per_token(cfg.model, ns.kv_cache_dtype, 32)
    res = {"model": ns.model, "device": device.device_kind, "jax": jax.__version__}
    res |= {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "peak_bandwidth": peak}
    res |= {"settings": {k: str(v) for k, v in vars(ns).items()}, "rows": []}
    for kind in ns.kinds:
        with tempfile.TemporaryDirectory() as tmp:
            weights = quantized(params, model_state, axes, ns, kind, mesh, Path(tmp))
        model = merge_model(graphdef, weights, None, model_state)
        row = {"kind": kind, "weight_bytes": nbytes(weights), "decode": []}
        for b in ns.batch:
            row["decode"].append(decode_row(model, ns, b, row["weight_bytes"], kv_per_token, peak))
            if ns.engine:
                row["decode"].append(
                    engine_row(model, ns, b, row["weight_bytes"], kv_per_token, peak)
                )
        if ns.prefill_len:
            b1 = [d for d in row["decode"] if d["batch"] == 1]
            row["prefill"] = prefill_row(model, ns, b1[0]["step_ms"] / 1e3 if b1 else 0.0)
        res["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # kept when a time limit cuts
        del model, weights
    return res


def tables(res: dict) -> str:
    first = res["rows"][0]["decode"] if res["rows"] else []
    base = {(d["batch"], d.get("engine", False)): d for d in first}
    lines = [
        "| kind | weights MB | batch | decode tok/s | ms/step | weight GB/s | HBM GB/s "
        "| % peak | vs bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in res["rows"]:
        for d in row["decode"]:
            pct = "-" if d["peak_pct"] is None else f"{d['peak_pct']:.0f}"
            vs = base[d["batch"], d.get("engine", False)]["step_ms"] / d["step_ms"]
            name = row["kind"] + (" (engine)" if d.get("engine") else "")
            lines.append(
                f"| {name} | {row['weight_bytes'] / 1e6:.0f} | {d['batch']} | "
                f"{d['tokens_per_s']:.1f} | {d['step_ms']:.3f} | {d['weight_gb_per_s']:.1f} | "
                f"{d['hbm_gb_per_s']:.1f} | {pct} | {vs:.2f}x |"
            )
    pre = [r for r in res["rows"] if "prefill" in r]
    if pre:
        lines += ["", "| kind | prefill tokens | ms | prefill tok/s | vs bf16 |"]
        lines.append("|---|---:|---:|---:|---:|")
        first = pre[0]["prefill"]["prefill_s"]
        for r in pre:
            p = r["prefill"]
            lines.append(
                f"| {r['kind']} | {p['tokens']} | {p['prefill_s'] * 1e3:.2f} | "
                f"{p['tokens_per_s']:.0f} | {first / p['prefill_s']:.2f}x |"
            )
    lines.append(f"\ndevice: {res['device']} ({res['date']}, jax {res['jax']})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ns = parse_args(argv)
    if ns.write_run:
        path, overrides = MODELS[ns.model]
        out = write_random_run(ns.write_run, path, overrides, ns.seed)
        print(f"wrote a run of random weights ({ns.model}) to {out}")
        return {"run": str(out)}
    res = measure(ns)
    print(tables(res))
    if ns.out:
        ns.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    script_main(main)
