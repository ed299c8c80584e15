"""`jaxllm bench data`: throughput of the input pipeline alone, on the configured data, no model.

It loads the splits exactly as `jaxllm train` does, then pulls global batches from
`train_batches` (with `data.workers` Grain processes when set) as fast as it can. Tokens/s counts
every slot of a batch (B x L, what a train step consumes); `real_tokens_per_s` counts only
slots with loss_mask 1, so first-fit padding shows up as the gap between the two. Compare it with
the `tokens/s` of `jaxllm bench train`: the pipeline should be many times faster than the step.
"""

from __future__ import annotations

import time

import numpy as np

from jaxllm import config
from jaxllm.data.pipeline import load_splits, train_batches


def bench_data(
    cfg: config.Config, *, seconds: float | None = None, batches: int | None = None
) -> dict:
    """Times `train_batches` for `seconds` (default 10) or exactly `batches` batches, after a
    first batch (worker start-up) that is timed on its own."""
    if seconds is None and batches is None:
        seconds = 10.0
    b, l = cfg.train.global_batch_size, cfg.data.seq_len
    t0 = time.perf_counter()
    train_rows, _ = load_splits(cfg.data)
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    it = train_batches(train_rows, cfg.data, b)
    next(it)
    first_batch_s = time.perf_counter() - t0

    n, real = 0, 0
    t0 = time.perf_counter()
    try:
        while (batches is None or n < batches) and (
            seconds is None or time.perf_counter() - t0 < seconds
        ):
            real += int(np.sum(next(it)["loss_mask"]))
            n += 1
        elapsed = time.perf_counter() - t0
    finally:
        close = getattr(it, "close", None)  # stops Grain worker processes
        if close is not None:
            close()
    return {
        "sources": ", ".join(s.path for s in cfg.data.sources),
        "packing": cfg.data.packing,
        "workers": cfg.data.workers,
        "load_s": load_s,
        "first_batch_s": first_batch_s,
        "batches": n,
        "seconds": elapsed,
        "rows": len(train_rows),
        "docs": train_rows.num_docs,
        "tokens": train_rows.num_tokens,
        "batch_tokens": b * l,
        "tokens_per_s": n * b * l / elapsed,
        "real_tokens_per_s": real / elapsed,
    }


def format_data_result(r: dict) -> str:
    return "\n".join(
        [
            f"data                   {r['sources']} ({r['docs']:,} docs, {r['tokens']:,} tokens, "
            f"{r['rows']:,} rows)",
            f"packing / workers      {r['packing']} / {r['workers']}",
            f"load (read, tokenize)  {r['load_s']:.2f} s",
            f"first batch            {r['first_batch_s']:.2f} s",
            f"batches timed          {r['batches']} of {r['batch_tokens']:,} tokens in {r['seconds']:.2f} s",
            f"tokens/s               {r['tokens_per_s']:,.0f}",
            f"real tokens/s          {r['real_tokens_per_s']:,.0f}  (loss_mask 1)",
        ]
    )
