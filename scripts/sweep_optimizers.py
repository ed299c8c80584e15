"""The optimizer comparison of docs/experiments.md: for every `optim.name`, a three-value
learning-rate sweep of the default run (`jaxllm sweep`), then one table of each optimizer's best
run and one plot of their train-loss curves.

    python scripts/sweep_optimizers.py [--out runs/optimizers] [--only sgd,adamw] [key=value ...]

Overrides apply to every run (e.g. `train.steps=100`). Each optimizer's sweep lives in
`<out>/<name>/` (rerunning skips finished runs); the comparison is `<out>/results.md` and
`<out>/loss.png`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from jaxllm.cli import main as jaxllm

# name -> (learning rates, overrides). Rates bracket each optimizer's usual step size; the ones
# whose rate multiplies the raw gradient (sgd, adagrad, sm3) take coupled L2 decay through
# optax.add_decayed_weights, so they train without weight decay, as they usually do.
GRID: dict[str, tuple[list[str], list[str]]] = {
    "sgd": (["0.1", "0.3", "1.0"], ["optim.momentum=0.9", "optim.weight_decay=0"]),
    "adagrad": (["0.01", "0.03", "0.1"], ["optim.weight_decay=0"]),
    "rmsprop": (["3e-4", "1e-3", "3e-3"], []),
    "adam": (["1e-3", "3e-3", "1e-2"], []),
    "adamw": (["1e-3", "3e-3", "1e-2"], []),
    "adafactor": (["3e-3", "1e-2", "3e-2"], []),
    "lion": (["1e-4", "3e-4", "1e-3"], []),
    "lamb": (["3e-3", "1e-2", "3e-2"], []),
    "sm3": (["0.03", "0.1", "0.3"], ["optim.weight_decay=0"]),
    "muon": (["3e-3", "1e-2", "3e-2"], []),
    "adam_mini": (["1e-3", "3e-3", "1e-2"], []),
    "adamw_8bit": (["1e-3", "3e-3", "1e-2"], []),
    "soap": (["1e-3", "3e-3", "1e-2"], []),
    "shampoo": (["1e-3", "3e-3", "1e-2"], []),  # Adam-grafted: Adam's step sizes
    "came": (["1e-4", "3e-4", "1e-3"], []),
    "ldadam": (["1e-3", "3e-3", "1e-2"], []),
    "galore": (["3e-3", "1e-2", "3e-2"], []),
    "q_galore": (["3e-3", "1e-2", "3e-2"], []),
}


def _rows(out: Path) -> list[dict]:
    with (out / "results.csv").open() as f:
        return list(csv.DictReader(f))


def _curve(run_dir: Path) -> tuple[list[int], list[float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def best_runs(out: Path, names) -> list[dict]:
    """Each optimizer's run with the lowest final eval loss, and every eval loss it swept."""
    best = []
    for name in names:
        rows = _rows(out / name)
        losses = {r["run"]: float(r["eval_loss"] or math.inf) for r in rows}
        run = min(losses, key=losses.get)
        best.append({"name": name, "run": run, "eval_loss": losses[run], "swept": losses})
    return best


def report(out: Path, best: list[dict]) -> None:
    lines = [
        "| optimizer | best lr | eval loss | eval loss at each lr |",
        "|---|---|---|---|",
    ]
    for b in sorted(best, key=lambda b: b["eval_loss"]):
        swept = ", ".join(
            f"{run.split('=')[-1]}: {loss:.4f}"
            for run, loss in sorted(b["swept"].items(), key=lambda kv: float(kv[0].split("=")[-1]))
        )
        lr = b["run"].split("=")[-1]
        lines.append(f"| `{b['name']}` | {lr} | {b['eval_loss']:.4f} | {swept} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for b in best:
        steps, losses = _curve(out / b["name"] / b["run"])
        ax.plot(steps, losses, label=f"{b['name']} ({b['run']})")
    ax.set(xlabel="step", ylabel="train loss (nats/token)", ylim=(2.0, 4.0))
    ax.legend(fontsize=7)
    fig.savefig(out / "loss.png", dpi=120)


def run(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/optimizers"))
    p.add_argument("--only", default="", help="comma-separated optimizer names (default: all)")
    args, overrides = p.parse_known_args(argv)
    names = [n for n in args.only.split(",") if n] or list(GRID)
    for name in names:
        lrs, extra = GRID[name]
        grid = ["--grid", "optim.lr=" + ",".join(lrs)]
        code = jaxllm(
            [
                "sweep",
                f"optim.name={name}",
                *extra,
                *overrides,
                *grid,
                "--out",
                f"{args.out / name}",
            ]
        )
        if code:
            return code
    report(args.out, best_runs(args.out, names))
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
