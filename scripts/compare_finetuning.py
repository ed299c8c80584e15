"""Full fine-tuning, LoRA at two ranks, QLoRA, bottleneck adapters and prompt tuning compared
on stdlib-qa: the preset configs/runs/sft_stdlib.yaml once per method, from the same base.

    python scripts/compare_finetuning.py OUT.md [--base runs/default] [--data runs/stdlib_qa]
        [--runs runs/compare_finetuning] [--only full,lora_r4] [--steps N] [--quick]
        [key=value ...]

Per method: trainable parameters and optimizer-state bytes (`jaxllm.plan`), the median step
time of its metrics.jsonl, the final train and eval loss, exact-match accuracy of greedy
replies on the held-out questions (test.jsonl) before (the base) and after, and the size on
disk of the final checkpoint's weights (`params`: the adapters or soft prompt alone under PEFT,
the whole model otherwise) and of the whole step. A method that fails is reported with its
error and skipped. OUT.md gets a markdown table, OUT.json (beside it) every number.

The base is the default run (`jaxllm train` first); the data is written by `jaxllm data
stdlib-qa` into --data when it has none. Overrides apply to every run. `--quick` proves the
pipeline in a few minutes: 5 steps (unless --steps), one eval batch, the first 32 test
questions. Each method's run lives in `<runs>/<method>/`; rerunning a finished one only
measures it again.
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
PRESET = REPO / "configs/runs/sft_stdlib.yaml"
# method -> overrides of the preset (LoRA rank 16 on every linear layer); full fine-tuning at
# the rate that trained the default model best on stdlib-qa in 300 steps
METHODS: dict[str, list[str]] = {
    "full": ["peft.method=none", "optim.lr=1e-3"],
    "lora_r4": ["peft.method=lora", "peft.rank=4", "peft.alpha=8"],
    "lora_r16": ["peft.method=lora", "peft.rank=16", "peft.alpha=32"],
    "qlora": ["peft.method=qlora", "peft.rank=16", "peft.alpha=32"],
    # Houlsby bottlenecks of 64 after every attention and MLP, at the preset's rate
    "adapter": ["peft.method=adapter", "peft.adapter_size=64"],
    "prompt": ["peft.method=prompt", "peft.num_virtual_tokens=20", "optim.lr=3e-2"],
}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _metrics(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[1:] if "step_time_s" in r]  # the first has warm-up
    return {
        "steps": max(r["step"] for r in rows),
        "step_ms": 1e3 * statistics.median(times) if times else None,
        "train_loss": next((r["loss"] for r in reversed(rows) if "loss" in r), None),
        "eval_loss": next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None),
    }


def _plan(run: Path) -> dict:
    import jax

    from jaxllm import config
    from jaxllm.plan import plan

    r = plan(config.load(run / "config.yaml"), jax.devices()[:1])
    return {"trainable": r["trainable"], "optimizer_bytes": r["bill"]["optimizer_state"]}


def _accuracy(run: Path, test, limit: int | None) -> float:
    from jaxllm.infer.cli import load_chat

    return load_chat(run).exact_match(test[:limit]).accuracy


def _checkpoint(run: Path) -> dict:
    steps = [p for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    last = max(steps, key=lambda p: int(p.name))
    return {"params_bytes": _size(last / "params"), "checkpoint_bytes": _size(last)}


def run_method(name: str, overrides: list[str], out: Path) -> dict:
    """Trains one method; the numbers of its run, or its error."""
    run = out / name
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "jaxllm", "train", str(PRESET), *overrides, f"run.dir={run}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.splitlines() if x.strip()] or ["(no output)"]
        return {"error": f"exit {proc.returncode}: {lines[-1][-300:]}"}
    return {"run": str(run), "train_s": time.perf_counter() - t0, **_metrics(run)}


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(results: dict, before: float) -> str:
    head = (
        "| method | trainable params | optimizer state | ms/step | train loss | eval loss | "
        "exact match before → after | weights on disk | checkpoint on disk |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed (below) |" + " - |" * 7)
            continue
        acc = f"{before:.3f} → {_num(r.get('accuracy'), '.3f')}"
        lines.append(
            f"| {name} | {_num(r.get('trainable'), ',')} | {_fmt_bytes(r.get('optimizer_bytes'))} "
            f"| {_num(r.get('step_ms'), '.0f')} | {_num(r.get('train_loss'), '.3f')} "
            f"| {_num(r.get('eval_loss'), '.3f')} | {acc} | {_fmt_bytes(r.get('params_bytes'))} "
            f"| {_fmt_bytes(r.get('checkpoint_bytes'))} |"
        )
    notes = [
        f"- {name}: {err}"
        for name, r in results.items()
        for err in ([r["error"]] if "error" in r else r.get("errors", []))
    ]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the markdown table (OUT.json beside it)")
    p.add_argument("--base", default="runs/default", help="the run fine-tuned (init_from)")
    p.add_argument("--data", type=Path, default=Path("runs/stdlib_qa"), help="stdlib-qa dir")
    p.add_argument("--runs", type=Path, default=Path("runs/compare_finetuning"))
    p.add_argument("--only", help="comma-separated methods: " + ",".join(METHODS))
    p.add_argument("--steps", type=int, help="train.steps of every run (preset: 300)")
    p.add_argument("--quick", action="store_true", help="prove it works: 5 steps, 32 questions")
    ns, overrides = p.parse_known_args(argv)
    if any("=" not in o or o.startswith("-") for o in overrides):
        p.error(f"unrecognized arguments: {' '.join(overrides)}")
    methods = ns.only.split(",") if ns.only else list(METHODS)
    if unknown := set(methods) - set(METHODS):
        p.error(f"--only: unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    if not (Path(ns.base) / "config.yaml").is_file():
        p.error(f"--base {ns.base} is not a run directory; train it first (`jaxllm train`)")

    from jaxllm.data.stdlib_qa import write_stdlib_qa
    from jaxllm.infer.chat import read_conversations

    if not (ns.data / "test.jsonl").is_file():
        write_stdlib_qa(ns.data)
    test = read_conversations(ns.data / "test.jsonl")
    limit = 32 if ns.quick else None
    common = [f"checkpoint.init_from={Path(ns.base).resolve()}"]
    for key, split in (("sources", "train"), ("eval_sources", "test")):
        common.append(
            f"data.{key}=[{{path: {(ns.data / f'{split}.jsonl').resolve()}, format: chat}}]"
        )
    steps = ns.steps or (5 if ns.quick else None)
    common += [f"train.steps={steps}"] if steps else []
    common += ["train.eval_batches=1", "train.log_every=1", "train.eval_every=0"] * ns.quick

    t0 = time.perf_counter()
    before = _accuracy(Path(ns.base), test, limit)
    print(f"base {ns.base}: exact match {before:.3f} on {len(test[:limit])} test questions")
    results = {}
    for name in methods:
        r = run_method(name, [*common, *METHODS[name], *overrides], ns.runs.resolve())
        if "error" not in r:
            run = Path(r["run"])
            for part in (_plan, _checkpoint, lambda run: {"accuracy": _accuracy(run, test, limit)}):
                try:
                    r |= part(run)
                except Exception as e:  # noqa: BLE001 -- a method's failure is its row's
                    r.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:300])
        results[name] = r
        print(f"{name}: {json.dumps(r)}", flush=True)
    text = table(results, before)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    summary = {
        "base": ns.base,
        "data": str(ns.data),
        "test_questions": len(test[:limit]),
        "accuracy_before": before,
        "overrides": [*common, *overrides],
        "seconds": time.perf_counter() - t0,
        "methods": results,
    }
    ns.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(text, end="")
    print(f"wrote {ns.out} and {ns.out.with_suffix('.json')} in {summary['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
