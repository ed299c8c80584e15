"""False-positive and false-negative rates of `jaxllm lineage` on runs made here.

    python scripts/lineage_experiment.py OUT_DIR [--seeds 4] [--steps 30] [--tune-steps 15]
        [--lr 1e-3] [--json FILE]

For each of --seeds init seeds: a base run (the tiny model of the tests: 1 layer, d_model 32,
vocab 320; the built-in corpus) trained --steps from that seed, and a fine-tune of it
(`checkpoint.init_from`, another data order) trained --tune-steps more, both at --lr. Then every
(seed s, model m) pair is tested as `jaxllm lineage` tests it: A's side is seed s's rebuilt
init, B is m; m descends iff it grew from seed s. A false positive is a verdict "descends" on
another seed's model, a false negative a "does not" on its own. Rates are given for the verdict
(alpha 1e-3, both statistics, Bonferroni) and for each statistic alone at the same alpha, and
for the weights reference (A = seed s's trained base as it stands, B = the other models). Prints
a markdown table; --json writes every p-value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxllm import lineage
from jaxllm.cli import main
from jaxllm.load import load_model

MODEL = [
    "data.seq_len=32",
    "model.num_layers=1",
    "model.d_model=32",
    "model.mlp_dim=64",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.eval_every=0",
    "train.log_every=10",
    "optim.warmup_steps=0",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def train(out: Path, steps: int, lr: float, *extra: str) -> Path:
    if not (out / "config.yaml").exists():
        argv = ["train", *MODEL, f"optim.lr={lr}", f"train.steps={steps}"]
        argv += [f"checkpoint.every={steps}", *extra, f"run.dir={out}"]
        assert main(argv) == 0, out
    return out


def rates(pairs: list[dict], key: str, alpha: float) -> dict:
    pos = [p for p in pairs if p["related"]]
    neg = [p for p in pairs if not p["related"]]
    return {
        "fnr": sum(p[key] >= alpha for p in pos) / len(pos),
        "fpr": sum(p[key] < alpha for p in neg) / len(neg),
        "positives": len(pos),
        "negatives": len(neg),
    }


def run(out: Path, seeds: int, steps: int, tune_steps: int, lr: float) -> dict:
    models = {}
    for s in range(1, seeds + 1):
        base = train(out / f"base{s}", steps, lr, f"run.seed={s}")
        tune = [f"checkpoint.init_from={base}", f"data.seed={100 + s}"]
        models[f"tune{s}"] = (s, train(out / f"tune{s}", tune_steps, lr, *tune))
        models[f"base{s}"] = (s, base)
    cfg = lineage.describe(models["base1"][1]).model_cfg
    tokens = lineage.probe_tokens(cfg.vocab_size, cfg.max_seq_len)
    picked = lineage.matrix_tokens(cfg.vocab_size)
    prints = {n: lineage.fingerprint(load_model(p), tokens, picked) for n, (_, p) in models.items()}
    inits = {
        s: lineage.fingerprint(lineage.init_model(cfg, s), tokens, picked)
        for s in range(1, seeds + 1)
    }
    init_pairs, weight_pairs = [], []
    for s in range(1, seeds + 1):
        for name, (t, _) in models.items():
            r = lineage.compare(inits[s], prints[name])
            init_pairs.append({"a": f"init{s}", "b": name, "related": s == t, **r})
            if name != f"base{s}":
                r = lineage.compare(prints[f"base{s}"], prints[name])
                weight_pairs.append({"a": f"base{s}", "b": name, "related": s == t, **r})
    a = lineage.ALPHA
    return {
        "setup": {"seeds": seeds, "steps": steps, "tune_steps": tune_steps, "lr": lr, "alpha": a},
        "init": {k: rates(init_pairs, k, a) for k in ("p_value", "bias_p", "copreference_p")},
        "weights": {k: rates(weight_pairs, k, a) for k in ("p_value", "bias_p", "copreference_p")},
        "pairs": {"init": init_pairs, "weights": weight_pairs},
    }


def table(res: dict) -> str:
    rows = ["| reference | statistic | FPR | FNR |", "|---|---|---:|---:|"]
    names = {"p_value": "verdict (both)", "bias_p": "token bias", "copreference_p": "co-preference"}
    for ref in ("init", "weights"):
        for key, name in names.items():
            r = res[ref][key]
            rows.append(
                f"| {ref} | {name} | {r['fpr']:.2f} ({round(r['fpr'] * r['negatives'])}/"
                f"{r['negatives']}) | {r['fnr']:.2f} ({round(r['fnr'] * r['positives'])}/"
                f"{r['positives']}) |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tune-steps", type=int, default=15)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    res = run(ns.out, ns.seeds, ns.steps, ns.tune_steps, ns.lr)
    print(table(res))
    if ns.json:
        ns.json.write_text(json.dumps(res, indent=1) + "\n")
