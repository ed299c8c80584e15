"""Tests of first-fit packing: a hand-worked example, the bin choice against a brute-force
first-fit, and invariants on every row of a random corpus (no document split unless longer than
a row, every prediction made exactly once, padding masked); `pack` picks the configured packer.
"""

import numpy as np
import pytest

from jaxllm.config import DataConfig
from jaxllm.data import ByteTokenizer
from jaxllm.data.packing import FirstFitRows, PackedRows, first_fit, pack

BOS, EOS = 256, 257
KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def segments(row) -> list[np.ndarray]:
    """The token runs of a row: inputs of each segment plus its last target."""
    out = []
    for s in range(1, row["segment_ids"].max() + 1):
        at = np.flatnonzero(row["segment_ids"] == s)
        out.append(np.concatenate([row["inputs"][at], row["targets"][at[-1:]]]))
    return out


def test_first_fit_hand_worked_example():
    # wrapped: [B 1 2 E] (3 predictions), [B 3 4 5 6 7 8 E] (7), [B 9 E] (2); rows of 4 slots
    docs = [np.array([1, 2]), np.array([3, 4, 5, 6, 7, 8]), np.array([9])]
    rows = FirstFitRows(docs, 4, bos_id=BOS, eos_id=EOS)
    # doc 2 is split into a whole row [B 3 4 5 6] and a rest [6 7 8 E] of 3 predictions;
    # first-fit puts doc 1 (3) in bin 0, doc 2's rest (3) in bin 1, doc 3 (2) in bin 2;
    # rows are numbered by where their first piece starts: doc 1, doc 2 head, doc 2 rest, doc 3
    expected = [
        dict(
            inputs=[BOS, 1, 2, 0],
            targets=[1, 2, EOS, 0],
            segment_ids=[1, 1, 1, 0],
            positions=[0, 1, 2, 0],
            loss_mask=[1, 1, 1, 0],
        ),
        dict(
            inputs=[BOS, 3, 4, 5],
            targets=[3, 4, 5, 6],
            segment_ids=[1, 1, 1, 1],
            positions=[0, 1, 2, 3],
            loss_mask=[1, 1, 1, 1],
        ),
        dict(
            inputs=[6, 7, 8, 0],
            targets=[7, 8, EOS, 0],
            segment_ids=[1, 1, 1, 0],
            positions=[0, 1, 2, 0],
            loss_mask=[1, 1, 1, 0],
        ),
        dict(
            inputs=[BOS, 9, 0, 0],
            targets=[9, EOS, 0, 0],
            segment_ids=[1, 1, 0, 0],
            positions=[0, 1, 0, 0],
            loss_mask=[1, 1, 0, 0],
        ),
    ]
    assert len(rows) == len(expected)
    for i, want in enumerate(expected):
        for k in KEYS:
            assert rows[i][k].dtype == np.int32
            np.testing.assert_array_equal(rows[i][k], want[k], err_msg=f"row {i} {k}")
    with pytest.raises(IndexError):
        rows[len(rows)]


def test_first_fit_shares_rows_between_short_documents():
    rows = FirstFitRows([np.array([1]), np.array([2, 3]), np.array([4])], 8, bos_id=BOS, eos_id=EOS)
    assert len(rows) == 1  # 2 + 3 + 2 predictions fit one row of 8
    row = rows[0]
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 2, 2, 2, 3, 3, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 0, 1, 2, 0, 1, 0])
    assert [s.tolist() for s in segments(row)] == [[BOS, 1, EOS], [BOS, 2, 3, EOS], [BOS, 4, EOS]]


def test_first_fit_bins_match_brute_force():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 17, 500)
    bins, free = [], []
    for s in sizes:  # the definition: the lowest-numbered bin with room, else a new one
        j = next((j for j, f in enumerate(free) if f >= s), len(free))
        if j == len(free):
            free.append(16)
        free[j] -= s
        bins.append(j)
    np.testing.assert_array_equal(first_fit(sizes, 16), bins)


@pytest.mark.parametrize("seq_len", [5, 16, 64])
def test_first_fit_invariants_on_every_row(seq_len):
    rng = np.random.default_rng(seq_len)
    lengths = rng.integers(1, 3 * seq_len, 120)
    # every token id unique across the corpus, so each run of tokens names its document
    ends = np.cumsum(lengths)
    docs = [np.arange(e - n, e, dtype=np.int32) for n, e in zip(lengths, ends)]
    rows = FirstFitRows(docs, seq_len, bos_id=None, eos_id=None, pad_id=-1)
    pieces: dict[int, list[np.ndarray]] = {}
    predictions = 0
    for r in range(len(rows)):
        row = rows[r]
        used = row["segment_ids"] > 0
        n = used.sum()
        assert used[:n].all() and not used[n:].any(), "segments first, then padding"
        np.testing.assert_array_equal(row["loss_mask"], used)
        assert (row["inputs"][~used] == -1).all() and (row["targets"][~used] == -1).all()
        assert (row["positions"][~used] == 0).all()
        assert (np.diff(row["segment_ids"][used]) >= 0).all()
        for s, run in enumerate(segments(row), 1):
            at = row["segment_ids"] == s
            np.testing.assert_array_equal(row["positions"][at], np.arange(at.sum()))
            assert (np.diff(run) == 1).all(), "a segment is a contiguous run of one document"
            doc = int(np.searchsorted(ends, run[0], side="right"))
            pieces.setdefault(doc, []).append(run)
        predictions += n
    assert predictions == sum(lengths - 1), "every prediction made exactly once"
    for d, doc in enumerate(docs):
        runs = sorted(pieces.get(d, []), key=lambda p: p[0])
        if len(doc) == 1:  # nothing to predict: takes no slot
            assert not runs
            continue
        if len(doc) - 1 <= seq_len:
            assert len(runs) == 1, f"document {d} fits a row and must not be split"
        covered = np.concatenate([runs[0]] + [p[1:] for p in runs[1:]])
        np.testing.assert_array_equal(covered, doc)  # pieces overlap by exactly one token
    # first-fit wastes little: more than 80% of the slots carry a prediction
    assert predictions / (len(rows) * seq_len) > 0.8


def test_pack_follows_the_config():
    docs = [np.array([1, 2, 3]), np.array([4, 5])]
    tok = ByteTokenizer()
    concat = pack(docs, DataConfig(seq_len=4), tok)
    fit = pack(docs, DataConfig(seq_len=4, packing="first_fit"), tok)
    assert isinstance(concat, PackedRows) and isinstance(fit, FirstFitRows)
    bare = pack(docs, DataConfig(seq_len=4, add_bos=False, add_eos=False), tok)
    np.testing.assert_array_equal(bare.tokens, [1, 2, 3, 4, 5])
    only_eos = pack(docs, DataConfig(seq_len=2, add_bos=False, packing="first_fit"), tok)
    assert [s.tolist() for r in range(len(only_eos)) for s in segments(only_eos[r])] == [
        [1, 2, 3],
        [3, EOS],
        [4, 5, EOS],
    ]
