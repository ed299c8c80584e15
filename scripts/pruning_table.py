"""Prune a trained run with every method and sparsity `jaxllm prune` offers; measure each (the
seed's Table 9 style).

    python scripts/pruning_table.py RUN [--methods magnitude,wanda,sparsegpt]
        [--sparsities 0.5,2:4,4:8]  (structured: --methods layers,heads,channels) [--workdir DIR] [--out FILE.json] [--samples 128]
        [--calibration PATH] [--new-tokens 64] [--repeats 5]

Each row is `jaxllm prune RUN OUT --method M --sparsity S` (or `--pattern N:M`; the calibrated
methods with `--samples N` and `--calibration PATH` when given), measured as
scripts/compression_table.py measures a quantized run: held-out perplexity by `jaxllm eval`'s
code and its delta against the float run, the chosen weights' zeros and the parameters left
nonzero, and batch-1 decode tokens/s (bf16 KV cache). A pruned run is dense in memory: jaxllm has
no sparse matmul, so its decode speed is the dense model's. Writes the raw results as JSON
(`--out`) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
from compression_table import cpu_name, decode_speed, held_out
from flax import nnx

import jaxllm
from jaxllm.cli import main as jaxllm_main
from jaxllm.evaluate import evaluate_checkpoint

# The seed document's Table 9: published perplexity deltas, by (method, sparsity).
SEED_DELTAS = {("sparsegpt", "0.5"): 0.39, ("wanda", "2:4"): 2.69}
# LLM-Pruner's ~20% (heads and channels together, on LLaMA-7B) and SliceGPT's ~30%: printed
# beside the structured rows of about that size.
SEED_STRUCTURED = {"layers": 3.6, "heads": 3.6, "channels": 3.6, "slicegpt": 1.73}


def measure(run: Path, ns, prompt) -> dict:
    ev = evaluate_checkpoint(run)
    model = jaxllm.load_model(run)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    nonzero = sum(int(np.count_nonzero(np.asarray(x))) for x in leaves)
    return {
        "eval_loss": ev["eval_loss"],
        "perplexity": ev["perplexity"],
        "params": sum(x.size for x in leaves),
        "nonzero_params": nonzero,
        **decode_speed(model, prompt, "bfloat16", ns.new_tokens, ns.repeats),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--methods", default="magnitude,wanda,sparsegpt")
    p.add_argument("--sparsities", default="0.5,2:4,4:8")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--calibration")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--score-rows", type=int, default=1)
    ns = p.parse_args(argv)
    run = ns.run.resolve()
    work = (ns.workdir or run.parent / f"{run.name}-p").resolve()
    work.mkdir(parents=True, exist_ok=True)
    prompt, _ = held_out(run, ns)
    results = {
        "run": str(run),
        "device": f"{cpu_name()}, {jax.device_count()} {jax.default_backend()} device(s)",
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jax": jax.__version__,
        "settings": {k: str(v) for k, v in vars(ns).items()},
        "rows": [{"method": "none", "sparsity": "0", **measure(run, ns, prompt)}],
    }
    base = results["rows"][0]["perplexity"]
    print(f"float: PPL {base:.3f}", file=sys.stderr)
    for method in ns.methods.split(","):
        for sparsity in ns.sparsities.split(","):
            out = work / f"{method}-{sparsity.replace(':', 'of')}"
            how = ["--pattern", sparsity] if ":" in sparsity else ["--sparsity", sparsity]
            if method != "magnitude":
                how += ["--samples", str(ns.samples)]
                how += ["--calibration", ns.calibration] if ns.calibration else []
            t0 = time.perf_counter()
            assert jaxllm_main(["prune", str(run), str(out), "--method", method, *how]) == 0
            row = {
                "method": method,
                "sparsity": sparsity,
                "prune_seconds": time.perf_counter() - t0,
            }
            row |= measure(out, ns, prompt)
            shutil.rmtree(out)
            results["rows"].append(row)
            print(f"{method} {sparsity}: PPL {row['perplexity']:.3f}", file=sys.stderr)
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=1) + "\n")
    print("| method | sparsity | PPL | delta | seed delta | params (nonzero) | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        seed = SEED_DELTAS.get((r["method"], r["sparsity"]), SEED_STRUCTURED.get(r["method"]))
        print(
            f"| {r['method']} | {r['sparsity']} | {r['perplexity']:.3f} | "
            f"{r['perplexity'] - base:+.3f} | {'' if seed is None else seed} | "
            f"{r['params'] / 1e6:.2f}M ({r['nonzero_params'] / 1e6:.2f}M) | "
            f"{r['tokens_per_s']:.1f} |"
        )
    return results


if __name__ == "__main__":
    main()
