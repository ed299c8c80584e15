"""Tests of Grain worker processes (`data.workers`) and of the pipeline benchmark.

Workers must give exactly the batches of the in-process iterator, and a checkpointed
`get_state()` must resume the stream at the same batch, in a fresh iterator, with or without
workers. The benchmark runs on a tiny corpus through both its function and its CLI handler.
"""

import argparse

import numpy as np
import pytest

from jaxllm.config import Config, DataConfig, SourceConfig, TrainConfig
from jaxllm.data.bench import bench_data
from jaxllm.data.cli import add_bench_data_parser
from jaxllm.data.packing import PackedRows
from jaxllm.data.pipeline import MixtureRows, train_batches

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@pytest.fixture(scope="module")
def rows() -> MixtureRows:
    rng = np.random.default_rng(0)
    parts = [
        PackedRows(
            [rng.integers(0, 256, n) for n in rng.integers(1, 90, 30)], 16, bos_id=256, eos_id=257
        )
        for _ in range(2)
    ]
    return MixtureRows(parts, [1.0, 2.0], seed=0)  # the hardest case: a mixture, pickled


def take(it, n) -> list[dict]:
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])


def test_worker_batches_equal_in_process_and_restore_from_state(rows):
    in_process = take(train_batches(rows, DataConfig(seed=3), 4), 8)
    cfg = DataConfig(seed=3, workers=2)
    it = train_batches(rows, cfg, 4)
    try:
        first = take(it, 5)
        state = it.get_state()
        rest = take(it, 3)
    finally:
        it.close()
    assert_same(first + rest, in_process)

    resumed = train_batches(rows, cfg, 4)
    try:
        resumed.set_state(state)
        assert_same(take(resumed, 3), in_process[5:])
    finally:
        resumed.close()
    # the state is the same stream position in-process (a run may change data.workers)
    plain = train_batches(rows, DataConfig(seed=3), 4)
    plain.set_state(state)
    assert_same(take(plain, 3), in_process[5:])


def test_worker_batches_with_a_local_row_slice(rows):
    full = take(train_batches(rows, DataConfig(seed=1), 8), 3)
    it = train_batches(rows, DataConfig(seed=1, workers=1), 8, local=slice(2, 6))
    try:
        local = take(it, 3)
    finally:
        it.close()
    assert_same(local, [{k: b[k][2:6] for k in KEYS} for b in full])


@pytest.fixture
def tiny_run(tmp_path) -> Config:
    for i in range(12):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} " * (5 + i))
    src = SourceConfig(path=str(tmp_path))
    return Config(
        data=DataConfig(sources=(src,), eval_sources=(src,), seq_len=32),
        train=TrainConfig(global_batch_size=4),
    )


def test_bench_data_counts_batches_and_tokens(tiny_run):
    r = bench_data(tiny_run, batches=20)
    assert r["batches"] == 20 and r["batch_tokens"] == 4 * 32
    assert r["tokens_per_s"] == pytest.approx(20 * 128 / r["seconds"])
    assert 0 < r["real_tokens_per_s"] <= r["tokens_per_s"]
    assert r["docs"] == 12 and r["rows"] > 0


def test_bench_data_cli(tiny_run, capsys):
    parser = argparse.ArgumentParser()
    add_bench_data_parser(parser.add_subparsers(dest="what", required=True))
    d = tiny_run.data
    ns = parser.parse_args(
        [
            "data",
            f"data.sources=[{{path: {d.sources[0].path}}}]",
            f"data.eval_sources=[{{path: {d.sources[0].path}}}]",
            "data.seq_len=32",
            "data.packing=first_fit",
            "train.global_batch_size=4",
            "--batches",
            "5",
        ]
    )
    assert ns.func(ns) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "first_fit / 0" in out and "5 of 128 tokens" in out
