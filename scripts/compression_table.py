"""Quantize a trained run with every method and bit width jaxllm offers; measure each.

    python scripts/compression_table.py RUN [--methods rtn,gptq,...] [--bits 8,4] [--workdir DIR]
        [--out FILE.json] [--samples 32] [--new-tokens 64] [--repeats 5] [--kv int8,int4]
        [--score-rows 8] [--prefix 16] [--calibration PATH]

The methods are those of `jaxllm.config.quantize.METHOD_BITS` when the script runs (each bit
width it takes), or the `--methods` and `--bits` among them. Each is made by `jaxllm quantize RUN OUT
--method M --bits B` (a method the command refuses without calibration data is retried with
`--samples N`, where the command has that option; one it still refuses is reported with its
error line, not measured). For the float run and each quantized run:

- held-out loss and perplexity PPL = exp(mean next-token NLL) on the run's eval split, by the
  same code as `jaxllm eval RUN` (`jaxllm.evaluate.evaluate_checkpoint`, the run's
  `train.eval_batches` batches), and its delta against the float run's;
- the params item of the last checkpoint on disk (bytes under `checkpoints/STEP/params`) and
  the weights' bytes in memory (`jaxllm.compress.weight_bytes`: codes, scales, zero points and
  the parameters left in their dtype);
- decode tokens/s at batch 1: `jaxllm.infer.generate` (the code `jaxllm generate` runs, one
  jitted program) greedily continues a `--prompt-len`-token held-out prompt by `--new-tokens`
  tokens; one warm-up call compiles, the median of `--repeats` timed calls is reported as new
  tokens / seconds (the short prefill included);
- cache-scored perplexity: `--score-rows` held-out rows teacher-forced through the KV cache
  (`jaxllm.infer.score_with_cache`: prefill `--prefix` tokens, then one decode step per token),
  with the bf16 cache and with each `--kv` dtype (int8, int4), so a quantized KV cache's
  perplexity is measured by the same attention that generation uses.

Writes the raw results as JSON (`--out`) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jaxllm
from jaxllm import cli, compress, config, sharding
from jaxllm.config import GenerateConfig
from jaxllm.config.quantize import CALIBRATED, METHOD_BITS
from jaxllm.data.pipeline import load_splits
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.infer import generate, score_with_cache
from jaxllm.model.abstract import abstract_model

# The seed document's Table 8: published perplexity deltas, by (method, weight bits).
SEED_DELTAS = {
    ("gptq", 3): 0.34,
    ("awq", 3): 0.42,
    ("smoothquant", 8): 0.18,
    ("llm_int8", 8): 0.00,
}


def quantize_options() -> set[str]:
    """The options `jaxllm quantize` has (from the CLI's own parser)."""
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices["quantize"]._actions for o in a.option_strings}


def quantize(
    run: Path,
    out: Path,
    method: str,
    bits: int,
    samples: int,
    opts: set[str],
    calibration: str | None = None,
) -> dict:
    """Runs `jaxllm quantize` (in this process); {"seconds", "command"} or {"error"}: the
    command's one-line message. `calibration`: passed to the methods that read calibration
    data."""
    base = ["quantize", str(run), str(out), "--method", method, "--bits", str(bits), "--overwrite"]
    if calibration and method in CALIBRATED:
        base += ["--calibration", calibration, "--samples", str(samples)]
    tries = [base]
    if "--samples" in opts:
        tries.append([*base, "--samples", str(samples)])
    for args in tries:
        said = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(said):
            code = cli.main(args)
        if code == 0:
            return {"seconds": time.perf_counter() - t0, "command": "jaxllm " + " ".join(args)}
    return {"error": (said.getvalue().strip().splitlines() or [f"exit {code}"])[-1]}


def checkpoint_params_bytes(run: Path) -> int:
    """Bytes on disk of the params item of the run's newest checkpoint."""
    steps = [p for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    newest = max(steps, key=lambda p: int(p.name))
    return sum(f.stat().st_size for f in (newest / "params").rglob("*") if f.is_file())


def weights_in_memory(run: Path) -> dict:
    """compress.weight_bytes of a quantized run; the float run's parameters' bytes otherwise."""
    cfg = config.load(run / "config.yaml")
    _, abstract, axes = abstract_model(cfg.model)
    if cfg.quantize.enabled:
        mesh = sharding.make_mesh(cfg.mesh)
        return compress.weight_bytes(abstract, axes, cfg.quantize, mesh)
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    return {"how": f"float ({cfg.model.param_dtype})", "quantized_bytes": 0, "total": total}


def decode_speed(model, prompt: list[int], kind: str, new: int, repeats: int) -> dict:
    """Median tokens/s of greedy batch-1 generation of `new` tokens over a `kind` KV cache."""
    gen = GenerateConfig(max_new_tokens=new, temperature=0.0, kv_cache_dtype=kind)
    generate(model, [prompt], gen)  # compiles
    times, made = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = generate(model, [prompt], gen)
        times.append(time.perf_counter() - t0)
        made = len(out.tokens[0])
    return {"new_tokens": made, "seconds": statistics.median(times)} | {
        "tokens_per_s": made / statistics.median(times)
    }


def cache_ppl(model, tokens: np.ndarray, kind: str, prefix: int) -> float:
    nll, _ = score_with_cache(model, tokens, GenerateConfig(kv_cache_dtype=kind), prefix=prefix)
    return float(np.exp(nll.mean()))


def measure(run: Path, ns, prompt: list[int], tokens: np.ndarray, kv_kinds) -> dict:
    ev = evaluate_checkpoint(run)
    model = jaxllm.load_model(run)
    row = {
        "eval_loss": ev["eval_loss"],
        "perplexity": ev["perplexity"],
        "eval_tokens": ev["tokens"],
        "checkpoint_params_bytes": checkpoint_params_bytes(run),
        "weights": weights_in_memory(run),
        "kv": {},
    }
    for kind in ("bfloat16", *kv_kinds):
        row["kv"][kind] = {
            "cache_perplexity": cache_ppl(model, tokens, kind, ns.prefix),
            **decode_speed(model, prompt, kind, ns.new_tokens, ns.repeats),
        }
    return row


def held_out(run: Path, ns) -> tuple[list[int], np.ndarray]:
    """(a prompt, rows to score): the start of held-out rows of the run's eval split."""
    cfg = config.load(run / "config.yaml")
    _, rows = load_splits(cfg.data)
    take = [np.asarray(rows[i]["inputs"]) for i in range(ns.score_rows)]
    length = min(len(r) for r in take)
    return [int(t) for t in take[0][: ns.prompt_len]], np.stack([r[:length] for r in take])


def fmt_mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(results: dict) -> str:
    """The markdown table: a row per (weights, KV cache)."""
    float_row = results["rows"][0]
    base_ppl = float_row["perplexity"]
    base_cache = {k: v["cache_perplexity"] for k, v in float_row["kv"].items()}
    lines = [
        "| weights | KV cache | eval PPL | ΔPPL | cache-scored PPL | ΔPPL (cache) | seed ΔPPL "
        "| params on disk MiB | weights MiB | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        name = row["name"]
        if "error" in row:
            lines.append(f"| {name} | — | not measured: {row['error']} |||||||| ")
            continue
        seed = SEED_DELTAS.get((row["method"], row["bits"]))
        for kind, kv in row["kv"].items():
            first = kind == "bfloat16"
            ppl = f"{row['perplexity']:.3f}" if first else "—"
            delta = f"{row['perplexity'] - base_ppl:+.3f}" if first else "—"
            cp = kv["cache_perplexity"]
            lines.append(
                f"| {name} | {kind} | {ppl} | {delta} | {cp:.3f} | "
                f"{cp - base_cache['bfloat16']:+.3f} | "
                f"{'' if seed is None or not first else f'{seed:.2f}'} | "
                f"{fmt_mb(row['checkpoint_params_bytes'])} | "
                f"{fmt_mb(row['weights']['total'])} | {kv['tokens_per_s']:.1f} |"
            )
    return "\n".join(lines)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--methods", help="comma-separated; default: every method of METHOD_BITS")
    p.add_argument("--bits", help="comma-separated bit widths to keep; default: all")
    p.add_argument("--workdir", type=Path, help="where the quantized runs go (default RUN-q)")
    p.add_argument("--keep", action="store_true", help="keep the quantized runs")
    p.add_argument("--out", type=Path, help="the JSON of raw results")
    p.add_argument("--samples", type=int, default=32, help="calibration samples, where taken")
    p.add_argument(
        "--calibration",
        help="the calibrated methods' data (a path or a data source); default: the run's "
        "held-out split, which is also what the table evaluates on",
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv", default="int8,int4", help="KV cache dtypes besides bfloat16")
    p.add_argument("--score-rows", type=int, default=8)
    p.add_argument("--prefix", type=int, default=16)
    ns = p.parse_args(argv)

    run = ns.run.resolve()
    wanted = ns.methods.split(",") if ns.methods else list(METHOD_BITS)
    unknown = [m for m in wanted if m not in METHOD_BITS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; this jaxllm has {list(METHOD_BITS)}")
    kv_kinds = [k for k in ns.kv.split(",") if k]
    work = (ns.workdir or run.parent / f"{run.name}-q").resolve()
    work.mkdir(parents=True, exist_ok=True)
    opts = quantize_options()
    prompt, tokens = held_out(run, ns)
    started = time.time()
    results = {
        "run": str(run),
        "device": f"{cpu_name()}, {jax.device_count()} {jax.default_backend()} device(s)",
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jax": jax.__version__,
        "settings": {k: str(v) for k, v in vars(ns).items()},
        "rows": [{"name": "float", "method": "none", "bits": None}],
    }
    results["rows"][0] |= measure(run, ns, prompt, tokens, kv_kinds)
    print(f"float: PPL {results['rows'][0]['perplexity']:.3f}", file=sys.stderr)
    for method in wanted:
        for bits in METHOD_BITS[method]:
            if ns.bits and str(bits) not in ns.bits.split(","):
                continue
            name = f"{method} {bits}-bit"
            out = work / f"{method}-{bits}"
            row = {"name": name, "method": method, "bits": bits}
            row |= quantize(run, out, method, bits, ns.samples, opts, ns.calibration)
            if "error" not in row:
                row |= measure(out, ns, prompt, tokens, kv_kinds)
                if not ns.keep:
                    shutil.rmtree(out)
            results["rows"].append(row)
            print(f"{name}: {row.get('perplexity', row.get('error'))}", file=sys.stderr)
    results["seconds"] = time.time() - started
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
