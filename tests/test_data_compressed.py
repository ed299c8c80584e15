"""Compressed sources: gzip and zstd files (told by their magic bytes) are read as the file
they hold, their format taken from the extension before `.gz` / `.zst`, in every format that
reads text or JSON lines; a damaged stream is one error naming the file."""

import gzip
import json

import pyarrow as pa
import pytest
from test_data_sources import DOCS, _read_all, texts_of, write_jsonl

from jaxllm.config import ConfigError


def _zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".zst", _zstd)])
def test_compressed_files_are_read_and_named_by_the_extension_before(tmp_path, suffix, compress):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    (tmp_path / f"a.jsonl{suffix}").write_bytes(compress((tmp_path / "a.jsonl").read_bytes()))
    (tmp_path / f"b.txt{suffix}").write_bytes(compress(DOCS[1].encode()))
    assert texts_of(tmp_path / f"a.jsonl{suffix}") == DOCS
    assert texts_of(tmp_path / f"b.txt{suffix}") == [DOCS[1]]
    pair = json.dumps({"prompt": "q", "completion": DOCS[0]}).encode()
    (tmp_path / f"c.jsonl{suffix}").write_bytes(compress(pair))
    assert _read_all(tmp_path / f"c.jsonl{suffix}", "prompt_completion")[0].text == "q" + DOCS[0]
    codec = "gzip" if suffix == ".gz" else "zstd"
    cut = (tmp_path / f"a.jsonl{suffix}").read_bytes()[:-12]
    for path in (f"cut.jsonl{suffix}", f"cut.txt{suffix}"):  # JSON lines streamed, text whole
        (tmp_path / path).write_bytes(cut)
        with pytest.raises(ConfigError, match=f"{path} is a damaged {codec} file"):
            texts_of(tmp_path / path)
