"""The critic-free RL family at equal rollouts on the addition task of `grpo_addition.py`:
GRPO, Dr. GRPO, DAPO, GSPO, RLOO and REINFORCE++ (`train.objective`), each from the same SFT
model with the same prompts per step, completions per prompt, steps, learning rate and KL
weight, for each seed (`run.seed` and `data.seed`); DAPO's dynamic sampling alone samples
extra rounds where a group's rewards all agree, as the method does. It reports each run's held-out exact match
(greedy completions of prompts it never trained on), its sampled reward curve and its mean
completion length.

    python scripts/compare_rl.py OUT [--seeds 0 1] [--steps N] [--objectives grpo rloo ...]

writes the data and the SFT run as `grpo_addition.py` does (reusing them when present), then
OUT/before (the SFT model's held-out exact match: one step at learning rate 0),
OUT/<objective>_s<seed> per run, OUT/compare_rl.json (per run: the final `eval_reward`, the
sampled `reward` and `completions/mean_length` of every logged step) and OUT/compare_rl.png
(the sampled reward, averaged over seeds, per objective).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpo_addition as base

from jaxllm import config
from jaxllm.train.loop import train

OBJECTIVES = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_one(
    out: Path, objective: str, seed: int, steps: int, lr: float, name: str | None = None
) -> dict:
    """One run from OUT/sft (OUT/NAME, else OUT/<objective>_s<seed>); its summary."""
    run = out / (name or f"{objective}_s{seed}")
    overrides = [
        *base.MODEL,
        f"train.objective={objective}",
        f"checkpoint.init_from={out / 'sft'}",
        f"data.sources=[{{path: {out / 'add_train.jsonl'}, format: rollout}}]",
        f"data.eval_sources=[{{path: {out / 'add_test.jsonl'}, format: rollout}}]",
        f"train.steps={steps}",
        "train.global_batch_size=64",
        "train.num_generations=8",
        "train.max_completion_tokens=4",
        "train.beta=0.02",
        "train.reward=exact_match",
        f"train.eval_every={max(steps // 3, 1)}",
        "train.log_every=1",
        f"optim.lr={lr}",
        "optim.warmup_steps=0",
        "generate.kv_cache_dtype=float32",
        f"run.seed={seed}",
        f"data.seed={seed}",
        f"run.dir={run}",
    ]
    if not (run / "metrics.jsonl").exists():
        train(config.load(None, overrides))
    rows = _rows(run)
    logged = [r for r in rows if "reward" in r]
    return {
        "objective": objective,
        "seed": seed,
        "eval_reward": [r["eval_reward"] for r in rows if "eval_reward" in r][-1],
        "reward": [[r["step"], r["reward"]] for r in logged],
        "mean_length": [[r["step"], r["completions/mean_length"]] for r in logged],
    }


def plot(out: Path, results: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for objective in dict.fromkeys(r["objective"] for r in results):
        runs = [r["reward"] for r in results if r["objective"] == objective]
        steps = [s for s, _ in runs[0]]
        mean = [sum(run[i][1] for run in runs) / len(runs) for i in range(len(steps))]
        ax.plot(steps, mean, label=objective, alpha=0.8)
    ax.set_xlabel("step (equal rollouts)")
    ax.set_ylabel("sampled reward (mean over seeds)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out / "compare_rl.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    base.write_data(ns.out)
    if not (ns.out / "sft" / "checkpoints").exists():
        train(config.load(None, base.sft_overrides(ns.out, ns.sft_steps)))
    before = run_one(ns.out, "grpo", ns.seeds[0], 1, 0.0, name="before")["eval_reward"]
    print(f"held-out exact match of the SFT model: {before:.3f}")
    results = [
        run_one(ns.out, objective, seed, ns.steps, ns.lr)
        for objective in ns.objectives
        for seed in ns.seeds
    ]
    summary = {"sft_eval_reward": before, "sft_steps": ns.sft_steps, "runs": results}
    (ns.out / "compare_rl.json").write_text(json.dumps(summary, indent=1) + "\n")
    for r in results:
        last = r["mean_length"][-1][1]
        print(f"{r['objective']:>13} seed {r['seed']}: held-out exact match "
              f"{r['eval_reward']:.3f}, mean completion length at the end {last:.2f}")  # fmt: skip
    print(f"wrote {ns.out / 'compare_rl.json'} and {plot(ns.out, results)}")


if __name__ == "__main__":
    main()
