"""Tests of `data.order`: shuffled (the default, unchanged), length (documents shortest first,
rows unshuffled) and curriculum (sources whole, one after another, in the order listed).

Documents are tiny text files with the byte tokenizer: a row's tokens read back as text, so a
test sees which document and which source each row came from. Every order keeps the stream a
function of the batch number, so a saved position resumes exactly; every order leaves the
held-out rows alone; the orders a run cannot honour are refused in one line.
"""

import os
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest

from jaxllm import config
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data.packing import PackedRows
from jaxllm.data.pipeline import CurriculumRows, MixtureRows, load_splits, train_batches

REPO = Path(__file__).resolve().parents[1]
BOS, EOS = 256, 257


def take(it, n) -> list[dict]:
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def doc_lengths(rows: PackedRows) -> list[int]:
    """Lengths of the documents in a packer's token store, in stored order (BOS ... EOS)."""
    tokens = rows.tokens.astype(np.int64)
    starts, ends = np.flatnonzero(tokens == BOS), np.flatnonzero(tokens == EOS)
    return (ends - starts - 1).tolist()


@pytest.fixture
def corpus(tmp_path):
    """Two directories: `a` of 12 documents of 'a' and `b` of 9 of 'b', lengths shuffled."""
    rng = np.random.default_rng(0)
    for name, n in (("a", 12), ("b", 9)):
        (tmp_path / name).mkdir()
        for i, length in enumerate(rng.permutation(np.arange(5, 5 + 9 * n, 9))):
            (tmp_path / name / f"{i:02d}.txt").write_text(name * int(length))

    def cfg(*names, **kw) -> DataConfig:
        sources = tuple(SourceConfig(path=str(tmp_path / n)) for n in names)
        return DataConfig(sources=sources, seq_len=16, eval_fraction=0.0, **kw)

    return cfg


def source_of(inputs: np.ndarray) -> str:
    chars = set(inputs.tolist()) - {BOS, EOS}
    assert len(chars) == 1, "a row never mixes sources"
    return chr(chars.pop())


def test_default_order_is_shuffled_and_unchanged(corpus):
    assert DataConfig().order == "shuffled"
    rows, _ = load_splits(corpus("a", "b", seed=4))
    assert isinstance(rows, MixtureRows)
    # the stream is the Grain pipeline it always was: each source shuffled, mixed, shuffled
    mixed = grain.MapDataset.mix(
        [grain.MapDataset.source(p).shuffle(seed=4 + i).repeat() for i, p in enumerate(rows.parts)],
        [1.0, 1.0],
    )
    expected = grain.MapDataset.source(mixed[: len(rows)]).shuffle(seed=4).repeat().batch(8)
    assert_same(
        take(train_batches(rows, corpus("a", "b", seed=4), 8), 6), [expected[i] for i in range(6)]
    )
    one, _ = load_splits(corpus("a", seed=4))
    sizes = doc_lengths(one)
    assert sizes != sorted(sizes)  # documents stay in file order


def test_length_sorts_documents_shortest_first_and_keeps_the_rows_in_order(corpus):
    cfg = corpus("a", order="length", seed=4)
    rows, _ = load_splits(cfg)
    sizes = doc_lengths(rows)
    assert sizes == sorted(sizes) and len(set(sizes)) == 12
    stream = take(train_batches(rows, cfg, 4), len(rows) // 4 + 2)
    inputs = np.concatenate([b["inputs"] for b in stream])
    for i, row in enumerate(inputs):  # row i of the packed store, then again from row 0
        np.testing.assert_array_equal(row, rows[i % len(rows)]["inputs"])
    # short documents first: the first rows hold more document starts than the last ones
    starts = [
        int((rows[i]["segment_ids"] != np.roll(rows[i]["segment_ids"], 1)).sum())
        for i in range(len(rows))
    ]
    assert np.mean(starts[:3]) > np.mean(starts[-3:])


def test_length_over_two_sources_sorts_each_and_mixes_them_unshuffled(corpus):
    cfg = corpus("a", "b", order="length")
    rows, _ = load_splits(cfg)
    assert isinstance(rows, MixtureRows)
    for part in rows.parts:
        sizes = doc_lengths(part)
        assert sizes == sorted(sizes)
    seen = {"a": [], "b": []}
    for batch in take(train_batches(rows, cfg, 4), 10):
        for row in batch["inputs"]:
            seen[source_of(row)].append(row)
    for name, part in zip("ab", rows.parts):
        assert len(seen[name]) >= 10  # both sources, interleaved by weight
        for i, row in enumerate(seen[name][: len(part)]):
            np.testing.assert_array_equal(row, part[i]["inputs"])  # each in its own order


def test_curriculum_takes_every_row_of_source_1_then_source_2(corpus):
    cfg = corpus("b", "a", order="curriculum", seed=2)
    rows, _ = load_splits(cfg)
    assert isinstance(rows, CurriculumRows)
    n_b, n_a = (len(p) for p in rows.parts)
    assert len(rows) == n_b + n_a
    order = [source_of(rows[i]["inputs"]) for i in range(len(rows))]
    assert order == ["b"] * n_b + ["a"] * n_a
    # within a source the rows are shuffled: a permutation of the source's rows
    firsts = [rows[i]["inputs"].tobytes() for i in range(n_b)]
    own = [rows.parts[0][i]["inputs"].tobytes() for i in range(n_b)]
    assert sorted(firsts) == sorted(own) and firsts != own
    stream = take(train_batches(rows, cfg, 3), (len(rows) + 12) // 3)
    inputs = np.concatenate([b["inputs"] for b in stream])
    for i, row in enumerate(inputs):  # the curriculum, then the curriculum again
        np.testing.assert_array_equal(row, rows[i % len(rows)]["inputs"])
    with pytest.raises(IndexError):
        rows[len(rows)]


@pytest.mark.parametrize("order", ["length", "curriculum"])
def test_a_saved_position_resumes_mid_epoch_exactly(corpus, order):
    cfg = corpus("a", "b", order=order)
    rows, _ = load_splits(cfg)
    straight = take(train_batches(rows, cfg, 4), 9)
    it = train_batches(rows, cfg, 4)
    take(it, 5)
    state = it.get_state()
    resumed = train_batches(rows, cfg, 4)
    resumed.set_state(state)
    assert_same(take(resumed, 4), straight[5:])


def test_held_out_rows_are_the_same_for_every_order(tmp_path):
    for name in "ab":
        (tmp_path / name).mkdir()
        for i in range(40):
            (tmp_path / name / f"{i}.txt").write_text(name * (40 - i))
    sources = tuple(SourceConfig(path=str(tmp_path / n)) for n in "ab")
    held = {}
    for order in ("shuffled", "length", "curriculum"):
        cfg = DataConfig(sources=sources, seq_len=16, eval_fraction=0.2, order=order)
        held[order] = load_splits(cfg)[1]
    for order in ("length", "curriculum"):
        assert len(held[order]) == len(held["shuffled"])
        assert_same(
            [held[order][i] for i in range(len(held[order]))],
            [held["shuffled"][i] for i in range(len(held[order]))],
        )


def order_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        config.load(None, list(overrides))
    return str(e.value)


def test_orders_a_run_cannot_honour_are_refused():
    assert "needs two or more" in order_error("data.order=curriculum")
    two = "data.sources=[{path: stdlib}, {path: stdlib, weight: 2}]"
    assert "weight 2.0" in order_error("data.order=curriculum", two)
    chat = "data.sources=[{path: x.jsonl, format: chat}]"
    assert "format chat" in order_error("data.order=length", chat)
    rollout = "data.sources=[{path: x.jsonl, format: rollout}]"
    assert "samples its own batches" in order_error(
        "data.order=length", "train.objective=grpo", rollout
    )
    assert "data.order" in order_error("data.order=backwards")
    config.load(None, ["data.order=length"])  # one text source: fine
    config.load(None, ["data.order=curriculum", "data.sources=[{path: stdlib}, {path: stdlib}]"])


def test_cli_refuses_a_one_source_curriculum_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm", "train", "data.order=curriculum"],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxllm: ") and "data.order" in lines[0]
