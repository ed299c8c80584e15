"""Tests of corpus sources: every format read back exactly, directories / globs / max_files, the
eval split, weighted mixtures, the promised errors and warnings on bad input, and encodings
(undecodable bytes repaired and counted in every JSON-lines format, UTF-16/32 and binary refused),
and .json files holding one array of records (compressed files: test_data_compressed.py).

Documents are tiny files written in tmp_path with the byte tokenizer, so a row's tokens can be
read back as text and compared with what was written.
"""

import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxllm import JaxllmWarning
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data.pipeline import MixtureRows, load_splits, train_batches
from jaxllm.data.sources import BadRecords, list_files, read_texts
from jaxllm.data.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
DOCS = ["first document\n", "zweites Dokument — ü", "third: 日本語 🙂", "4"]


def texts_of(path, **src) -> list[str]:
    files = list_files(SourceConfig(path=str(path), **src), "data.sources[0]")
    field = src.get("text_field", "text")
    return [t for f in files for t in read_texts(f, field)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_arrayrecord(path, records: list[bytes]):
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        writer.write(r)
    writer.close()


def docs_of(rows, bos=256, eos=257) -> list[str]:
    """The documents a byte-tokenized packer holds, recovered from its BOS/EOS marks."""
    tokens = rows.tokens.astype(np.int64)
    starts, ends = np.flatnonzero(tokens == bos), np.flatnonzero(tokens == eos)
    return [bytes(tokens[s + 1 : e].astype(np.uint8)).decode() for s, e in zip(starts, ends)]


# ------------------------------------------------------------------------- formats


def test_each_format_reads_back_exactly(tmp_path):
    (tmp_path / "text").mkdir()
    for i, doc in enumerate(DOCS):
        (tmp_path / "text" / f"{i}.txt").write_text(doc)
    write_jsonl(tmp_path / "a.jsonl", [{"body": d, "id": i} for i, d in enumerate(DOCS)])
    pq.write_table(pa.table({"body": DOCS, "n": [1, 2, 3, 4]}), tmp_path / "a.parquet")
    write_arrayrecord(tmp_path / "a.arrayrecord", [d.encode() for d in DOCS])

    assert texts_of(tmp_path / "text") == DOCS
    assert texts_of(tmp_path / "a.jsonl", text_field="body") == DOCS
    assert texts_of(tmp_path / "a.parquet", text_field="body") == DOCS
    assert texts_of(tmp_path / "a.arrayrecord") == DOCS
    # explicit format overrides the extension
    (tmp_path / "lines.data").write_text(json.dumps({"text": "x y"}) + "\n")
    assert texts_of(tmp_path / "lines.data", format="jsonl") == ["x y"]
    assert texts_of(tmp_path / "lines.data") == [json.dumps({"text": "x y"}) + "\n"]


def test_directory_glob_and_max_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "sub" / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / ".hidden").write_text("never read")
    files = list_files(SourceConfig(path=str(tmp_path)), "k")
    assert [(f.key, f.format) for f in files] == [("b.txt", "text"), ("sub/a.jsonl", "jsonl")]
    globbed = list_files(SourceConfig(path=str(tmp_path / "**" / "*.jsonl")), "k")
    assert [f.key for f in globbed] == ["sub/a.jsonl"]
    assert len(list_files(SourceConfig(path=str(tmp_path)), "k", max_files=1)) == 1


def test_source_rows_hold_the_documents_in_order(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    cfg = DataConfig(
        sources=(SourceConfig(path=str(tmp_path / "d.jsonl")),),
        eval_sources=(SourceConfig(path=str(tmp_path / "d.jsonl")),),
        seq_len=8,
    )
    train, held = load_splits(cfg)
    assert docs_of(train) == docs_of(held) == DOCS
    assert train.num_docs == len(DOCS) and train.num_tokens == sum(
        len(d.encode()) + 2 for d in DOCS
    )


def test_eval_fraction_holds_out_whole_files(tmp_path):
    for i in range(60):
        (tmp_path / f"{i:02d}.txt").write_text(f"file {i:02d} " * 4)
    cfg = DataConfig(sources=(SourceConfig(path=str(tmp_path)),), seq_len=8, eval_fraction=0.2)
    train, held = load_splits(cfg)
    assert train.num_docs + held.num_docs == 60 and 3 <= held.num_docs <= 24
    names = [d.split()[1] for d in docs_of(train)] + [d.split()[1] for d in docs_of(held)]
    assert sorted(names) == [f"{i:02d}" for i in range(60)]  # each file in exactly one split


def test_stdlib_format_decodes_like_python_and_the_default_corpus_is_clean(tmp_path):
    source = "# -*- coding: latin-1 -*-\nname = 'café'\n"
    (tmp_path / "m.py").write_bytes(source.encode("latin-1"))
    assert texts_of(tmp_path / "m.py", format="stdlib") == [source]
    as_text = BadRecords("k", "text")  # the text format knows no coding lines: é is replaced
    (file,) = list_files(SourceConfig(path=str(tmp_path / "m.py")), "k")
    assert list(read_texts(file, bad=as_text)) == [source.replace("é", "\ufffd")]
    assert as_text.replaced == 1
    # the default run reads every stdlib file without a single repair (no warning)
    bad = BadRecords("data.sources[0]", "text")
    files = list_files(SourceConfig(path="stdlib"), "data.sources[0]")
    assert sum(1 for f in files for _ in read_texts(f, bad=bad)) > 1000
    assert (bad.records, bad.replaced) == (0, 0)


# ------------------------------------------------------------------------- mixtures


@pytest.fixture
def two_sources(tmp_path):
    for name, char in (("a", "a"), ("b", "b")):
        (tmp_path / name).mkdir()
        for i in range(20):
            (tmp_path / name / f"{i}.txt").write_text(char * (30 + 7 * i))

    def cfg(seed=0, weights=(1.0, 3.0)):
        sources = tuple(
            SourceConfig(path=str(tmp_path / n), weight=w) for n, w in zip("ab", weights)
        )
        return DataConfig(sources=sources, eval_sources=sources, seq_len=16, seed=seed)

    return cfg


def source_of(row) -> str:
    chars = set(row["inputs"].tolist()) - {256, 257}
    assert len(chars) == 1, "a row never mixes sources"
    return chr(chars.pop())


def test_mixture_weights_are_respected_and_deterministic(two_sources):
    train, _ = load_splits(two_sources())
    assert isinstance(train, MixtureRows)
    a_rows, b_rows = (len(p) for p in train.parts)
    # one pass shows every row of the under-weighted source `a` once: len(a) / (1/4) rows
    assert len(train) == 4 * a_rows
    counts = {"a": 0, "b": 0}
    for i in range(len(train)):
        counts[source_of(train[i])] += 1
    assert counts["b"] / len(train) == pytest.approx(0.75, abs=0.01)
    # the shuffled stream keeps the proportion over a window much shorter than a pass
    it = train_batches(train, two_sources(), batch_size=20)
    seen = [source_of({"inputs": r}) for _ in range(40) for r in next(it)["inputs"]]
    assert seen.count("b") / len(seen) == pytest.approx(0.75, abs=0.05)
    assert b_rows < len(train) * 0.75  # so source b repeats (a new permutation each pass)

    again, _ = load_splits(two_sources())
    other, _ = load_splits(two_sources(seed=1))
    first = [again[i]["inputs"] for i in range(50)]
    assert all(np.array_equal(train[i]["inputs"], first[i]) for i in range(50))
    assert any(not np.array_equal(other[i]["inputs"], first[i]) for i in range(50))
    with pytest.raises(IndexError):
        train[len(train)]


def test_mixture_rejects_non_positive_weights(two_sources):
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight must be positive"):
        load_splits(two_sources(weights=(1.0, 0.0)))


# ------------------------------------------------------------------------- bad input


def test_missing_path_and_empty_matches_name_the_key(tmp_path):
    def load(path):
        load_splits(DataConfig(sources=(SourceConfig(path=str(path)),)))

    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: .*nope does not exist"):
        load(tmp_path / "nope")
    two = (SourceConfig(path="stdlib"), SourceConfig(path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match=r"data.sources\[1\].path: .*nope does not exist"):
        load_splits(DataConfig(sources=two, max_files=40))
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: .*\*.jsonl matches no files"):
        load(tmp_path / "*.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path: directory .*empty holds no"):
        load(tmp_path / "empty")
    for i in range(3):
        (tmp_path / "empty" / f"{i}.txt").write_text("")
    with pytest.raises(ConfigError, match=r"the 3 file\(s\) of .*empty hold no documents \(they"):
        load(tmp_path / "empty")


def test_bad_jsonl_lines_and_undecodable_bytes_give_one_warning(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(
        b'{"text": "good one"}\nnot json\n{"other": 1}\n\n{"text": 5}\n{"text": "good two"}\n'
    )
    (tmp_path / "t.txt").write_bytes(b"caf\xe9 and \xff\xfe bytes")
    src = SourceConfig(path=str(tmp_path))
    cfg = DataConfig(sources=(src,), eval_sources=(src,), seq_len=8)
    with pytest.warns(JaxllmWarning) as record:
        train, _ = load_splits(cfg)
    train_warnings = [str(w.message) for w in record if "data.sources[0]" in str(w.message)]
    assert len(train_warnings) == 1
    msg = train_warnings[0]
    assert "skipped 3 record(s)" in msg and "d.jsonl line 2" in msg
    assert "replaced 3 undecodable byte sequence(s) with U+FFFD in 1 file(s)" in msg
    assert docs_of(train) == ["good one", "good two", "caf\ufffd and \ufffd\ufffd bytes"]


def test_on_bad_record_fail_names_file_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"txt": "typo"}\n')
    src = SourceConfig(path=str(tmp_path / "d.jsonl"))
    cfg = DataConfig(sources=(src,), eval_sources=(src,), on_bad_record="fail")
    with pytest.raises(ConfigError, match=r"d.jsonl line 3 has no string field 'text'"):
        load_splits(cfg)
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ConfigError, match=r"d.jsonl line 2 is not valid JSON"):
        load_splits(cfg)


def test_parquet_without_the_column_and_corrupt_arrayrecord(tmp_path):
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"a.parquet has no column 'text' \(columns: content\)"):
        texts_of(tmp_path / "a.parquet")
    write_arrayrecord(tmp_path / "r.arrayrecord", [b"x" * 1000] * 200)
    data = (tmp_path / "r.arrayrecord").read_bytes()
    (tmp_path / "r.arrayrecord").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"ArrayRecord file .*r.arrayrecord is truncated"):
        texts_of(tmp_path / "r.arrayrecord")


def test_bad_records_warn_is_silent_when_clean():
    BadRecords("data.sources[0]", "text").warn()  # pytest turns a JaxllmWarning into an error


# ------------------------------------------------------------------------- encodings

LATIN1 = {  # one record of each JSON-lines format, with accents that Latin-1 writes as one byte
    "jsonl": {"text": "café crème"},
    "chat": {
        "messages": [{"role": "user", "content": "¿qué?"}, {"role": "assistant", "content": "sí"}]
    },
    "prompt_completion": {"prompt": "Grüße ", "completion": "aus Köln"},
    "preference": {"prompt": "Grüße ", "chosen": "aus Köln", "rejected": "aus Zürich"},
    "rollout": {"prompt": "Grüße aus ", "answer": "Köln"},
}


def _read_all(path, fmt: str) -> list:
    """Everything a source of `fmt` reads from `path`; its one warning is issued."""
    from jaxllm.data import preference, rollout, sft

    src = SourceConfig(path=str(path), format=fmt)
    if fmt == "rollout":  # reads whole sources and warns itself
        return [p.prompt + p.answer for p in rollout.read_prompts([src], DataConfig(), BYTES)[0]]
    (f,) = list_files(src, "k")
    bad = BadRecords("k")
    if fmt == "jsonl":
        read = list(read_texts(f, bad=bad))
    elif fmt == "preference":
        read = list(preference.read_pairs(f, src, BYTES, bad=bad))
    else:
        read = list(sft.read_examples(f, src, BYTES, bad=bad))
    bad.warn()
    return read


@pytest.mark.parametrize("fmt", list(LATIN1))
def test_every_json_lines_format_repairs_undecodable_bytes_and_counts_them(tmp_path, fmt):
    line = json.dumps(LATIN1[fmt], ensure_ascii=False) + "\n"
    (tmp_path / "l.jsonl").write_bytes((line * 3).encode("latin-1"))
    with pytest.warns(JaxllmWarning) as seen:
        read = _read_all(tmp_path / "l.jsonl", fmt)
    assert len(read) == 3 and "\ufffd" in str(read[0])
    (message,) = [str(w.message) for w in seen]
    assert "skipped" not in message
    assert "undecodable byte sequence(s) with U+FFFD in 1 file(s) (first: " in message
    assert f"{tmp_path}/l.jsonl line 1; text is read as UTF-8" in message


def texts_of_bad(path, bad) -> list[str]:
    (f,) = list_files(SourceConfig(path=str(path)), "k")
    return list(read_texts(f, bad=bad))


def test_lone_surrogates_bom_and_files_counted_once(tmp_path):
    lines = [r'{"text": "a\ud800b \ud83d\ude00"}', r'{"text": "\uDFFF"}', '{"text": "ok"}']
    (tmp_path / "s.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    bad = BadRecords("k")
    assert texts_of_bad(tmp_path / "s.jsonl", bad) == ["a\ufffdb \U0001f600", "\ufffd", "ok"]
    assert (bad.surrogates, bad.replaced) == (2, 0)
    assert bad.first_surrogate == f"{tmp_path}/s.jsonl line 1"
    write_arrayrecord(tmp_path / "r.arrayrecord", [b"caf\xe9", b"ok", b"\xff"])
    bad = BadRecords("k")
    assert texts_of_bad(tmp_path / "r.arrayrecord", bad) == ["caf\ufffd", "ok", "\ufffd"]
    assert (bad.replaced, bad.files_replaced) == (2, 1)
    assert bad.first_replaced == f"{tmp_path}/r.arrayrecord record 1"


def test_wide_encodings_and_binary_records_are_refused(tmp_path):
    (tmp_path / "w.txt").write_text("windows text", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"w.txt is UTF-16 .*iconv -f UTF-16 -t UTF-8"):
        texts_of(tmp_path / "w.txt")
    (tmp_path / "w.jsonl").write_text('{"text": "x"}\n', encoding="utf-32")
    with pytest.raises(ConfigError, match=r"w.jsonl is UTF-32"):
        texts_of(tmp_path / "w.jsonl")
    ids = np.arange(300, dtype="<i4").tobytes()  # token ids, as `data prepare` writes them
    write_arrayrecord(tmp_path / "ids.arrayrecord", [b"text", ids])
    with pytest.raises(
        ConfigError, match=r"record 2 of ArrayRecord file .*ids.arrayrecord holds NUL"
    ):
        texts_of(tmp_path / "ids.arrayrecord")


def test_binary_files_are_refused_not_read_as_text(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("text")
    (tmp_path / "d" / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ConfigError, match=r"photo.png holds NUL bytes, so it is binary"):
        texts_of(tmp_path / "d")


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_file_holding_one_array_gives_its_records(tmp_path, indent):
    records = [{"text": d} for d in DOCS] + [{"other": 1}]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=indent))
    bad = BadRecords("k")
    assert texts_of_bad(tmp_path / "a.json", bad) == DOCS
    assert bad.first_record == f"{tmp_path}/a.json record 5 has no string field 'text' " + (
        "(set the source's text_field)"
    )
    pairs = [{"prompt": "q", "completion": d} for d in DOCS]
    (tmp_path / "p.json").write_text(json.dumps(pairs, indent=indent))
    assert [e.text for e in _read_all(tmp_path / "p.json", "prompt_completion")] == [
        "q" + d for d in DOCS
    ]
    (tmp_path / "cut.json").write_text(json.dumps(pairs, indent=indent)[:-5])
    with pytest.raises(ConfigError, match=r"cut.json starts a JSON array but is not valid JSON"):
        texts_of(tmp_path / "cut.json")


@pytest.mark.parametrize(
    "record, fmt",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ({"conversations": [], "id": 1}, "chat"),
        ({"instruction": "a", "input": "", "output": "b"}, "chat"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"prompt": "a", "chosen": "b", "rejected": "c"}, "preference"),
        ({"prompt": "a", "completion": "b", "label": True}, "unpaired_preference"),
    ],
)
def test_records_of_another_format_fail_in_one_line_naming_it(tmp_path, record, fmt):
    write_jsonl(tmp_path / "a.jsonl", [record] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reason is in the error, not in a warning before it
        with pytest.raises(ConfigError) as e:
            # format: jsonl: auto reads plain chats and pairs as such (tests/test_data_detect.py)
            src = SourceConfig(path=str(tmp_path / "a.jsonl"), format="jsonl")
            load_splits(DataConfig(sources=(src,)))
    assert "hold no documents: skipped 3 record(s)" in str(e.value)
    assert f"line 1 has no string field 'text' (set the source's text_field, or format: {fmt}," in (
        str(e.value)
    )
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=f"has no column 'text' .*, or format: {fmt},"):
        texts_of(tmp_path / "a.parquet")
