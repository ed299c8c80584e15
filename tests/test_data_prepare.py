"""Tests of `jaxllm data prepare`: the manifest's counts equal the tokens in the shards, training
from the prepared directory gives the very rows of tokenizing on the fly, worker processes write
the same shards, `--overwrite` replaces a preparation whole, and a truncated shard, a damaged
manifest or another tokenizer is refused with a clear error.
"""

import argparse
import json
import shutil

import numpy as np
import pytest

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import train_bpe
from jaxllm.data.cli import add_data_parser
from jaxllm.data.pipeline import load_splits
from jaxllm.data.prepare import prepare
from jaxllm.data.sources import read_arrayrecord

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "日本", "x"]
    for i in range(40):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, 5 + 7 * i)))
    with open(root / "lines.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 3 + i))}) + "\n")
    return root


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "out"
    return out, prepare([SourceConfig(path=str(corpus))], out, shard_docs=8, eval_fraction=0.1)


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return ns.func(ns)


def shard_docs(out, manifest) -> dict[str, list[np.ndarray]]:
    return {
        s["file"]: [np.frombuffer(r, "<i4") for r in read_arrayrecord(out / s["file"])]
        for s in manifest["shards"]
    }


def test_manifest_totals_equal_the_tokens(prepared):
    out, manifest = prepared
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["tokenizer"]["spec"] == "byte" and manifest["files"] == 41
    docs = shard_docs(out, manifest)
    for s in manifest["shards"]:
        assert 1 <= s["docs"] == len(docs[s["file"]]) <= 8
        assert s["tokens"] == sum(len(d) for d in docs[s["file"]])
    assert manifest["docs"] == 40 + 30 == sum(s["docs"] for s in manifest["shards"])
    assert manifest["tokens"] == sum(len(d) for ds in docs.values() for d in ds)
    for split in ("train", "eval"):
        chosen = [s for s in manifest["shards"] if s["split"] == split]
        assert manifest["splits"][split]["docs"] == sum(s["docs"] for s in chosen) > 0
        assert all(s["file"].startswith(split) for s in chosen)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_prepared_rows_equal_on_the_fly_rows(corpus, prepared, packing):
    out, _ = prepared
    on_the_fly = DataConfig(
        sources=(SourceConfig(path=str(corpus)),), seq_len=16, eval_fraction=0.1, packing=packing
    )
    from_shards = DataConfig(
        sources=(SourceConfig(path=str(out)),), seq_len=16, eval_fraction=0.1, packing=packing
    )
    for a, b in zip(load_splits(on_the_fly), load_splits(from_shards)):
        assert (len(a), a.num_docs, a.num_tokens) == (len(b), b.num_docs, b.num_tokens)
        for i in range(len(a)):
            for k in KEYS:
                np.testing.assert_array_equal(a[i][k], b[i][k], err_msg=f"row {i} {k}")


def test_training_from_shards_does_not_tokenize(prepared, monkeypatch):
    out, _ = prepared
    import jaxllm.data.tokenizer as tokenizer

    def refuse(*args):
        raise AssertionError("tokenized while reading prepared shards")

    monkeypatch.setattr(tokenizer.ByteTokenizer, "encode", refuse)
    monkeypatch.setattr(tokenizer.ByteTokenizer, "encode_batch", refuse)
    train, held = load_splits(
        DataConfig(sources=(SourceConfig(path=str(out)),), seq_len=16, eval_fraction=0.1)
    )
    assert train.num_docs + held.num_docs == 70


def test_workers_and_cli_write_the_same_shards(corpus, prepared, tmp_path, capsys):
    out, manifest = prepared
    code = run_cli(
        "data",
        "prepare",
        str(corpus),
        "--out",
        str(tmp_path / "cli"),
        "--workers",
        "2",
        "--shard-docs",
        "8",
        "--eval-fraction",
        "0.1",
    )
    assert code == 0 and "70 documents" in capsys.readouterr().out
    again = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert again["shards"] == manifest["shards"]
    a, b = shard_docs(out, manifest), shard_docs(tmp_path / "cli", again)
    assert all(np.array_equal(x, y) for f in a for x, y in zip(a[f], b[f], strict=True))
    with pytest.raises(ConfigError, match="already holds files; .* pass --overwrite"):
        run_cli("data", "prepare", str(corpus), "--out", str(tmp_path / "cli"))


def test_overwrite_replaces_a_preparation_whole(corpus, prepared, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    (out / "stale.arrayrecord").write_bytes(b"")
    one = prepare([SourceConfig(path=str(corpus / "doc00.txt"))], out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train-00000.arrayrecord"]
    assert one["docs"] == 1 and not list(tmp_path.glob(".*"))  # no temporary sibling left
    with pytest.raises(ConfigError, match=r"is a directory of `jaxllm data prepare` \(token ids"):
        prepare([SourceConfig(path=str(out))], tmp_path / "again")


def test_damaged_manifest_is_refused(prepared, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    manifest = json.loads((out / "manifest.json").read_text())
    cfg = DataConfig(sources=(SourceConfig(path=str(out)),), seq_len=16, eval_fraction=0.1)
    for damage in ({"shards": [{"file": 3}]}, {"tokenizer": "byte"}, {"eval_fraction": None}):
        (out / "manifest.json").write_text(json.dumps({**manifest, **damage}))
        with pytest.raises(ConfigError, match="lacks the tokenizer, eval_fraction or shards"):
            load_splits(cfg)
    (out / "manifest.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a `jaxllm data prepare` manifest"):
        load_splits(cfg)


def test_truncated_shard_names_the_file(prepared, tmp_path):
    out, manifest = prepared
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / manifest["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cfg = DataConfig(sources=(SourceConfig(path=str(copy)),), seq_len=16, eval_fraction=0.1)
    with pytest.raises(ConfigError, match=rf"{shard.name} .*truncated"):
        load_splits(cfg)


def test_prepared_dir_must_match_tokenizer_and_eval_fraction(corpus, prepared, tmp_path):
    out, _ = prepared
    bpe = train_bpe(iter(["some text to learn from"] * 10), 270, tmp_path)
    src = (SourceConfig(path=str(out)),)
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: .* tokenized with 'byte'"):
        load_splits(DataConfig(sources=src, tokenizer=str(bpe), eval_fraction=0.1))
    with pytest.raises(ConfigError, match=r"data.eval_fraction must be 0.1, not 0.05"):
        load_splits(DataConfig(sources=src))
    # with eval_sources the prepared directory trains on all its documents, both splits
    train, _ = load_splits(DataConfig(sources=src, eval_sources=src, seq_len=16))
    assert train.num_docs == 70
    with pytest.raises(ConfigError, match=r"is a shard of the prepared directory"):
        load_splits(DataConfig(sources=(SourceConfig(path=str(out / "*.arrayrecord")),)))
