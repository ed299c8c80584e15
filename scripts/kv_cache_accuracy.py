"""Perplexity and greedy agreement of a trained run with each KV-cache dtype.

    python scripts/kv_cache_accuracy.py runs/default [--rows 16] [--length 256] [--prefix 16]

Held-out rows of the run's own data are scored teacher-forced through the cache
(`jaxllm.infer.score_with_cache`: prefill `--prefix` tokens, then one decode step per token), so
every prediction after the prefix attends over cached, possibly quantized, keys and values.
"""

from __future__ import annotations

import argparse

import numpy as np

import jaxllm
from jaxllm import config
from jaxllm.config import GenerateConfig
from jaxllm.data.pipeline import load_splits
from jaxllm.infer import score_with_cache
from jaxllm.infer.kv_cache import model_bytes_per_token


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--prefix", type=int, default=16)
    p.add_argument("--group", type=int, default=32, help="int4 / int2 group / residual window")
    ns = p.parse_args(argv)

    cfg = config.load(f"{ns.run_dir}/config.yaml")
    model = jaxllm.load_model(ns.run_dir)
    _, eval_rows = load_splits(cfg.data)
    tokens = np.stack([np.asarray(eval_rows[i]["inputs"])[: ns.length] for i in range(ns.rows)])
    m = cfg.model
    bf16_bytes = model_bytes_per_token(m, "bfloat16")
    print(f"{ns.rows} held-out rows x {tokens.shape[1]} tokens, prefix {ns.prefix}")
    print(
        f"{'cache':<9} {'bytes/token':>11} {'x bf16':>7} {'ppl':>9} {'vs bf16':>8} "
        f"{'greedy agree':>12}"
    )
    preds = {}
    ref = None
    for kind in ("bfloat16", "float32", "int8") + (() if m.mla.enabled else ("int4", "int2")):
        gen = GenerateConfig(kv_cache_dtype=kind, kv_group=ns.group)
        nll, preds[kind] = score_with_cache(model, tokens, gen, prefix=ns.prefix)
        ppl = float(np.exp(nll.mean()))
        ref = ref or ppl
        n = model_bytes_per_token(m, kind, ns.group)
        agree = float((preds[kind] == preds["bfloat16"]).mean())
        print(
            f"{kind:<9} {n:>11,} {n / bf16_bytes:>7.3f} {ppl:>9.4f} {ppl / ref - 1:>+8.3%} "
            f"{agree:>12.2%}"
        )


if __name__ == "__main__":
    main()
