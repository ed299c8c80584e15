"""Gaussian-kernel vs dot-product (softmax) attention on the default run (docs/experiments.md):
three seeds each, equal steps, then one plot of the train-loss and gradient-norm curves and a
table of final losses and of how smooth each curve is.

    jaxllm sweep train.steps=60 train.log_every=1 train.eval_every=0 train.eval_batches=4 \
      train.sample_tokens=0 checkpoint.save_final=false \
      --grid model.attention_kernel=softmax,gaussian --grid run.seed=0,1,2 --out SWEEP
    python scripts/gaussian_attention_experiment.py SWEEP [--out docs/experiments_gaussian_attention]

Writes `<out>.png` and `<out>.jsonl` (the per-step loss and gradient norm of every run, what
the plot and the table are computed from) and prints the table as Markdown. Smoothness is
measured after warmup (`--from`): the mean |loss(t) - loss(t-1)| (every run sees the same
batches in the same order, since run.seed changes only the initialisation, so the data's share
of the jitter is common to both kernels), and the mean and largest gradient norm.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

KERNELS = ("softmax", "gaussian")


def read_runs(sweep: Path) -> list[dict]:
    runs = []
    for d in sorted(sweep.iterdir()):
        if not (d / "metrics.jsonl").exists() or "attention_kernel=" not in d.name:
            continue
        keys = dict(part.split("=") for part in d.name.split(","))
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        runs.append(
            dict(
                kernel=keys["attention_kernel"],
                seed=int(keys["seed"]),
                step=[r["step"] for r in train],
                loss=[r["loss"] for r in train],
                grad_norm=[r["grad_norm"] for r in train],
                eval_loss=evals[-1] if evals else None,
            )
        )
    return runs


def summary(run: dict, start: int) -> dict:
    step = np.asarray(run["step"])
    keep = step >= start
    loss, grad = np.asarray(run["loss"])[keep], np.asarray(run["grad_norm"])[keep]
    return dict(
        final=float(np.mean(run["loss"][-5:])),
        eval=run["eval_loss"],
        jitter=float(np.mean(np.abs(np.diff(loss)))),
        grad_mean=float(grad.mean()),
        grad_max=float(grad.max()),
    )


def table(runs: list[dict], start: int) -> str:
    lines = [
        "| kernel | seeds | train loss (last 5 steps) | eval loss | mean abs(loss step) "
        "| mean grad norm | max grad norm |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kernel in KERNELS:
        rows = [summary(r, start) for r in runs if r["kernel"] == kernel]
        if not rows:
            continue

        def cell(key, digits=3):
            values = [r[key] for r in rows if r[key] is not None]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"

        lines.append(
            f"| {kernel} | {len(rows)} | {cell('final')} | {cell('eval')} | {cell('jitter')} "
            f"| {cell('grad_mean')} | {cell('grad_max')} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, start: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_grad) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"softmax": "tab:blue", "gaussian": "tab:red"}
    for r in runs:
        label = f"{r['kernel']} seed {r['seed']}"
        ax_loss.plot(r["step"], r["loss"], color=colors[r["kernel"]], alpha=0.7, label=label)
        ax_grad.plot(r["step"], r["grad_norm"], color=colors[r["kernel"]], alpha=0.7)
    ax_loss.set(xlabel="step", ylabel="train loss (nats/token)", title="train loss")
    ax_grad.set(xlabel="step", ylabel="gradient norm", title="gradient norm", yscale="log")
    for ax in (ax_loss, ax_grad):
        ax.axvline(start, color="grey", lw=0.5, ls="--")
    ax_loss.legend(fontsize=7)
    fig.suptitle("Gaussian-kernel vs dot-product attention, default run, 3 seeds each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/experiments_gaussian_attention"))
    parser.add_argument("--from", dest="start", type=int, default=16, help="first step measured")
    args = parser.parse_args()
    runs = read_runs(args.sweep)
    with open(args.out.with_suffix(".jsonl"), "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
    plot(runs, args.out.with_suffix(".png"), args.start)
    print(table(runs, args.start))


if __name__ == "__main__":
    main()
