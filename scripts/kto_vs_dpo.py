"""KTO against DPO on the same preferences, KTO given them unpaired: a small model, the same
steps, rows and learning rate, from the same SFT start, which is also the reference.

    python scripts/kto_vs_dpo.py OUT_DIR [--steps N] [--seeds 0,1] [--lr LR]

The task: a style preference that a small model can learn in tens of steps: each prompt has a
random word as its answer, in lowercase (chosen) or in uppercase (rejected); held-out pairs
have other words. The start is a next-token run on prompt + either answer (so it prefers
neither).
DPO trains on the pairs (`format: preference`); KTO on the same answers as separate records,
the lowercase one desirable and the uppercase one not (`format: unpaired_preference`, shuffled). Both
are measured the same way on held-out pairs: the share whose implicit reward margin
(pi_c - ref_c) - (pi_r - ref_r) is positive (DPO's `rewards/accuracies`) and the share where
the policy itself gives the chosen answer the higher log-probability. OUT_DIR gets the runs and
`kto_vs_dpo_nSTEPS.json`; a markdown table is printed. The mean held-out margin (in nats)
tells apart runs that both rank every pair right.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import jax
import numpy as np

import jaxllm
from jaxllm import config
from jaxllm.data.pipeline import load_splits
from jaxllm.objectives.base import pair_sums, token_logps
from jaxllm.train.loop import train

MODEL = [
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=4",
    "model.mlp_dim=256",
    "model.vocab_size=264",
    "model.max_seq_len=64",
    "model.dtype=float32",
    "data.seq_len=32",
    "mesh.data=1",
    "mesh.fsdp=-1",
    "train.sample_tokens=0",
    "train.log_every=5",
    "train.eval_every=0",
    "optim.warmup_steps=0",
]


def _write(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def make_data(out: Path, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    pairs = []
    for i in range(600):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(3, 7)))
        pairs.append({"prompt": f"say {i}:", "chosen": f" {word}", "rejected": f" {word.upper()}"})
    train_pairs, test_pairs = pairs[:500], pairs[500:]
    unpaired = [
        {"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
        for p in train_pairs
        for k in ("chosen", "rejected")
    ]
    rng.shuffle(unpaired)
    sft = [
        {"prompt": p["prompt"], "completion": p[k]} for p in pairs[:500] for k in p if k != "prompt"
    ]
    return {
        "pairs": _write(out / "pairs.jsonl", train_pairs),
        "test": _write(out / "pairs_test.jsonl", test_pairs),
        "unpaired": _write(out / "unpaired.jsonl", unpaired),
        "sft": _write(out / "sft.jsonl", sft),
    }


def held_out(run: Path, base: Path, test: str) -> dict:
    """Held-out pair accuracies of `run` against the reference `base`."""
    src = config.SourceConfig(path=test, format="preference")
    rows = load_splits(config.DataConfig(sources=(src,), eval_sources=(src,), seq_len=32))[0]
    batch = {k: np.stack([rows[i][k] for i in range(len(rows))]) for k in rows[0]}
    sums = []
    for where in (run, base):
        model = jaxllm.load_model(where)
        logp, _ = jax.jit(lambda b, m=model: token_logps(m, b))(batch)
        sums.append(pair_sums(logp, batch["segment_ids"]))
    (pi_c, pi_r, valid), (ref_c, ref_r, _) = sums
    valid = np.asarray(valid)
    margin = np.asarray((pi_c - ref_c) - (pi_r - ref_r))[valid]
    direct = np.asarray(pi_c - pi_r)[valid]
    return {
        "pairs": int(valid.sum()),
        "reward_acc": float(np.mean(margin > 0)),
        "policy_acc": float(np.mean(direct > 0)),
        "margin": float(np.mean(margin)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--lr", type=float, default=5e-3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = make_data(args.out)
    base = args.out / "base"
    if not (base / "checkpoints").exists():
        src = f"[{{path: {data['sft']}, format: prompt_completion}}]"
        overrides = [*MODEL, f"data.sources={src}", "train.objective=sft", "train.steps=60"]
        overrides += ["optim.lr=3e-3", "train.global_batch_size=32", "checkpoint.save_final=true"]
        train(config.load(None, [*overrides, f"run.dir={base}", "data.eval_fraction=0"]))
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for method, fmt, key in (
            ("dpo", "preference", "pairs"),
            ("kto", "unpaired_preference", "unpaired"),
        ):
            run = args.out / f"{method}_s{seed}_n{args.steps}"
            src = f"[{{path: {data[key]}, format: {fmt}}}]"
            overrides = [*MODEL, f"data.sources={src}", f"train.objective={method}"]
            overrides += ["train.beta=0.1", f"optim.lr={args.lr}", "train.global_batch_size=16"]
            overrides += [f"train.steps={args.steps}", f"checkpoint.init_from={base}"]
            overrides += ["checkpoint.save_final=true", f"run.seed={seed}", f"data.seed={seed}"]
            overrides += ["data.eval_fraction=0"]
            start = time.time()
            train(config.load(None, [*overrides, f"run.dir={run}"]))
            last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
            row = {"method": method, "seed": seed, "train_s": round(time.time() - start, 1)}
            row |= {"train_loss": last["loss"], **held_out(run, base, data["test"])}
            results.append(row)
            print(row, flush=True)
    (args.out / f"kto_vs_dpo_n{args.steps}.json").write_text(json.dumps(results, indent=1))
    print(
        "| method | seed | held-out reward accuracy | policy prefers chosen | mean margin | loss |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['method']} | {r['seed']} | {r['reward_acc']:.3f} | {r['policy_acc']:.3f} "
            f"| {r['margin']:.2f} | {r['train_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
