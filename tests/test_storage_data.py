"""Data from a bucket (moto's S3 server, `tests/objectstore.py`): every format reads the same
documents with the same held-out split as the same files on disk (split keys are paths below
the source root), a prepared directory too, and `jaxllm data prepare --out s3://...` publishes
its manifest last and refuses a finished output without --overwrite."""

from __future__ import annotations

import json

import pytest
from test_one_file_dataset import SUFFIX, _records, _split, _write

from jaxllm import storage
from jaxllm.cli import main
from jaxllm.config import SourceConfig
from jaxllm.data.sources import list_files

FORMATS = ["jsonl", "parquet", "arrayrecord", "chat", "prompt_completion", "preference", "rollout"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bucket_source_reads_and_splits_as_on_disk(s3_env, tmp_path, fmt):
    local = tmp_path / "data"
    local.mkdir()
    suffix = SUFFIX.get(fmt, ".jsonl")
    for i in range(8):  # several files: the file split; one file: the record split
        _write(local / f"part{i}{suffix}", fmt, _records(fmt, 10 * i, 10 * i + 10))
    url = s3_env.bucket() + "/corpus"
    storage.publish(local, url, "k")
    train, held = _split(url, fmt, 0.3)
    assert train and held and (train, held) == _split(local, fmt, 0.3)
    one = f"{url}/part0{suffix}"
    assert _split(one, fmt) == _split(local / f"part0{suffix}", fmt)


def test_file_keys_are_the_same_in_a_bucket(s3_env, tmp_path):
    local = tmp_path / "data"
    (local / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "b.txt", "sub/c.jsonl", ".hidden"):
        (local / name).write_text(json.dumps({"text": name}) + "\n")
    url = s3_env.bucket() + "/corpus"
    storage.publish(local, url, "k")

    def keys(path):
        return [(f.key, f.format) for f in list_files(SourceConfig(path=path), "data.sources[0]")]

    assert (
        keys(url)
        == keys(str(local))
        == [
            ("a.jsonl", "jsonl"),
            ("b.txt", "text"),
            ("sub/c.jsonl", "jsonl"),
        ]
    )
    assert keys(f"{url}/**/*.jsonl") == keys(f"{local}/**/*.jsonl")


def test_prepare_to_a_bucket_and_read_it_back(s3_env, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(80)))
    bucket = s3_env.bucket()
    out = f"{bucket}/prepared"
    assert main(["data", "prepare", str(src), "--out", out, "--eval-fraction", "0.1"]) == 0
    keys = s3_env.keys(out)
    assert "prepared/manifest.json" in keys and len(keys) > 1
    local = storage.fetch(out, "k")
    manifest = json.loads((local / "manifest.json").read_text())
    assert manifest["docs"] == 80

    # a finished output is refused without --overwrite, and left as it was
    before = {k: s3_env.client().head_object(Bucket=bucket[5:], Key=k)["ETag"] for k in keys}
    assert main(["data", "prepare", str(src), "--out", out]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert {k: s3_env.client().head_object(Bucket=bucket[5:], Key=k)["ETag"] for k in keys} == (
        before
    )
    # an upload that left no manifest is replaced without asking
    s3_env.client().delete_object(Bucket=bucket[5:], Key="prepared/manifest.json")
    assert main(["data", "prepare", str(src), "--out", out, "--eval-fraction", "0.1"]) == 0
    assert "prepared/manifest.json" in s3_env.keys(out)

    # the prepared directory in the bucket reads as the local one
    from jaxllm.config import DataConfig
    from jaxllm.data import pipeline
    from jaxllm.data.tokenizer import make_tokenizer

    def docs(path):
        s = SourceConfig(path=path)
        cfg = DataConfig(sources=(s,), seq_len=32, eval_fraction=0.1)
        tr, ev = pipeline._source_documents(s, "data.sources[0]", cfg, make_tokenizer(cfg), True)
        return [d.tolist() for d in tr], [d.tolist() for d in ev]

    assert docs(out) == docs(str(local)) and docs(out)[1]


def test_a_tokenizer_in_a_bucket(s3_env, tmp_path):
    """data.tokenizer / --tokenizer as a URL of a tokenizer.json (or its directory): the same
    ids and fingerprint as the local file, its tokenizer_config.json read beside it."""
    from jaxllm.data import train_bpe
    from jaxllm.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    local = train_bpe(["def f(x):\n    return x + 1\n"] * 40, 300, tmp_path / "tok")
    (local.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    url = s3_env.bucket() + "/tok"
    storage.publish(local.parent, url, "k")
    text = "def g(y): return y"
    for spec in (f"{url}/tokenizer.json", url):
        tok = load_tokenizer(spec)
        assert list(tok.encode(text)) == list(load_tokenizer(str(local)).encode(text))
        assert tokenizer_fingerprint(spec) == tokenizer_fingerprint(str(local))
        assert (storage.local_cache(url) / "tokenizer_config.json").is_file()
