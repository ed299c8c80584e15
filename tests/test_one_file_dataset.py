"""One file is a dataset: a source with too few files for `data.eval_fraction` holds out records
(by a hash of file key and record index, stable under appends) in every format, multi-file
sources keep their file split, `data.eval_fraction=0` trains without evaluation, and an eval
split smaller than a batch is evaluated on one padded batch whose padding no objective counts."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import pipeline, preference, sft
from jaxllm.data.prepare import prepare
from jaxllm.data.sources import TEXT_RECORD_LINES, held_out, list_files
from jaxllm.data.tokenizer import make_tokenizer

# ------------------------------------------------------------------------- the split rule


def _records(fmt: str, start: int, stop: int) -> list:
    """Records start .. stop - 1 of a file of format `fmt`, each unique."""
    if fmt in ("jsonl", "parquet", "arrayrecord"):
        return [{"text": f"document {i} " * 3} for i in range(start, stop)]
    if fmt == "chat":
        return [
            {
                "messages": [
                    {"role": "user", "content": f"q{i}"},
                    {"role": "assistant", "content": f"a{i}"},
                ]
            }
            for i in range(start, stop)
        ]
    if fmt == "prompt_completion":
        return [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(start, stop)]
    assert fmt == "preference"
    return [
        {"prompt": f"q{i}", "chosen": f" y{i}", "rejected": f" n{i}"} for i in range(start, stop)
    ]


def _write(path, fmt: str, records: list) -> None:
    if fmt == "parquet":
        pq.write_table(pa.table({"text": [r["text"] for r in records]}), path)
    elif fmt == "arrayrecord":
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for r in records:
            writer.write(r["text"].encode())
        writer.close()
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _seqs(docs) -> list[tuple]:
    """The documents `_source_documents` returns, as comparable tuples of ids."""
    if isinstance(docs, sft.Examples):
        return [tuple(t.tolist()) for t in docs.tokens]
    if isinstance(docs, preference.Pairs):
        return [
            tuple(c.tolist()) + (-1,) + tuple(r.tolist())
            for (c, _), (r, _) in zip(docs.chosen, docs.rejected)
        ]
    return [tuple(np.asarray(d).tolist()) for d in docs]


def _split(path, fmt: str, fraction: float = 0.2):
    src = SourceConfig(path=str(path), format=fmt)
    cfg = DataConfig(sources=(src,), seq_len=32, eval_fraction=fraction)
    train, held = pipeline._source_documents(src, "data.sources[0]", cfg, make_tokenizer(cfg), True)
    return _seqs(train), _seqs(held)


SUFFIX = {"parquet": ".parquet", "arrayrecord": ".arrayrecord"}


@pytest.mark.parametrize(
    "fmt", ["jsonl", "parquet", "arrayrecord", "chat", "prompt_completion", "preference"]
)
def test_one_file_holds_out_records_stable_under_appends(tmp_path, fmt):
    path = tmp_path / f"data{SUFFIX.get(fmt, '.jsonl')}"
    _write(path, fmt, _records(fmt, 0, 60))
    train, held = _split(path, fmt)
    assert len(train) + len(held) == 60 and 3 <= len(held) <= 25
    assert not set(train) & set(held)
    _write(path, fmt, _records(fmt, 0, 90))  # records appended: the first 60 keep their side
    train2, held2 = _split(path, fmt)
    assert train2[: len(train)] == train and held2[: len(held)] == held
    assert len(train2) + len(held2) == 90


def test_one_text_file_holds_out_blocks_of_lines(tmp_path):
    path = tmp_path / "book.txt"
    lines = [f"line {i}\n" for i in range(30 * TEXT_RECORD_LINES)]
    path.write_text("".join(lines))

    def sides(fraction=0.2):
        src = SourceConfig(path=str(path))
        cfg = DataConfig(sources=(src,), seq_len=32, eval_fraction=fraction, tokenizer="byte")
        tok = make_tokenizer(cfg)
        docs = pipeline._source_documents(src, "data.sources[0]", cfg, tok, True)
        return [{ln for d in side for ln in tok.decode(d).splitlines()} for side in docs]

    train, held = sides()
    assert train and held and not train & held and len(train | held) == len(lines)
    path.write_text("".join(lines) + "".join(f"more {i}\n" for i in range(500)))
    train2, held2 = sides()
    assert train <= train2 and held <= held2


def test_multi_file_sources_keep_their_file_split(tmp_path):
    # pinned: these 20 files at eval_fraction=0.2 held out these 5 files before records could be
    for i in range(20):
        (tmp_path / f"f{i:02d}.jsonl").write_text(json.dumps({"text": f"file {i}"}) + "\n")
    files = list_files(SourceConfig(path=str(tmp_path)), "data.sources[0]")
    assert [f.key for f in files if held_out(f.key, 0.2)] == PINNED
    train, held = _split(tmp_path, "jsonl")
    tok = make_tokenizer(DataConfig())
    held_files = sorted(tok.decode(np.asarray(d)) for d in held)
    assert held_files == sorted(f"file {int(k[1:3])}" for k in PINNED)
    assert len(train) == 20 - len(PINNED)


PINNED = ["f01.jsonl", "f02.jsonl", "f09.jsonl", "f15.jsonl", "f16.jsonl"]


def test_too_few_records_is_one_config_error(tmp_path):
    path = tmp_path / "two.jsonl"
    _write(path, "jsonl", _records("jsonl", 0, 2))
    with pytest.raises(ConfigError, match="leaves .* records of the 1 file"):
        _split(path, "jsonl", 0.05)


def test_a_prepared_file_splits_as_training_splits_it(tmp_path):
    path = tmp_path / "data.jsonl"
    _write(path, "jsonl", _records("jsonl", 0, 60))
    manifest = prepare([SourceConfig(path=str(path))], tmp_path / "prep", eval_fraction=0.2)
    assert manifest["splits"]["eval"]["docs"] > 0
    assert _split(tmp_path / "prep", "auto") == _split(path, "jsonl")
