"""The gradient-compression comparison of docs/experiments.md: the tiny default run on two
data replicas with each `train.grad_compression` against the all-reduce, losses at equal steps
and the bytes each replica sends per step (`jaxllm.plan.grad_exchange`).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python scripts/grad_compression_experiment.py [--out runs/grad_compression] [key=value ...]

Each run lives in `<out>/<name>/` (a finished one is not run again); the table is
`<out>/results.md`, the plot `<out>/loss.png`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from jaxllm import config
from jaxllm.cli import main as jaxllm
from jaxllm.model import abstract_model
from jaxllm.plan import fmt_bytes, grad_exchange

BASE = [
    "model.d_model=128",
    "model.num_layers=2",
    "model.mlp_dim=320",
    "data.seq_len=128",
    "mesh.data=2",
    "train.steps=40",
    "train.eval_every=0",
    "train.eval_batches=4",
    "train.log_every=5",
    "train.sample_tokens=0",
    "checkpoint.save_final=false",
]
SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.3"]
# name -> overrides: the AdamW default against topk and qsgd; momentum SGD against dgc, which
# takes the momentum over from the optimizer.
RUNS = {
    "none": [],
    "topk": ["train.grad_compression=topk"],
    "qsgd": ["train.grad_compression=qsgd"],
    "tagc": ["train.grad_compression=tagc"],
    "sgd_none": SGD,
    "sgd_dgc": [*SGD, "train.grad_compression=dgc", "train.grad_compression_warmup=12"],
}


def _curve(run: Path) -> tuple[list[int], list[float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def _eval_loss(run: Path) -> float | None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None)


def run(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/grad_compression"))
    args, overrides = p.parse_known_args(argv)
    lines = [
        "| run | train loss (step 40) | eval loss | sent per replica per step |",
        "|---|---:|---:|---:|",
    ]
    for name, extra in RUNS.items():
        run_dir = args.out / name
        keys = [*BASE, *extra, *overrides]
        if not (run_dir / "metrics.jsonl").is_file():
            if jaxllm(["train", *keys, f"run.dir={run_dir}"]):
                return 1
        cfg = config.load(None, keys)
        params = abstract_model(cfg.model)[1]
        g = grad_exchange(cfg, params)
        dense = sum(x.size * 4 for x in jax.tree.leaves(params))
        sent = dense if g is None else g["sent"]
        loss = _curve(run_dir)[1][-1]
        ev = _eval_loss(run_dir)
        lines.append(
            f"| {name} | {loss:.4f} | {ev:.4f} | {fmt_bytes(sent)} ({sent / dense:.3f}x) |"
        )
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in RUNS:
        ax.plot(*_curve(args.out / name), label=name)
    ax.set(xlabel="step", ylabel="train loss (nats/token)")
    ax.legend(fontsize=8)
    fig.savefig(args.out / "loss.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
