"""Two fine-tunes of one base on different skills, and their merges, each measured on both skills.

    python scripts/merge_demo.py OUT_DIR [--base-steps N] [--steps N]

Skill `code`: the built-in corpus (the standard library's Python sources), its held-out split.
Skill `arith`: generated lines like "add 17 and 25: 42." (train and held-out files written into
OUT_DIR, disjoint number pairs). The base trains on `code` for --base-steps; fine-tune A
continues it on `code`, fine-tune B on `arith`, for --steps each at a third of the base's
learning rate. Then `jaxllm merge` with every method (`--weights 1,1` for the task-vector
ones, density 0.5), and the held-out cross-entropy (nats/token, `jaxllm.evaluate`, the same
batches for every model) of each model on each skill. Prints a markdown table; OUT_DIR/results.json holds every number.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from jaxllm.cli import main
from jaxllm.evaluate import evaluate_checkpoint

MODEL = [
    "data.max_files=200",
    "data.seq_len=128",
    "model.num_layers=2",
    "model.d_model=128",
    "model.mlp_dim=256",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=16",
    "train.sample_tokens=0",
    "train.log_every=50",
    "train.eval_every=0",
    "optim.lr=3e-3",
]
MERGES = {
    "linear": [],
    "task_arithmetic": ["--weights", "1,1"],
    "ties": ["--weights", "1,1", "--density", "0.5"],
    "dare_linear": ["--weights", "1,1", "--density", "0.5"],
    "dare_ties": ["--weights", "1,1", "--density", "0.5"],
}
EVAL_BATCHES = 8
FT_LR = 1e-3  # the fine-tunes' learning rate, a third of the base's: they stay near it


def arith_files(out: Path) -> tuple[Path, Path]:
    """Train / held-out text files of addition lines over disjoint number pairs."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(0).shuffle(pairs)
    files = []
    for name, chunk in (("arith_train.txt", pairs[:8000]), ("arith_valid.txt", pairs[8000:])):
        f = out / name
        f.write_text("".join(f"add {a} and {b}: {a + b}.\n" for a, b in chunk))
        files.append(f)
    return files[0], files[1]


def train(run: Path, steps: int, extra: list[str]) -> Path:
    argv = ["train", *MODEL, f"train.steps={steps}", f"checkpoint.every={steps}", *extra]
    assert main([*argv, f"run.dir={run}"]) == 0, run
    return run


def measure(run: Path, skills: dict[str, list[str]]) -> dict[str, float]:
    return {
        name: evaluate_checkpoint(run, over, num_batches=EVAL_BATCHES)["eval_loss"]
        for name, over in skills.items()
    }


def run_demo(out: Path, base_steps: int, steps: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    a_train, a_valid = arith_files(out)
    arith = [f"data.sources=[{{path: {a_train}}}]", f"data.eval_sources=[{{path: {a_valid}}}]"]
    # Each skill's data named outright: a run's own config.yaml names the data it trained on.
    code = ["data.sources=[{path: stdlib}]", "data.eval_sources=[]", "data.seed=0"]
    skills = {"code": code, "arith": arith}
    base = train(out / "base", base_steps, [])
    runs = {"base": base}
    start = [f"checkpoint.init_from={base}", f"optim.lr={FT_LR}"]
    runs["A (code)"] = train(out / "ft_code", steps, [*start, "data.seed=1"])
    runs["B (arith)"] = train(out / "ft_arith", steps, [*start, *arith])
    for method, opts in MERGES.items():
        merged = out / f"merge_{method}"
        argv = ["merge", str(merged), "--method", method, str(runs["A (code)"])]
        argv += [str(runs["B (arith)"]), *opts, "--overwrite"]
        if method != "linear":
            argv += ["--base", str(base)]
        assert main(argv) == 0, method
        runs[f"merge {method}"] = merged
    return {name: measure(run, skills) for name, run in runs.items()}


def table(results: dict) -> str:
    lines = ["| model | code (held-out CE) | arith (held-out CE) |", "| --- | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['code']:.3f} | {r['arith']:.3f} |")
    return "\n".join(lines)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=150)
    ns = ap.parse_args()
    results = run_demo(ns.out, ns.base_steps, ns.steps)
    (ns.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    cli()
