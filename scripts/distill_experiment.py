"""A small student distilled from a teacher, against the same student trained from scratch:
the preset configs/runs/distill.yaml (half the default model's width and depth, the default
run's data) once per distillation loss, and once with `train.objective=next_token`, for the
same steps from the same initialisation on the same batches.

    python scripts/distill_experiment.py TEACHER OUT.md [--runs runs/distill_experiment]
        [--losses forward_kl,reverse_kl,jsd] [--steps N] [--quick] [key=value ...]

TEACHER is a run directory (the default run, `jaxllm train` first), a checkpoint step, or a
Hugging Face directory sharing the student's vocabulary. Per run: parameters, the median step
time of its metrics.jsonl, the final train cross-entropy (the distilled runs' `nll` metric,
beside their divergence), and the cross-entropy on the held-out split evaluated afterwards the
same way for every run and for the teacher (`jaxllm.evaluate` with the next-token objective,
the same batches). OUT.md gets a markdown table, OUT.json (beside it) every number. Overrides
apply to every run; `--quick` proves the pipeline in a minute (5 steps, one eval batch). Each
run lives in `<runs>/<name>/`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs/runs/distill.yaml"
LOSSES = ("forward_kl", "reverse_kl", "jsd")
JAX_NOTE = "For simplicity, JAX has removed"  # the line jax prints after a traceback
# What evaluates any of the runs as a language model: the next-token objective, with the
# distillation settings back at their defaults (they would do nothing, so they are refused).
AS_LM = [
    "train.objective=next_token",
    "train.teacher=null",
    "train.distill_loss=forward_kl",
    "train.distill_temperature=1.0",
    "train.distill_jsd_beta=0.5",
    "train.distill_weight=1.0",
]


def _metrics(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[1:] if "step_time_s" in r]  # the first has warm-up
    last = rows[-1]
    return {
        "steps": last["step"],
        "step_ms": 1e3 * statistics.median(times) if times else None,
        # a distilled run logs its cross-entropy as `nll`, `loss` being the divergence
        "train_ce": last.get("nll", last["loss"]),
        "train_divergence": last.get("distill"),
    }


def train(name: str, overrides: list[str], runs: Path) -> dict:
    """Trains one run; its numbers, or its error."""
    run = runs / name
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "jaxllm", "train", str(PRESET), *overrides, f"run.dir={run}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [
            x for x in proc.stderr.splitlines() if x.strip() and not x.startswith(JAX_NOTE)
        ] or ["(no output)"]
        return {"error": f"exit {proc.returncode}: {lines[-1][-300:]}"}
    return {"run": str(run), "train_s": time.perf_counter() - t0, **_metrics(run)}


def eval_ce(run, overrides: list[str], batches: int) -> dict:
    """{'eval_ce', 'params'}: the next-token cross-entropy of a run's newest weights on the
    held-out split of its data (with `overrides`), and its parameter count."""
    import jax

    from jaxllm import config
    from jaxllm.evaluate import evaluate_checkpoint
    from jaxllm.load import resolve
    from jaxllm.model import abstract_model

    r = evaluate_checkpoint(run, overrides, batches)
    cfg = config.load(resolve(run)[0] / "config.yaml", overrides)
    params = sum(x.size for x in jax.tree.leaves(abstract_model(cfg.model)[1]))
    return {"eval_ce": r["eval_loss"], "params": params}


def table(results: dict) -> str:
    lines = [
        "| run | parameters | ms/step | train CE | train divergence | eval CE |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | - | - | - | - |")
            continue

        def num(key, fmt):
            return "-" if r.get(key) is None else format(r[key], fmt)

        lines.append(
            f"| {name} | {num('params', ',')} | {num('step_ms', '.0f')} | {num('train_ce', '.3f')}"
            f" | {num('train_divergence', '.3f')} | {num('eval_ce', '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("teacher", help="run directory, checkpoint step or Hugging Face directory")
    p.add_argument("out", type=Path, help="the markdown table (OUT.json beside it)")
    p.add_argument("--runs", type=Path, default=Path("runs/distill_experiment"))
    p.add_argument("--losses", default="forward_kl", help="comma-separated: " + ",".join(LOSSES))
    p.add_argument("--steps", type=int, help="train.steps of every run (preset: 150)")
    p.add_argument("--quick", action="store_true", help="prove it works: 5 steps, 1 eval batch")
    ns, overrides = p.parse_known_args(argv)
    if any("=" not in o or o.startswith("-") for o in overrides):
        p.error(f"unrecognized arguments: {' '.join(overrides)}")
    losses = ns.losses.split(",")
    if unknown := set(losses) - set(LOSSES):
        p.error(f"--losses: unknown {sorted(unknown)}; known: {', '.join(LOSSES)}")
    teacher = Path(ns.teacher).resolve()
    steps = ns.steps or (5 if ns.quick else None)
    common = [f"train.teacher={teacher}", *([f"train.steps={steps}"] if steps else [])]
    common += ["train.eval_batches=1", "train.log_every=1", "train.eval_every=0"] * ns.quick
    common += overrides
    batches = 1 if ns.quick else 8
    runs = {"scratch": ["train.objective=next_token", "train.teacher=null"]}
    runs |= {f"distill_{loss}": [f"train.distill_loss={loss}"] for loss in losses}

    t0 = time.perf_counter()
    results = {}
    for name, extra in runs.items():
        r = train(name, [*common, *extra], ns.runs.resolve())
        if "error" not in r:
            r |= eval_ce(r["run"], AS_LM, batches)
        results[name] = r
        print(f"{name}: {json.dumps(r)}", flush=True)
    # the teacher on the same held-out batches (a run directory: its data is the default run's,
    # as the students'); a Hugging Face teacher has no run config to evaluate it with
    from jaxllm.config import ConfigError
    from jaxllm.load import resolve

    try:
        resolve(teacher)
    except ConfigError:
        print(f"{teacher} is not a run directory: no teacher row")
    else:
        data = [o for o in overrides if o.startswith("data.")]
        results["teacher"] = eval_ce(teacher, data, batches)
    text = table(results)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    summary = {
        "teacher": str(teacher),
        "overrides": common,
        "seconds": time.perf_counter() - t0,
        "runs": results,
    }
    ns.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(text, end="")
    print(f"wrote {ns.out} and {ns.out.with_suffix('.json')} in {summary['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
