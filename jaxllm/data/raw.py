"""Bytes of text and JSON-lines files before they are records: gzip read transparently, byte
order marks of UTF-16/32 and binary files refused, lone surrogates of JSON escapes replaced.

A file whose first bytes are gzip's or zstd's magic is decompressed whatever its name
(`corpus.jsonl.gz`, `book.txt.gz`, `pile.jsonl.zst`). A file with a UTF-16/32 byte-order mark is refused (read as UTF-8 it would pass
as text with a NUL between letters), and so is a text file holding NUL bytes: binary (an
archive, an image, token ids), which read as text would train on noise.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from jaxllm.config import ConfigError

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_WIDE_BOMS = {  # byte-order marks of encodings that UTF-8 would misread without an error
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _codec(head: bytes) -> str | None:
    """The compression a file's first bytes announce: gzip, zstd, or None."""
    return (
        "gzip" if head.startswith(GZIP_MAGIC) else "zstd" if head.startswith(ZSTD_MAGIC) else None
    )


def _damaged(path: Path, codec: str, e: Exception) -> ConfigError:
    return ConfigError(f"{path} is a damaged {codec} file ({e}); re-compress or replace it.")


_ERRORS = (OSError, EOFError, ValueError, zlib.error)  # pyarrow's ArrowInvalid is a ValueError


def read_bytes(path: Path) -> bytes:
    """The bytes of a text or JSON-lines file, decompressed when it is gzip or zstd (by its magic
    bytes, whatever its name); ConfigError naming the file when the stream is damaged."""
    data = path.read_bytes()
    codec = _codec(data[:4])
    if codec is None:
        return data
    try:
        if codec == "gzip":
            return gzip.decompress(data)
        import pyarrow as pa

        return pa.CompressedInputStream(pa.BufferReader(data), codec).read()
    except _ERRORS as e:
        raise _damaged(path, codec, e) from e


def lines(path: Path) -> Iterator[bytes]:
    """The lines of a file, streamed and decompressed as `read_bytes` does."""
    with open(path, "rb") as raw:
        codec = _codec(raw.read(4))
        raw.seek(0)
        try:
            if codec == "gzip":
                yield from gzip.GzipFile(fileobj=raw)
            elif codec == "zstd":
                import pyarrow as pa

                yield from io.BufferedReader(pa.CompressedInputStream(pa.PythonFile(raw), codec))
            else:
                yield from raw
        except _ERRORS as e:
            raise _damaged(path, codec, e) from e


def refuse_wide(head: bytes, path: Path) -> None:
    """ConfigError when `head` (a file's first bytes) is a UTF-16/32 byte-order mark."""
    for bom, encoding in _WIDE_BOMS.items():
        if head.startswith(bom):
            raise ConfigError(
                f"{path} is {encoding} (it starts with a {encoding} byte-order mark); sources "
                f"are read as UTF-8: convert it (iconv -f {encoding} -t UTF-8)."
            )


def refuse_binary(data: bytes, path: Path) -> None:
    """ConfigError when a text file holds NUL bytes: binary (an archive, an image, token ids),
    which read as text would train on noise."""
    if b"\0" in data:
        raise ConfigError(
            f"{path} holds NUL bytes, so it is binary, not UTF-8 text; remove it from the "
            "source (text, JSON lines, .parquet and .arrayrecord are read; a .gz file is "
            "decompressed)."
        )


def no_surrogates(value, count: list[int]):
    """`value` (parsed JSON) with lone surrogates replaced by U+FFFD, counted in `count[0]`."""
    if isinstance(value, str):
        fixed, n = _SURROGATE.subn("\ufffd", value)
        count[0] += n
        return fixed
    if isinstance(value, list):
        return [no_surrogates(v, count) for v in value]
    if isinstance(value, dict):
        return {no_surrogates(k, count): no_surrogates(v, count) for k, v in value.items()}
    return value


def has_surrogate_escape(raw: bytes) -> bool:
    return b"\\u" in raw and re.search(rb"\\u[dD][89a-fA-F]", raw) is not None


def repaired(value, surrogates: bool, where: str, bad):  # bad: sources.BadRecords
    """`value` with lone surrogates replaced by U+FFFD and counted in `bad`, when its JSON
    `surrogates` (held an escape of one)."""
    if surrogates:
        count = [0]
        value = no_surrogates(value, count)
        if count[0]:
            bad.lone_surrogates(count[0], where)
    return value
