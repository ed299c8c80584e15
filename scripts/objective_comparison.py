"""The three pretraining styles on the same corpus and compute: a causal LM (GPT), a masked LM
(BERT) and span corruption (T5), each trained by `jaxllm train` for the same steps on the same
batches of byte-tokenized standard-library sources, then measured two ways. The masked LM runs
twice: with the causal LM's blocks made bidirectional (only the objective differs), and as
configs/runs/mlm.yaml's BERT (post-LayerNorm, learned positions, MLM head).

    python scripts/objective_comparison.py OUT.md [--runs runs/objectives] [--steps 150]
        [--probe 400] [--quick] [key=value ...]

1. Each style's own held-out loss, as it trains: nats per predicted token, but the tokens
   differ (every next byte; the 15% selected bytes; the sentinels and the bytes of the hidden
   spans), so these numbers are not comparable with each other.
2. One common probe, fill in the blank: a held-out row (256 bytes) with 4 consecutive bytes
   blanked out at a random place in its middle half, and 4 candidates for the blank, the true
   bytes and 3 spans of 4 bytes from other held-out rows. Each model picks the candidate it
   scores highest in its own way (chance: 25%):
   - causal: the log-likelihood of the whole row with the candidate in place (the candidate's
     bytes and every byte after it, which is how a left-to-right model sees the right context);
   - masked: the blank as 4 mask tokens, the sum of the candidate's log-probs at those places;
   - span corruption: the blank as sentinel 0 in the encoder input, the log-prob of the target
     `<s0> candidate <s1> EOS` (the format it was trained on).
The same rows, blanks and candidates for all three. OUT.md gets the table, OUT.json every
number. Overrides apply to every run; `--quick` proves the pipeline in a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import config
from jaxllm.data.mlm import mask_token_id
from jaxllm.data.pipeline import load_splits
from jaxllm.data.span_corruption import sentinel_start_id
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.load import restore

REPO = Path(__file__).resolve().parents[1]
# "masked LM, causal LM's blocks" is the default model made bidirectional (pre-RMSNorm, RoPE,
# SwiGLU, lr 3e-3), so that against the causal LM only the objective changes; "masked LM (BERT)"
# is configs/runs/mlm.yaml, BERT's parts.
SAME_BLOCKS = ["model.kind=encoder", "train.objective=mlm"]
STYLES = {  # name -> (run directory, preset, its own overrides, what its loss is per)
    "causal LM": ("causal_LM", None, [], "next byte"),
    "masked LM, causal LM's blocks": ("masked_same_blocks", None, SAME_BLOCKS, "selected byte"),
    "masked LM (BERT)": ("masked_LM", REPO / "configs/runs/mlm.yaml", [], "selected byte"),
    "span corruption": (
        "span_corruption",
        REPO / "configs/runs/span_corruption.yaml",
        [],
        "target token",
    ),
}
SPAN, CHOICES = 4, 4


def train(run: Path, preset: Path | None, overrides: list[str]) -> Path:
    cmd = [sys.executable, "-m", "jaxllm", "train"] + ([str(preset)] if preset else [])
    cmd += [f"run.dir={run}", 'train.sample_prompt=""', *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    return run


def run_numbers(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[1:] if "step_time_s" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return {
        "steps": max(r["step"] for r in rows),
        "step_ms": 1e3 * statistics.median(times) if times else None,
        "train_loss": [r for r in rows if "loss" in r][-1]["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
    }


def probe_items(data_cfg, n: int, seed: int = 0):
    """(rows [n, L], blank starts [n], candidates [n, CHOICES, SPAN], answer index [n])."""
    held = load_splits(data_cfg)[1]
    n = min(n, len(held))
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(held), size=n, replace=False)
    rows = np.stack([held[int(i)]["inputs"] for i in pick])
    length = rows.shape[1]
    starts = rng.integers(length // 4, 3 * length // 4, size=n)
    cands = np.empty((n, CHOICES, SPAN), np.int32)
    answer = rng.integers(0, CHOICES, size=n)
    for i in range(n):
        others = [j for j in rng.permutation(n) if j != i][: CHOICES - 1]
        spans = [rows[j, s : s + SPAN] for j, s in zip(others, rng.integers(0, length - SPAN, 3))]
        spans.insert(int(answer[i]), rows[i, starts[i] : starts[i] + SPAN])
        cands[i] = np.stack(spans)
    return rows, starts, cands, answer


def _logp(logits_BxLxV, targets_BxL):
    logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]


def score_causal(model, rows, starts, cands):
    n, length = rows.shape
    seqs = np.repeat(rows[:, None], CHOICES, axis=1).copy()
    for i in range(n):
        seqs[i, :, starts[i] : starts[i] + SPAN] = cands[i]
    seqs = seqs.reshape(n * CHOICES, length)
    fwd = jax.jit(lambda t: _logp(model(t[:, :-1]).logits, t[:, 1:]))
    logp = np.concatenate([np.asarray(fwd(seqs[k : k + 64])) for k in range(0, len(seqs), 64)])
    after = np.arange(1, length)[None] >= np.repeat(starts, CHOICES)[:, None]
    return (logp * after).sum(axis=1).reshape(n, CHOICES)


def score_masked(model, rows, starts, cands, mask_id):
    masked = rows.copy()
    for i in range(len(rows)):
        masked[i, starts[i] : starts[i] + SPAN] = mask_id
    fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t).logits.astype(jnp.float32), axis=-1))
    scores = []
    for k in range(0, len(rows), 32):
        logp = np.asarray(fwd(masked[k : k + 32]))
        for i in range(k, min(k + 32, len(rows))):
            at = logp[i - k, starts[i] + np.arange(SPAN)]  # [SPAN, V]
            scores.append([at[np.arange(SPAN), c].sum() for c in cands[i]])
    return np.asarray(scores)


def score_span(model, rows, starts, cands, sentinel, eos, pad, enc_len):
    n = len(rows)
    enc = np.full((n, enc_len), pad, np.int32)
    seg = np.zeros((n, enc_len), np.int32)
    for i, (row, s) in enumerate(zip(rows, starts)):
        x = np.concatenate([row[:s], [sentinel], row[s + SPAN :], [eos]])[:enc_len]
        enc[i, : len(x)], seg[i, : len(x)] = x, 1
    targets = np.concatenate(
        [np.full((n, CHOICES, 1), sentinel), cands, np.full((n, CHOICES, 1), sentinel - 1)], -1
    )
    targets = np.concatenate([targets, np.full((n, CHOICES, 1), eos)], -1).astype(np.int32)
    dec_in = np.concatenate([np.full((n, CHOICES, 1), pad), targets[..., :-1]], -1)

    def fwd(e, s, d, t):
        out = model(e, d, segment_ids_BxS=s).logits
        return _logp(out, t)[:, 1:].sum(-1)  # the sentinel <s0> is given, not chosen

    fwd = jax.jit(fwd)
    rep = lambda a: np.repeat(a, CHOICES, axis=0)  # noqa: E731
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    out = [
        np.asarray(
            fwd(
                rep(enc[k : k + 16]),
                rep(seg[k : k + 16]),
                flat(dec_in[k : k + 16]),
                flat(targets[k : k + 16]),
            )
        )
        for k in range(0, n, 16)
    ]
    return np.concatenate(out).reshape(n, CHOICES)


def probe(name: str, run: Path, items) -> dict:
    restored = restore(run)
    cfg, model = restored.cfg, restored.model()
    rows, starts, cands, answer = items
    tok = make_tokenizer(cfg.data)
    if cfg.model.kind == "decoder":
        scores = score_causal(model, rows, starts, cands)
    elif cfg.model.kind == "encoder":
        scores = score_masked(
            model, rows, starts, cands, mask_token_id(tok, cfg.train.mask_token_id)
        )
    else:
        sc = cfg.data.span_corruption
        sentinel = sentinel_start_id(tok, cfg.model.vocab_size, sc.sentinel_start)
        scores = score_span(
            model, rows, starts, cands, sentinel, tok.eos_id, tok.pad_id, cfg.data.seq_len
        )
    total = sum(np.size(a) for a in jax.tree.leaves(restored.params))
    return {
        "params": int(total),
        "probe_accuracy": float((scores.argmax(axis=1) == answer).mean()),
        "probe_items": len(answer),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--runs", type=Path, default=REPO / "runs/objectives")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--probe", type=int, default=400, help="fill-in-the-blank items")
    ap.add_argument("--quick", action="store_true", help="5 steps, 1 eval batch, 32 items")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    steps, n_probe = (5, 32) if args.quick else (args.steps, args.probe)
    common = [f"train.steps={steps}", "train.global_batch_size=16", "data.seq_len=256"]
    common += ["train.eval_batches=1"] if args.quick else []
    common += args.overrides
    items = probe_items(config.load(None, common).data, n_probe)
    results = {}
    for name, (folder, preset, own, per) in STYLES.items():
        run = train(args.runs / folder, preset, own + common)
        results[name] = {"loss_per": per, **run_numbers(run), **probe(name, run, items)}
        print(name, results[name], flush=True)
    lines = [
        "| style | parameters | ms / step | held-out loss (nats per ...) | fill-in-the-blank "
        f"accuracy ({len(items[3])} items, chance 25%) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        step = "" if r["step_ms"] is None else f"{r['step_ms']:.0f}"
        loss = "" if r["eval_loss"] is None else f"{r['eval_loss']:.3f}"
        lines.append(
            f"| {name} | {r['params']:,} | {step} | {loss} ({r['loss_per']}) | "
            f"{r['probe_accuracy']:.3f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
