"""Concatenate-and-split packing of tokenized documents into fixed-length rows.

Documents (each wrapped in BOS ... EOS) are laid end to end in one stream and cut into rows of
L + 1 tokens that overlap by one (inputs = row[:-1], targets = row[1:]). A document longer than a
row is split across rows, never dropped; each piece restarts its positions at 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PackedRows:
    """Random access to packed rows of a token stream (a Grain-compatible data source)."""

    def __init__(self, docs: Iterable[np.ndarray], seq_len: int, *, bos_id: int, eos_id: int):
        pieces, ids = [], []
        for i, doc in enumerate(docs):
            pieces.append(np.concatenate([[bos_id], doc, [eos_id]]).astype(np.int32))
            ids.append(np.full(len(doc) + 2, i, np.int32))
        if not pieces:
            raise ValueError("no documents to pack")
        self.tokens = np.concatenate(pieces)
        self.doc_ids = np.concatenate(ids)
        self.seq_len = seq_len
        self.num_docs = len(pieces)
        self._len = (len(self.tokens) - 1) // seq_len
        if self._len == 0:
            raise ValueError(f"{len(self.tokens)} tokens are too few for one row of {seq_len}")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        start = int(index) * self.seq_len
        tok = self.tokens[start : start + self.seq_len + 1]
        doc = self.doc_ids[start : start + self.seq_len + 1]
        new_seg = np.concatenate([[True], doc[1:-1] != doc[:-2]])  # a document starts here
        seg_starts = np.flatnonzero(new_seg)
        seg_index = np.cumsum(new_seg) - 1
        return {
            "inputs": tok[:-1],
            "targets": tok[1:],
            "segment_ids": (seg_index + 1).astype(np.int32),
            "positions": (np.arange(self.seq_len) - seg_starts[seg_index]).astype(np.int32),
            "loss_mask": (doc[1:] == doc[:-1]).astype(np.int32),
        }

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)
