"""A vision-language model from a text run, on a CPU: shapes-vqa (`jaxllm data shapes`, with its
tokenizer), a short text run of the tiny model on its questions and answers without the images,
then image SFT from that run (`checkpoint.init_from`: the language model is the text run's, the
vision tower and merger start fresh), once with every weight trained and once with LoRA on both
towers (the language model's attention and `visual.all-linear`). It prints held-out exact match
(greedy reply == reference, `jaxllm eval --chat-exact-match`) per question kind: the majority
answer of each kind in the train split, the text run on the questions alone, the initial VLM
(one step at learning rate 0) and the two fine-tuned VLMs. The runs follow
configs/runs/vlm_shapes.yaml; the text run alone trains at 3e-3 (the image runs at the preset's
1e-3: at 3e-3 the image tokens collapse onto one vector, docs/experiments.md).

    python scripts/vlm_shapes.py OUT [--samples 1500] [--text-steps 150] [--steps 800]
                                  [--lora-lr 1e-3]

writes OUT/data (shapes-vqa and tokenizer/), OUT/text_data (the rows without images), the runs
OUT/text, OUT/before, OUT/full and OUT/lora, and OUT/results.json. A run already done is reused.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from jaxllm import config
from jaxllm.data.shapes_vqa import write_shapes_vqa
from jaxllm.infer.chat import read_conversations
from jaxllm.infer.cli import load_chat
from jaxllm.train.loop import train

PRESET = Path(__file__).resolve().parent.parent / "configs" / "runs" / "vlm_shapes.yaml"
LORA = [
    "peft.method=lora",
    "peft.rank=16",
    "peft.alpha=32",
    "peft.targets=[q_proj, k_proj, v_proj, o_proj, visual.all-linear]",
]


def write_data(out: Path, samples: int, seed: int = 0) -> list[dict]:
    """OUT/data (3 x 3 grids of 84 pixels: one merged image token per cell) and OUT/text_data
    (the same rows with the question alone); the test rows."""
    data, text = out / "data", out / "text_data"
    if not (data / "info.json").exists():
        write_shapes_vqa(data, samples, seed, grid=3, size=84)
    text.mkdir(exist_ok=True)
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()]
        with open(text / f"{split}.jsonl", "w") as f:
            for r in rows:
                user, answer = r["messages"][0]["content"][1]["text"], r["messages"][1]["content"]
                chat = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": chat, "kind": r["kind"]}) + "\n")
    return rows


def overrides(out: Path, name: str, data: str, steps: int) -> list[str]:
    return [
        f"run.dir={out / name}",
        f"data.tokenizer={out / 'data' / 'tokenizer' / 'tokenizer.json'}",
        f"data.sources=[{{path: {out / data / 'train.jsonl'}, format: chat}}]",
        f"data.eval_sources=[{{path: {out / data / 'test.jsonl'}, format: chat}}]",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
    ]


def run(out: Path, name: str, args: list[str]) -> float:
    """Trains OUT/NAME (the preset with `args`) unless it is done; its seconds."""
    if (out / name / "checkpoints").exists():
        return 0.0
    start = time.perf_counter()
    train(config.load(str(PRESET), args))
    return time.perf_counter() - start


def exact_match(run_dir: Path, test: Path, kinds: list[str]) -> dict[str, float]:
    """Held-out exact match of the run's greedy replies to `test`, overall and per kind."""
    score = load_chat(run_dir).exact_match(read_conversations(test))
    return _by_kind(score.correct, kinds)


def majority(train_rows: list[dict], test_rows: list[dict]) -> dict[str, float]:
    """Exact match of answering each kind's most common train answer."""
    answers = collections.defaultdict(collections.Counter)
    for r in train_rows:
        answers[r["kind"]][r["messages"][1]["content"]] += 1
    best = {k: c.most_common(1)[0][0] for k, c in answers.items()}
    correct = [best.get(r["kind"]) == r["messages"][1]["content"] for r in test_rows]
    return _by_kind(correct, [r["kind"] for r in test_rows])


def _by_kind(correct, kinds) -> dict[str, float]:
    out = {"all": sum(correct) / len(correct)}
    for kind in sorted(set(kinds)):
        hits = [c for c, k in zip(correct, kinds) if k == kind]
        out[kind] = sum(hits) / len(hits)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--samples", type=int, default=1500)
    p.add_argument("--text-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    ns = p.parse_args()
    out = ns.out
    out.mkdir(parents=True, exist_ok=True)
    test_rows = write_data(out, ns.samples)
    train_rows = [json.loads(x) for x in (out / "data" / "train.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in test_rows]
    text = ["model.vision=null", "checkpoint.init_from=null", "optim.lr=3e-3"]
    vlm = [f"checkpoint.init_from={out / 'text'}"]
    seconds = {
        "text": run(out, "text", [*overrides(out, "text", "text_data", ns.text_steps), *text]),
        "before": run(out, "before", [*overrides(out, "before", "data", 1), *vlm, "optim.lr=0"]),
        "full": run(out, "full", [*overrides(out, "full", "data", ns.steps), *vlm]),
        "lora": run(
            out,
            "lora",
            [*overrides(out, "lora", "data", ns.steps), *vlm, *LORA, f"optim.lr={ns.lora_lr}"],
        ),
    }
    results = {"majority": majority(train_rows, test_rows)}
    results["text"] = exact_match(out / "text", out / "text_data" / "test.jsonl", kinds)
    for name in ("before", "full", "lora"):
        results[name] = exact_match(out / name, out / "data" / "test.jsonl", kinds)
    (out / "results.json").write_text(json.dumps({"exact_match": results, "seconds": seconds}))
    columns = list(results["majority"])
    print("| model | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    print("train seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))


if __name__ == "__main__":
    main()
