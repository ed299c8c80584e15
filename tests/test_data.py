"""Tests of jaxllm.data: concatenate-and-split packing, the byte tokenizer, the stdlib train/eval
file split, and the Grain train/eval batch pipelines (other formats, tokenizers, first-fit,
mixtures, prepare and workers are in tests/test_data_*.py).

Packing is checked against references computed from the token stream itself (BOS/EOS marks),
on hand-made documents small enough to read; the pipelines run on synthetic documents.
"""

import numpy as np
import pytest

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import ByteTokenizer
from jaxllm.data.packing import PackedRows
from jaxllm.data.pipeline import eval_batches, train_batches
from jaxllm.data.sources import list_files
from jaxllm.data.split import split_files

BOS, EOS = 256, 257
KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def make_docs(lengths, seed=0) -> list[np.ndarray]:
    """Random byte documents (ids 0..255, so never BOS/EOS) of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).astype(np.int32) for n in lengths]


def stream_of(docs) -> np.ndarray:
    return np.concatenate([np.concatenate([[BOS], d, [EOS]]) for d in docs]).astype(np.int32)


def pack(docs, seq_len) -> PackedRows:
    return PackedRows(docs, seq_len, bos_id=BOS, eos_id=EOS)


# ------------------------------------------------------------------------- packing


def test_packing_hand_worked_example():
    # stream: BOS 1 2 EOS | BOS 3 4 5 6 7 EOS | BOS 8 EOS  (14 tokens -> 3 rows of 4 + 1)
    rows = pack([np.array([1, 2]), np.array([3, 4, 5, 6, 7]), np.array([8])], seq_len=4)
    assert len(rows) == 3
    expected = [
        dict(
            inputs=[BOS, 1, 2, EOS],
            targets=[1, 2, EOS, BOS],
            segment_ids=[1, 1, 1, 1],
            positions=[0, 1, 2, 3],
            loss_mask=[1, 1, 1, 0],
        ),
        dict(
            inputs=[BOS, 3, 4, 5],
            targets=[3, 4, 5, 6],
            segment_ids=[1, 1, 1, 1],
            positions=[0, 1, 2, 3],
            loss_mask=[1, 1, 1, 1],
        ),
        # the second document continues from row 1: positions restart at the row start
        dict(
            inputs=[6, 7, EOS, BOS],
            targets=[7, EOS, BOS, 8],
            segment_ids=[1, 1, 1, 2],
            positions=[0, 1, 2, 0],
            loss_mask=[1, 1, 0, 1],
        ),
    ]
    for i, want in enumerate(expected):
        got = rows[i]
        for k in KEYS:
            assert got[k].dtype == np.int32, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"row {i} {k}")


@pytest.mark.parametrize("seq_len", [3, 8, 16])
def test_packing_invariants_on_every_row(seq_len):
    docs = make_docs([0, 1, 5, 13, 2, 40, 7, 3, 21])
    stream = stream_of(docs)
    rows = pack(docs, seq_len)
    assert len(rows) == (len(stream) - 1) // seq_len
    for r in range(len(rows)):
        row = rows[r]
        for k in KEYS:
            assert row[k].shape == (seq_len,), k
        start = r * seq_len
        # targets are the inputs shifted by one within the stream
        np.testing.assert_array_equal(row["inputs"], stream[start : start + seq_len])
        np.testing.assert_array_equal(row["targets"], stream[start + 1 : start + seq_len + 1])
        # reference from the BOS marks: a document starts at each BOS (and a row at index 0)
        seg, pos = [], []
        for j, tok in enumerate(row["inputs"]):
            if j == 0:
                seg.append(1)
                pos.append(0)
            elif tok == BOS:
                seg.append(seg[-1] + 1)
                pos.append(0)
            else:
                seg.append(seg[-1])
                pos.append(pos[-1] + 1)
        np.testing.assert_array_equal(row["segment_ids"], seg, err_msg=f"row {r}")
        np.testing.assert_array_equal(row["positions"], pos, err_msg=f"row {r}")
        # the target leaves the document exactly when the input is an EOS (EOS -> next BOS)
        np.testing.assert_array_equal(row["loss_mask"], row["inputs"] != EOS, err_msg=f"row {r}")


def test_long_document_is_split_across_rows_without_loss():
    long_doc = np.arange(30, dtype=np.int32) % 200 + 1
    rows = pack([long_doc, np.array([9, 9, 9])], seq_len=8)
    assert len(rows) == 4  # 37 tokens: rows cover BOS, the 30 tokens, EOS and the next BOS
    pieces = [rows[i] for i in range(len(rows))]
    covered = np.concatenate([p["inputs"] for p in pieces] + [pieces[-1]["targets"][-1:]])
    stream = stream_of([long_doc, np.array([9, 9, 9])])
    np.testing.assert_array_equal(covered, stream[: len(covered)])
    np.testing.assert_array_equal(covered[1:31], long_doc)  # every token of the long document
    for p in pieces[1:3]:  # rows wholly inside the long document: one segment from position 0
        np.testing.assert_array_equal(p["segment_ids"], np.ones(8))
        np.testing.assert_array_equal(p["positions"], np.arange(8))
        np.testing.assert_array_equal(p["loss_mask"], np.ones(8))


def test_packing_needs_enough_tokens_for_one_row():
    # [1, 2] -> BOS 1 2 EOS: 4 tokens make one row of 3 (3 inputs + 1 shifted target), not of 4
    assert len(pack([np.array([1, 2])], seq_len=3)) == 1
    with pytest.raises(ValueError):
        pack([np.array([1, 2])], seq_len=4)
    with pytest.raises(ValueError):
        pack([], seq_len=4)


# ------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and ids.max() < 256
    assert tok.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == text
    assert tok.encode(text.encode("utf-8")).tolist() == ids.tolist()  # bytes encode the same


# ------------------------------------------------------------------------- stdlib split


def test_stdlib_split_is_deterministic_disjoint_and_complete():
    files = list_files(SourceConfig(path="stdlib"), "data.sources[0]", max_files=400)
    assert len(files) == 400 and all(f.format == "stdlib" for f in files)
    train, held = split_files(files, eval_fraction=0.1)
    again = list_files(SourceConfig(path="stdlib"), "data.sources[0]", max_files=400)
    assert split_files(again, eval_fraction=0.1) == (train, held)
    assert not set(train) & set(held)
    assert sorted(train + held, key=lambda f: f.path) == files
    assert 0.03 <= len(held) / len(files) <= 0.2


def test_stdlib_split_rejects_an_empty_eval_split():
    files = list_files(SourceConfig(path="stdlib"), "data.sources[0]", max_files=50)
    with pytest.raises(ConfigError, match="data.eval_fraction=0.0 leaves 50 train and 0 eval"):
        split_files(files, eval_fraction=0.0)


# ------------------------------------------------------------------------- pipelines


@pytest.fixture(scope="module")
def synthetic_rows() -> PackedRows:
    rng = np.random.default_rng(1)
    return pack(make_docs(rng.integers(1, 60, 40)), seq_len=16)


def take(it, n) -> list[dict]:
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def assert_batches_equal(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y) == set(KEYS)
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])


def test_train_batches_are_seeded_and_shaped(synthetic_rows):
    rows = synthetic_rows
    first = take(train_batches(rows, DataConfig(seq_len=16, seed=0), batch_size=4), 3)
    again = take(train_batches(rows, DataConfig(seq_len=16, seed=0), batch_size=4), 3)
    other = take(train_batches(rows, DataConfig(seq_len=16, seed=1), batch_size=4), 3)
    assert_batches_equal(first, again)
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other)), (
        "a different seed should give a different order"
    )
    known = {tuple(rows[i]["inputs"]) for i in range(len(rows))}
    for b in first:
        for k in KEYS:
            assert b[k].shape == (4, 16), k
        assert all(tuple(r) in known for r in b["inputs"])  # whole packed rows, not fragments


def test_train_batches_reshuffle_each_epoch(synthetic_rows):
    rows = synthetic_rows
    n = len(rows)
    index = {tuple(rows[i]["inputs"]): i for i in range(n)}
    assert len(index) == n  # rows are distinguishable by their inputs
    batches = take(
        train_batches(rows, DataConfig(seq_len=16, seed=0), batch_size=4), -(-2 * n // 4)
    )
    order = [index[tuple(r)] for b in batches for r in b["inputs"]]
    epoch0, epoch1 = order[:n], order[n : 2 * n]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))  # each epoch sees every row once
    assert epoch0 != list(range(n)), "rows should be shuffled"
    assert epoch0 != epoch1, "each epoch should have a new permutation"


def test_eval_batches_are_fixed(synthetic_rows):
    rows = synthetic_rows
    first = eval_batches(rows, batch_size=4, num_batches=3)
    assert len(first) == 3
    assert_batches_equal(first, eval_batches(rows, batch_size=4, num_batches=3))
    for i, b in enumerate(first):
        for k in KEYS:
            assert b[k].shape == (4, 16), k
            np.testing.assert_array_equal(b[k], np.stack([rows[4 * i + j][k] for j in range(4)]))
    # more batches than the split holds: every row, the last batch filled up with padding rows
    every = eval_batches(rows, batch_size=4, num_batches=10_000)
    assert len(every) == -(-len(rows) // 4)
    tail = len(rows) % 4 or 4
    assert not every[-1]["loss_mask"][tail:].any()
    np.testing.assert_array_equal(every[-1]["inputs"][:tail], np.stack(
        [rows[i]["inputs"] for i in range(len(rows) - tail, len(rows))]))  # fmt: skip
    # fewer rows than a batch: one batch, filled up with all-zero padding rows
    small = pack([np.array([1, 2, 3])], seq_len=2)
    (padded,) = eval_batches(small, batch_size=4, num_batches=1)
    for k in KEYS:
        np.testing.assert_array_equal(
            padded[k][: len(small)], np.stack([small[i][k] for i in range(len(small))])
        )
        assert not padded[k][len(small) :].any(), k


def test_rows_out_of_range_raise_index_error():
    rows = PackedRows([np.array([1, 2, 3, 4, 5])], 3, bos_id=256, eos_id=257)
    assert len(list(rows)) == len(rows) == 2  # iteration stops
    with pytest.raises(IndexError):
        rows[2]
