"""T5 span corruption: the exact corruption of a known row, the lengths T5 computes, and the
noise statistics over many rows."""

import json

import numpy as np
import pytest

from jaxllm.cli import main
from jaxllm.config import ConfigError, DataConfig
from jaxllm.data.span_corruption import (
    SpanCorruptionRows,
    corrupt,
    corrupted_splits,
    random_spans_noise_mask,
    raw_length,
    sentinel_start_id,
)
from jaxllm.data.tokenizer import ByteTokenizer


def test_corrupt_known_sequence():
    tokens = np.arange(10, 20)  # 10 .. 19
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 1], bool)
    inputs, targets = corrupt(tokens, mask, sentinel_start=99, eos_id=1)
    np.testing.assert_array_equal(inputs, [10, 11, 99, 14, 15, 16, 98, 18, 97, 1])
    np.testing.assert_array_equal(targets, [99, 12, 13, 98, 17, 97, 19, 1])


def test_raw_length_matches_t5():
    # t5.data.preprocessors.random_spans_helper(512) == (568, 114): the T5 pretraining lengths
    assert raw_length(512) == (568, 114)
    assert raw_length(128) == (141, 29)  # 141 - 21 noise + 7 spans + EOS = 128


def test_noise_mask_counts_and_shape():
    rng = np.random.default_rng(0)
    mask = random_spans_noise_mask(100, rng)
    assert mask.sum() == 15 and not mask[0]
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    assert starts.sum() == 5


def test_noise_statistics_over_many_rows():
    noise, spans, total = 0, 0, 0
    for seed in range(400):
        mask = random_spans_noise_mask(141, np.random.default_rng(seed))
        noise += int(mask.sum())
        spans += int((mask & ~np.concatenate([[False], mask[:-1]])).sum())
        total += len(mask)
    assert abs(noise / total - 0.15) < 0.005
    assert abs(noise / spans - 3.0) < 0.15


class _Raw:
    def __init__(self, n, length):
        self.rows = [np.arange(i * length, (i + 1) * length) % 200 + 3 for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"inputs": self.rows[i]}


def test_rows_are_deterministic_and_t5_shaped():
    n_raw, n_targets = raw_length(32)
    rows = SpanCorruptionRows(_Raw(8, n_raw), 32, sentinel_start=511, eos_id=2, seed=3)
    again = SpanCorruptionRows(_Raw(8, n_raw), 32, sentinel_start=511, eos_id=2, seed=3)
    other = SpanCorruptionRows(_Raw(8, n_raw), 32, sentinel_start=511, eos_id=2, seed=4)
    row = rows[5]
    for k in row:
        np.testing.assert_array_equal(row[k], again[5][k])
    assert any((rows[i]["inputs"] != other[i]["inputs"]).any() for i in range(8))
    assert row["inputs"].shape == (32,) and row["targets"].shape == (n_targets,)
    np.testing.assert_array_equal(row["decoder_inputs"][1:], row["targets"][:-1])
    assert row["decoder_inputs"][0] == 0
    # every raw token is either kept in the inputs or predicted in the targets, in order
    inputs = row["inputs"][row["segment_ids"] > 0]
    targets = row["targets"][row["loss_mask"] > 0]
    assert inputs[-1] == 2 and targets[-1] == 2 and targets[0] == 511
    rebuilt, t = [], list(targets[:-1])
    for x in inputs[:-1]:
        if x >= 500:
            t = t[1:]  # the sentinel opening this span in the targets
            while t and t[0] < 500:
                rebuilt.append(t.pop(0))
        else:
            rebuilt.append(x)
    np.testing.assert_array_equal(rebuilt, rows.raw[5]["inputs"])


def _train(run):
    small = [
        "data.max_files=20",
        "data.seq_len=48",
        "model.num_layers=2",
        "model.d_model=64",
        "model.mlp_dim=128",
        "model.dtype=float32",
        "train.global_batch_size=8",
        "mesh.data=1",
        "mesh.fsdp=-1",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        f"run.dir={run}",
    ]
    assert main(["train", "configs/runs/span_corruption.yaml", *small]) == 0


def test_jaxllm_train_encoder_decoder(tmp_path):
    """`jaxllm train configs/runs/span_corruption.yaml` end to end, tiny."""
    _train(tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 4 and losses[-1] < losses[0]
    n_targets = raw_length(48)[1]
    assert all(0 < x["tokens"] <= 8 * n_targets for x in lines if "tokens" in x)


@pytest.mark.slow
def test_jaxllm_eval_and_generate_encoder_decoder(tmp_path, capsys):
    run = tmp_path / "run"
    _train(run)
    assert main(["eval", str(run)]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "import os", "--max-new-tokens", "3"]) == 0
    assert "3 new tokens" in capsys.readouterr().err


class _Vocab:
    def __init__(self, ids):
        self.ids = ids

    def token_to_id(self, token):
        return self.ids.get(token)


class _Tok:
    def __init__(self, ids):
        self._tok = _Vocab(ids)


def test_sentinels_come_from_extra_ids_else_the_top_of_the_vocabulary():
    assert sentinel_start_id(_Tok({"<extra_id_0>": 32099}), 32128, None) == 32099
    assert sentinel_start_id(_Tok({}), 384, None) == 383
    assert sentinel_start_id(ByteTokenizer(), 384, None) == 383
    assert sentinel_start_id(_Tok({"<extra_id_0>": 32099}), 32128, 500) == 500


def test_sentinels_must_fit_above_the_tokenizer():
    data = DataConfig(seq_len=64, max_files=5, eval_fraction=0.4)
    rows = corrupted_splits(data, 384)[0]
    assert rows[0]["targets"][0] == 383  # sentinel 0 opens the targets
    with pytest.raises(ConfigError, match="data.span_corruption.sentinel_start"):
        corrupted_splits(data, 260)  # 258 byte ids leave 2 ids for 3 spans
