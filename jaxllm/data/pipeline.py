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
    if [src.path for src in cfg.sources] != ["stdlib"]:
        raise ValueError(f"unsupported data.sources {cfg.sources!r}")
    train_files, eval_files = split_files(stdlib_files(cfg.max_files), cfg.eval_fraction)

    def rows(files):
        docs = (tok.encode(p.read_bytes()) for p in files)
        return PackedRows(docs, cfg.seq_len, bos_id=tok.bos_id, eos_id=tok.eos_id)

    return rows(train_files), rows(eval_files)


def _local_rows(ds: grain.MapDataset, batch_size: int, rows: slice | None) -> grain.MapDataset:
    """Global batch b is rows [b*B, (b+1)*B) of `ds`; this process reads only `rows` of it."""
    if rows is None or (rows.start in (0, None) and rows.stop in (batch_size, None)):
        return ds.batch(batch_size, drop_remainder=True)
    start, stop = rows.start, rows.stop

    def local_batch(b: int) -> dict:
        items = [ds[b * batch_size + r] for r in range(start, stop)]
        return {k: np.stack([it[k] for it in items]) for k in items[0]}

    return grain.MapDataset.range(len(ds) // batch_size).map(local_batch)


def train_batches(
    rows: PackedRows, cfg: DataConfig, batch_size: int, local: slice | None = None
) -> Iterator[dict]:
    """Endless shuffled global batches of `batch_size` rows, a new permutation every epoch
    (fixed by `data.seed`); each process gets only its `local` rows of every batch."""
    ds = grain.MapDataset.source(rows).shuffle(seed=cfg.seed).repeat()
    return iter(_local_rows(ds, batch_size, local).to_iter_dataset())


def eval_batches(
    rows: PackedRows, batch_size: int, num_batches: int, local: slice | None = None
) -> list[dict]:
    """The same first `num_batches` batches of the held-out rows at every evaluation."""
    n = min(num_batches * batch_size, len(rows) - len(rows) % batch_size)
    if n == 0:
        raise ValueError(
            f"the eval split has {len(rows)} rows, fewer than one batch of {batch_size}"
        )
    batches = _local_rows(grain.MapDataset.source(rows)[:n], batch_size, local)
    return [{k: np.asarray(v) for k, v in batches[i].items()} for i in range(len(batches))]
