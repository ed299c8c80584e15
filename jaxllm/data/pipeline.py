"""Grain pipelines of global batches for training and evaluation."""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from jaxllm.config import DataConfig
from jaxllm.data.packing import PackedRows
from jaxllm.data.stdlib import split_files, stdlib_files
from jaxllm.data.tokenizer import make_tokenizer


def load_splits(cfg: DataConfig) -> tuple[PackedRows, PackedRows]:
    """(train rows, eval rows) of the configured source."""
    tok = make_tokenizer(cfg)
    if cfg.source != "stdlib":
        raise ValueError(f"unknown data.source {cfg.source!r}")
    train_files, eval_files = split_files(stdlib_files(cfg.max_files), cfg.eval_fraction)

    def rows(files):
        docs = (tok.encode(p.read_bytes()) for p in files)
        return PackedRows(docs, cfg.seq_len, bos_id=tok.bos_id, eos_id=tok.eos_id)

    return rows(train_files), rows(eval_files)


def train_batches(rows: PackedRows, cfg: DataConfig, batch_size: int) -> Iterator[dict]:
    """Endless shuffled batches; a new permutation every epoch, fixed by `data.seed`."""
    ds = grain.MapDataset.source(rows).shuffle(seed=cfg.seed).repeat().batch(batch_size)
    return iter(ds.to_iter_dataset())


def eval_batches(rows: PackedRows, batch_size: int, num_batches: int) -> list[dict]:
    """The same first `num_batches` batches of the held-out rows at every evaluation."""
    n = min(num_batches * batch_size, len(rows) - len(rows) % batch_size)
    if n == 0:
        raise ValueError(
            f"the eval split has {len(rows)} rows, fewer than one batch of {batch_size}"
        )
    batches = grain.MapDataset.source(rows)[:n].batch(batch_size, drop_remainder=True)
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]
