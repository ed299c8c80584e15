"""The training cost of finished runs: tokens, FLOPs, seconds and projected GPU-hours.

    python scripts/train_cost.py RUN_DIR [RUN_DIR ...] [--mfu 0.4] [--device "NVIDIA H100"]

For each run directory (its config.yaml and metrics.jsonl):

- tokens = steps x train.global_batch_size x data.seq_len (every slot of every row, as the
  FLOPs count them);
- FLOPs = tokens x `jaxllm.metrics.flops_per_token` (6 x matmul parameters plus attention
  scores and values, forward and backward: the count `jaxllm bench` and `jaxllm plan` use);
- seconds = the train steps' wall time: the sum over logged windows of steps x `step_time_s`
  (compilation and evaluation are outside the windows);
- GPU-hours = FLOPs / (MFU x the device's dense bf16 peak, `jaxllm.metrics.PEAK_FLOPS`) / 3600,
  a projection at the stated MFU, not a measurement.

Prints a markdown table, the runs' sums in its last row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxllm import config as config_lib
from jaxllm.config import ConfigError
from jaxllm.metrics import PEAK_FLOPS, flops_per_token, param_counts, read_jsonl


def cost(run_dir: Path, mfu: float, peak: float) -> dict:
    """One run's row of the table; ConfigError when the directory is not a finished run."""
    metrics = run_dir / "metrics.jsonl"
    if not (run_dir / "config.yaml").is_file() or not metrics.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (config.yaml and metrics.jsonl).")
    cfg = config_lib.load(run_dir / "config.yaml")
    rows = [r for r in read_jsonl(metrics) if "step_time_s" in r]
    if not rows:
        raise ConfigError(f"{run_dir}/metrics.jsonl has no timed steps.")
    seconds, done = 0.0, 0
    for r in rows:
        seconds += (r["step"] - done) * r["step_time_s"]
        done = r["step"]
    tokens = done * cfg.train.global_batch_size * cfg.data.seq_len
    flops = tokens * flops_per_token(cfg.model, cfg.data.seq_len)["total"]
    return {
        "run": run_dir.name,
        "params": param_counts(cfg.model)["total"],
        "steps": done,
        "tokens": tokens,
        "flops": flops,
        "seconds": seconds,
        "gpu_hours": flops / (mfu * peak) / 3600,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| run | params | steps | tokens | FLOPs | CPU seconds (wall) | GPU-hours (projected) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['run']} | {r['params']:,} | {r['steps']} | {r['tokens']:,} | "
            f"{r['flops']:.3g} | {r['seconds']:.1f} | {r['gpu_hours']:.2e} |"
        )
    total = {k: sum(r[k] for r in results) for k in ("tokens", "flops", "seconds", "gpu_hours")}
    lines.append(
        f"| all {len(results)} runs | | | {total['tokens']:,} | {total['flops']:.3g} | "
        f"{total['seconds']:.1f} | {total['gpu_hours']:.2e} |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    p.add_argument("--device", default="NVIDIA H100", help="a key of jaxllm.metrics.PEAK_FLOPS")
    ns = p.parse_args(argv)
    if ns.device not in PEAK_FLOPS or not 0 < ns.mfu <= 1:
        p.error(f"--device must be one of {', '.join(PEAK_FLOPS)} and --mfu in (0, 1]")
    try:
        results = [cost(run, ns.mfu, PEAK_FLOPS[ns.device]) for run in ns.runs]
    except ConfigError as e:
        print(f"jaxllm: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(table(results))
    return results


if __name__ == "__main__":
    main()
