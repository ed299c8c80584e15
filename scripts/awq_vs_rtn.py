"""AWQ against round-to-nearest on one trained run, over quantization settings: the held-out
loss of each (the whole held-out split by default) and its difference from the float run's, and
the largest / median ratio of each norm's learned scale (how far the run is from having the
outlier channels AWQ protects).

    python scripts/awq_vs_rtn.py RUN --calibration PATH [--samples 64] [--bits 4,3]
        [--settings g0s,g0a,g32a,g64a,g32s] [--eval-batches N] [--workdir DIR] [--out FILE.json]

A setting is gG (G: group size, 0 per channel) then s (symmetric) or a (a zero point). Each row
is `jaxllm quantize RUN OUT --method rtn|awq --bits B [--group-size G]
quantize.symmetric=...` (AWQ calibrated on `--calibration`, a text file), evaluated by `jaxllm
eval`'s code. Prints a markdown table; `--out` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from flax import nnx

import jaxllm
from jaxllm.cli import main as jaxllm_main
from jaxllm.evaluate import evaluate_checkpoint


def norm_spread(run: Path) -> dict[str, float]:
    """Each norm scale's largest |g| over its median |g| (per layer), by parameter path."""
    params = nnx.to_pure_dict(nnx.state(jaxllm.load_model(run), nnx.Param))
    out = {}

    def walk(tree, path):
        for key, value in tree.items():
            name = f"{path}/{key}" if path else str(key)
            if isinstance(value, dict):
                walk(value, name)
            elif "norm" in name:
                rows = np.abs(np.asarray(value, np.float32)).reshape(-1, np.shape(value)[-1])
                out[name] = float(max(r.max() / np.median(r) for r in rows))

    walk(params, "")
    return out


def quantize(run: Path, out: Path, method: str, bits: int, setting: str, ns) -> None:
    group, symmetric = int(setting[1:-1]), setting[-1] == "s"
    argv = ["quantize", str(run), str(out), "--method", method, "--bits", str(bits)]
    argv += ["--group-size", str(group)] if group else []
    argv += [f"quantize.symmetric={str(symmetric).lower()}"]
    if method == "awq":
        argv += ["--calibration", "{path: %s, format: text}" % ns.calibration]
        argv += ["--samples", str(ns.samples)]
    if jaxllm_main([*argv, "--overwrite"]) != 0:
        raise SystemExit(f"failed: jaxllm {' '.join(argv)}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--calibration", type=Path, required=True)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--bits", default="4,3")
    p.add_argument("--settings", default="g0s,g0a,g32a,g64a,g32s")
    p.add_argument("--eval-batches", type=int, default=0, help="0: the whole held-out split")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    workdir = ns.workdir or ns.run.with_name(ns.run.name + "-awq")
    cfg = jaxllm.config.load(ns.run / "config.yaml")
    batches = ns.eval_batches or 10**6  # evaluation stops at the end of the split

    def loss(run):
        return evaluate_checkpoint(run, num_batches=batches)["eval_loss"]

    results = {"run": str(ns.run), "settings": vars(ns) | {"run": str(ns.run)}, "rows": []}
    results["settings"] = {k: str(v) for k, v in results["settings"].items()}
    results["float"] = loss(ns.run)
    results["norm_spread"] = norm_spread(ns.run)
    print("| bits | setting | RTN delta | AWQ delta | AWQ below RTN |\n|---|---|---|---|---|")
    for bits in (int(b) for b in ns.bits.split(",")):
        for setting in ns.settings.split(","):
            row = {"bits": bits, "setting": setting}
            for method in ("rtn", "awq"):
                out = workdir / f"{method}{bits}{setting}"
                quantize(ns.run, out, method, bits, setting, ns)
                row[method] = loss(out)
                shutil.rmtree(out)
            results["rows"].append(row)
            r, a = (row[m] - results["float"] for m in ("rtn", "awq"))
            print(f"| {bits} | {setting} | {r:+.5f} | {a:+.5f} | {'yes' if a < r else 'no'} |")
    spread = results["norm_spread"]
    print(f"float loss {results['float']:.5f}; seq_len {cfg.data.seq_len}; norm scale max/median:")
    print(", ".join(f"{k} {v:.2f}" for k, v in spread.items()))
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
