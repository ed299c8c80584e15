"""Packing tokenized documents into rows of L tokens: concatenate-and-split, or first-fit.

Both packers are Grain-compatible random-access sources (`len`, `[i]`, IndexError past the end)
whose rows are the five int32 arrays [L] of `jaxllm.data`, and both keep the documents in one
flat token array (uint16 when the ids allow, halving host memory and the copy sent to Grain
worker processes) with their start offsets; a row is cut from it on demand.

`concat` (PackedRows): documents (each BOS ... EOS when enabled) are laid end to end in one stream
and cut into rows of L + 1 tokens that overlap by one (inputs = row[:-1], targets = row[1:]). No
slot is padding; a document longer than a row is split across rows, never dropped, and each
piece restarts its positions at 0. A target in the next document (EOS -> BOS) is masked.

`first_fit` (FirstFitRows): a document of n tokens makes n - 1 predictions, so it fills n - 1
slots of one row (inputs doc[:-1], targets doc[1:]), placed whole into the lowest-numbered row
with room (first-fit bin packing, in document order; a max segment tree over the rows' free slots
finds that row in O(log rows)). Only a document with more than L predictions is cut, into pieces
of L predictions (consecutive pieces share one token, so every prediction is made exactly once),
each restarting its positions at 0. A one-token document (possible without BOS/EOS) predicts
nothing and takes no slot. Free slots at the end of a row hold `pad_id` with segment id
0 and loss_mask 0. Rows are numbered by where their first document starts in the corpus.
Given `masks` (one per document, 1 where a token is a trained target: SFT examples, never
longer than a row, see `jaxllm.data.sft`), a slot's loss_mask is its target's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def _token_store(docs: Iterable[np.ndarray], bos_id: int | None, eos_id: int | None):
    """(tokens, starts): the documents, wrapped in BOS/EOS when given, end to end; document d
    is tokens[starts[d] : starts[d + 1]]."""
    tokens, starts = _concat([np.asarray(d) for d in docs], bos_id, eos_id)
    if len(tokens) and 0 <= tokens.min() and tokens.max() < 2**16:
        tokens = tokens.astype(np.uint16)
    return tokens, starts


def _concat(docs: list[np.ndarray], bos_id: int | None, eos_id: int | None):
    if not docs:
        raise ValueError("no documents to pack")
    head, tail = int(bos_id is not None), int(eos_id is not None)
    starts = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) + head + tail for d in docs], out=starts[1:])
    tokens = np.empty(starts[-1], np.int32)
    for doc, start in zip(docs, starts[:-1].tolist()):  # one memcpy per document
        tokens[start + head : start + head + len(doc)] = doc
    if head:
        tokens[starts[:-1]] = bos_id
    if tail:
        tokens[starts[1:] - 1] = eos_id
    return tokens, starts


class PackedRows:
    """Concatenate-and-split rows of L tokens (see the module docstring)."""

    def __init__(
        self, docs: Iterable[np.ndarray], seq_len: int, *, bos_id: int | None, eos_id: int | None
    ):
        self.tokens, self.doc_starts = _token_store(docs, bos_id, eos_id)
        self.seq_len = seq_len
        self.num_docs = len(self.doc_starts) - 1
        self._len = (len(self.tokens) - 1) // seq_len
        if self._len == 0:
            raise ValueError(f"{len(self.tokens)} tokens are too few for one row of {seq_len}")

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        start = int(index) * self.seq_len
        tok = self.tokens[start : start + self.seq_len + 1].astype(np.int32)
        doc = np.searchsorted(self.doc_starts, np.arange(start, start + len(tok)), "right")
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


def first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Bin of each item, in order: the lowest-numbered bin whose free space holds it (a new bin
    when none does). Every size must be in [1, capacity]."""
    leaves = 1
    while leaves < max(len(sizes), 1):  # never more bins than items
        leaves *= 2
    free = [capacity] * (2 * leaves)  # free[i]: the most free space of any bin under node i
    bins = np.empty(len(sizes), np.int64)
    for j, size in enumerate(sizes.tolist()):
        i = 1
        while i < leaves:  # descend towards the leftmost bin with room
            i = 2 * i if free[2 * i] >= size else 2 * i + 1
        bins[j] = i - leaves
        free[i] -= size
        while i > 1:
            i //= 2
            most = max(free[2 * i], free[2 * i + 1])
            if free[i] == most:
                break
            free[i] = most
    return bins


class FirstFitRows:
    """First-fit rows of L slots, padded (see the module docstring)."""

    def __init__(
        self,
        docs: Iterable[np.ndarray],
        seq_len: int,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int = 0,
        masks: Iterable[np.ndarray] | None = None,
    ):
        self.tokens, starts = _token_store(docs, bos_id, eos_id)
        # per token, 1 where it is a trained target (SFT examples, wrapped already); None: all
        self.masks = None if masks is None else _concat(list(masks), None, None)[0].astype(bool)
        self.seq_len, self.pad_id = seq_len, pad_id
        self.doc_starts = starts  # document d is tokens[doc_starts[d] : doc_starts[d + 1]]
        self.num_docs = len(starts) - 1
        l = seq_len
        predictions = np.maximum(np.diff(starts) - 1, 0)
        # pieces of exactly L predictions fill a row alone; no first-fit search needed
        whole = predictions // l
        first_whole = np.cumsum(whole) - whole
        whole_doc = np.repeat(np.arange(self.num_docs), whole)
        whole_starts = starts[whole_doc] + l * (np.arange(whole.sum()) - first_whole[whole_doc])
        # the rest of each document (all of it when it fits a row) is placed first-fit
        rest_doc = np.flatnonzero(predictions % l)
        rest_slots = predictions[rest_doc] % l
        rest_starts = starts[rest_doc] + l * whole[rest_doc]
        rest_rows = first_fit(rest_slots, l) + len(whole_starts)
        piece_start = np.concatenate([whole_starts, rest_starts])
        piece_slots = np.concatenate([np.full(len(whole_starts), l), rest_slots])
        piece_row = np.concatenate([np.arange(len(whole_starts)), rest_rows])
        self._len = int(piece_row.max()) + 1 if len(piece_row) else 0
        if self._len == 0:
            raise ValueError("no document has two tokens: nothing to predict")
        # renumber rows by their first token in the corpus, then sort pieces by (row, start)
        first_start = np.full(self._len, np.iinfo(np.int64).max)
        np.minimum.at(first_start, piece_row, piece_start)
        rank = np.empty(self._len, np.int64)
        rank[np.argsort(first_start, kind="stable")] = np.arange(self._len)
        piece_row = rank[piece_row]
        order = np.lexsort((piece_start, piece_row))
        self._piece_start, self._piece_slots = piece_start[order], piece_slots[order]
        self._row_ptr = np.zeros(self._len + 1, np.int64)
        np.cumsum(np.bincount(piece_row, minlength=self._len), out=self._row_ptr[1:])

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        a, b = self._row_ptr[index], self._row_ptr[index + 1]
        starts, slots = self._piece_start[a:b], self._piece_slots[a:b]
        offsets = np.cumsum(slots) - slots  # where each piece begins in the row
        used = int(slots.sum())
        within = np.arange(used) - np.repeat(offsets, slots)
        source = np.repeat(starts, slots) + within
        row = {k: np.zeros(self.seq_len, np.int32) for k in ("segment_ids", "positions")}
        row["inputs"] = np.full(self.seq_len, self.pad_id, np.int32)
        row["targets"] = np.full(self.seq_len, self.pad_id, np.int32)
        row["inputs"][:used] = self.tokens[source]
        row["targets"][:used] = self.tokens[source + 1]
        if self.tokens.dtype.kind == "i":  # soft-prompt placeholders (< 0) are never targets
            np.maximum(row["targets"], 0, out=row["targets"])
        row["segment_ids"][:used] = np.repeat(np.arange(1, len(slots) + 1), slots)
        row["positions"][:used] = within
        row["loss_mask"] = (row["segment_ids"] > 0).astype(np.int32)
        if self.masks is not None:
            row["loss_mask"][:used] = self.masks[source + 1]
        return {k: row[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}


def pack(docs: list[np.ndarray], data_cfg, tok) -> PackedRows | FirstFitRows:
    """Rows of `docs` by `data.packing`, with BOS/EOS as `data.add_bos` / `data.add_eos` say."""
    specials = dict(
        bos_id=tok.bos_id if data_cfg.add_bos else None,
        eos_id=tok.eos_id if data_cfg.add_eos else None,
    )
    if data_cfg.packing == "first_fit":
        return FirstFitRows(docs, data_cfg.seq_len, pad_id=tok.pad_id, **specials)
    return PackedRows(docs, data_cfg.seq_len, **specials)
