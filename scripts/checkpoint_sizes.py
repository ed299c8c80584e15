"""Bytes of a checkpoint's training state with float and 8-bit optimizer moments
(`checkpoint.quantize_opt_state=int8`), and what resuming from the 8-bit ones does to the loss.

Each optimizer trains the same run twice to `--steps` with a checkpoint at the half: once
plainly, once with int8 moments, resumed from the half after its last checkpoint is removed.
Prints a markdown table: on-disk bytes of the half's `train` item, and the largest and final
loss difference after the resume. Usage:

    python scripts/checkpoint_sizes.py --steps 40 --out /tmp/ckpt_sizes [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from jaxllm import config
from jaxllm.train.loop import train


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--optims", default="adamw,lion,adafactor")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    half = a.steps // 2
    rows = []
    shutil.rmtree(a.out, ignore_errors=True)
    for name in a.optims.split(","):

        def run(tag, *extra, name=name):
            d = a.out / f"{name}_{tag}"
            keys = [f"optim.name={name}", f"train.steps={a.steps}", f"checkpoint.every={half}"]
            train(config.load(None, [*a.overrides, *keys, f"run.dir={d}", *extra]))
            return d

        plain = run("float")
        int8 = run("int8", "checkpoint.quantize_opt_state=int8")
        shutil.rmtree(int8 / "checkpoints" / str(a.steps))
        run("int8", "checkpoint.quantize_opt_state=int8")  # resumes from the 8-bit moments
        full = _bytes(plain / "checkpoints" / str(half) / "train")
        small = _bytes(int8 / "checkpoints" / str(half) / "train")
        ours, theirs = _losses(int8), _losses(plain)
        after = range(half + 1, a.steps + 1)
        worst = max(abs(ours[s] - theirs[s]) for s in after)
        rows.append(
            f"| {name} | {full:,} | {small:,} | {small / full:.2f} | {worst:.4f} | "
            f"{theirs[a.steps]:.4f} | {ours[a.steps]:.4f} |"
        )
    print(
        "| optim | train item, float (bytes) | int8 (bytes) | ratio | max abs loss diff "
        "after resume | final loss, float | final loss, int8 resume |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
