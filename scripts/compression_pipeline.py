"""The three-stage pipeline, measured: a teacher trained, a smaller student distilled from it,
the student pruned and then quantized; each stage's size, quality and decode speed.

    python scripts/compression_pipeline.py [--workdir runs/compression_pipeline] [--steps 150]
        [--student-steps N] [--teacher RUN] [--prune channels] [--sparsity 0.5]
        [--quantize gptq] [--bits 4] [--group-size 32] [--samples 128] [--eval-batches 8]
        [--new-tokens 64] [--repeats 5] [--out docs/compression_pipeline.json]
        [--chart docs/compression_pipeline.png] [--teacher-set key=value ...]
        [--student-set key=value ...] [key=value ...]

Every stage is a `jaxllm` command, run in this process through `jaxllm.cli.main`:

1. teacher: `jaxllm train configs/runs/default.yaml` (4 layers, d_model 256, byte vocabulary,
   the standard library's sources) for `--steps` steps; `--teacher RUN` uses a trained run
   instead;
2. student: `jaxllm train configs/runs/distill.yaml train.teacher=TEACHER` (2 layers, d_model
   128, MLP 320, the same tokenizer and data; forward KL to the teacher's distributions) for
   `--student-steps` steps (default `--steps`);
3. pruned: `jaxllm prune STUDENT PRUNED --method channels --sparsity 0.5`: a structured method
   (`layers`, `heads`, `channels`, `slicegpt`) makes a smaller model, so the size drop shows in
   parameters and bytes (`magnitude`, `wanda`, `sparsegpt` only write zeros into a dense run);
   calibrated on `--samples` rows of the student's held-out split;
4. pruned+quantized: `jaxllm quantize PRUNED QUANTIZED --method gptq --bits 4 --group-size 32`
   (calibrated the same way).

Measured for each, as scripts/compression_table.py and scripts/pruning_table.py measure (their
helpers): parameters (the float model's, a quantized run's counted before packing); bytes on
disk of the params item of the newest checkpoint, and the weights' bytes in memory
(`jaxllm.compress.weight_bytes` for a quantized run); held-out perplexity exp(next-token NLL)
by `jaxllm eval`'s code (`jaxllm.evaluate.evaluate_checkpoint`) over the first
`--eval-batches` batches of the eval split, the same rows for every stage (all four share the
data config; the distilled runs are evaluated with the next-token objective); batch-1 decode
tokens/s, greedy, bf16 KV cache, the median of `--repeats` timed calls after one that compiles.

`key=value` overrides apply to both training runs, `--teacher-set` / `--student-set` to one
(model sizes, say). Writes the raw results as JSON (`--out`), a bar chart with one panel per
metric (`--chart`, needs matplotlib), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
from compression_table import (
    checkpoint_params_bytes,
    cpu_name,
    decode_speed,
    held_out,
    weights_in_memory,
)

import jaxllm
from jaxllm import config
from jaxllm.cli import main as jaxllm_main
from jaxllm.config.quantize import CALIBRATED
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.model.abstract import abstract_model

REPO = Path(__file__).resolve().parents[1]
TEACHER_PRESET = REPO / "configs/runs/default.yaml"
STUDENT_PRESET = REPO / "configs/runs/distill.yaml"
STAGES = ("teacher", "student", "pruned", "pruned+quantized")
# Any of the runs evaluated as a language model: the next-token objective, the distillation
# settings at their defaults (the student's and its descendants' config.yaml name a teacher).
AS_LM = [
    "train.objective=next_token",
    "train.teacher=null",
    "train.distill_loss=forward_kl",
    "train.distill_temperature=1.0",
    "train.distill_jsd_beta=0.5",
    "train.distill_weight=1.0",
]
# Training runs evaluate only here, afterwards, and print no sample at the end.
QUIET = ["train.eval_every=0", "train.sample_tokens=0"]


def jaxllm_cmd(args: list[str]) -> float:
    """Runs `jaxllm ARGS` in this process; its seconds. A failure stops the script."""
    print("+ jaxllm " + " ".join(args), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    code = jaxllm_main(args)
    if code != 0:
        sys.exit(f"jaxllm {args[0]} exited {code}")
    return time.perf_counter() - t0


def measure(run: Path, ns, prompt: list[int]) -> dict:
    """A stage's parameters, bytes, held-out perplexity and decode speed."""
    ev = evaluate_checkpoint(run, AS_LM, ns.eval_batches)
    cfg = config.load(run / "config.yaml", AS_LM)
    params = sum(x.size for x in jax.tree.leaves(abstract_model(cfg.model)[1]))
    model = jaxllm.load_model(run)
    return {
        "params": params,
        "checkpoint_params_bytes": checkpoint_params_bytes(run),
        "weights_bytes": weights_in_memory(run)["total"],
        "eval_loss": ev["eval_loss"],
        "perplexity": ev["perplexity"],
        "eval_tokens": ev["tokens"],
        **decode_speed(model, prompt, "bfloat16", ns.new_tokens, ns.repeats),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| stage | parameters | params on disk (KiB) | weights (KiB) | held-out PPL "
        "| decode tok/s | made in (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['params']:,} | {r['checkpoint_params_bytes'] / 1024:,.0f} | "
            f"{r['weights_bytes'] / 1024:,.0f} | {r['perplexity']:.3f} | "
            f"{r['tokens_per_s']:.1f} | {r['make_seconds']:.0f} |"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: Path, title: str) -> None:
    """One bar panel per metric, the stages on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("params", "parameters (M)", 1e-6, "{:.2f}"),
        ("checkpoint_params_bytes", "params on disk (MiB)", 2**-20, "{:.2f}"),
        ("perplexity", "held-out perplexity", 1, "{:.2f}"),
        ("tokens_per_s", "decode tokens/s (batch 1)", 1, "{:.0f}"),
    ]
    names = [r["stage"].replace("+", "+\n") for r in rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.4))
    for ax, (key, label, scale, fmt) in zip(axes, panels):
        values = [r[key] * scale for r in rows]
        bars = ax.bar(names, values, color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"])
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/compression_pipeline"))
    p.add_argument("--steps", type=int, default=150, help="the teacher's train.steps")
    p.add_argument("--student-steps", type=int, help="the student's (default: --steps)")
    p.add_argument("--teacher", type=Path, help="a trained run to use as the teacher")
    p.add_argument("--prune", default="channels", help="jaxllm prune --method")
    p.add_argument("--sparsity", default="0.5")
    p.add_argument("--quantize", default="gptq", help="jaxllm quantize --method")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=128, help="calibration rows")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="the JSON of raw results")
    p.add_argument("--chart", type=Path, help="the PNG bar chart")
    p.add_argument("--teacher-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--student-set", action="append", default=[], metavar="KEY=VALUE")
    ns, overrides = p.parse_known_args(argv)
    if any("=" not in o or o.startswith("-") for o in overrides):
        p.error(f"unrecognized arguments: {' '.join(overrides)}")
    work = ns.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    made = {}

    teacher = ns.teacher.resolve() if ns.teacher else work / "teacher"
    if ns.teacher:
        made["teacher"] = 0.0
    else:
        shutil.rmtree(teacher, ignore_errors=True)
        made["teacher"] = jaxllm_cmd(
            ["train", str(TEACHER_PRESET), f"run.dir={teacher}", f"train.steps={ns.steps}"]
            + [*QUIET, *overrides, *ns.teacher_set]
        )
    student = work / "student"
    shutil.rmtree(student, ignore_errors=True)
    made["student"] = jaxllm_cmd(
        ["train", str(STUDENT_PRESET), f"train.teacher={teacher}", f"run.dir={student}"]
        + [f"train.steps={ns.student_steps or ns.steps}", *QUIET, *overrides, *ns.student_set]
    )
    pruned = work / "pruned"
    made["pruned"] = jaxllm_cmd(
        ["prune", str(student), str(pruned), "--method", ns.prune, "--sparsity", ns.sparsity]
        + ["--overwrite"]
        + (["--samples", str(ns.samples)] if ns.prune != "magnitude" else [])
    )
    quantized = work / "pruned-quantized"
    made["pruned+quantized"] = jaxllm_cmd(
        ["quantize", str(pruned), str(quantized), "--method", ns.quantize]
        + ["--bits", str(ns.bits), "--group-size", str(ns.group_size)]
        + ["--overwrite"]
        + (["--samples", str(ns.samples)] if ns.quantize in CALIBRATED else [])
    )

    prompt, _ = held_out(teacher, SimpleNamespace(score_rows=1, prompt_len=ns.prompt_len))
    rows = []
    for stage, run in zip(STAGES, (teacher, student, pruned, quantized)):
        row = {"stage": stage, "run": str(run), "make_seconds": made[stage]}
        t0 = time.perf_counter()
        row |= measure(run, ns, prompt)
        rows.append(row | {"measure_seconds": time.perf_counter() - t0})
        print(f"{stage}: PPL {rows[-1]['perplexity']:.3f}", file=sys.stderr, flush=True)
    results = {
        "command": "python scripts/compression_pipeline.py " + " ".join(argv or sys.argv[1:]),
        "device": f"{cpu_name()}, {jax.device_count()} {jax.default_backend()} device(s)",
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "jax": jax.__version__,
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "settings": {k: str(v) for k, v in vars(ns).items()} | {"overrides": overrides},
        "seconds": time.time() - started,
        "rows": rows,
    }
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=1) + "\n")
    if ns.chart:
        title = (
            f"teacher → distilled student → {ns.prune} {ns.sparsity} → {ns.quantize} "
            f"{ns.bits}-bit ({results['device']}, {results['date'][:10]})"
        )
        chart(rows, ns.chart, title)
    print(table(rows))
    return results


if __name__ == "__main__":
    main()
