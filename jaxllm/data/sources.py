"""Corpus sources: which files a `SourceConfig` names, and the documents (texts) in each file.

A source path is `stdlib` (the running Python's standard-library sources: every machine has them,
so the default run downloads nothing), a directory (read recursively, hidden entries skipped), a
glob, or one file. Each file's format comes from `SourceConfig.format` or, for `auto`, from its
extension (`.gz` / `.zst` files by the one before it: `corpus.jsonl.gz` is jsonl). One
document is:

    text, stdlib   the whole file (stdlib files decode with their PEP 263 coding line)
    jsonl          the `text_field` string of each line
    parquet, csv   the `text_field` string of each row (.parquet; .csv / .tsv; also arrow:
                   `jaxllm.data.tables`)
    arrayrecord    each record, as UTF-8 text (tokenized shards are read via their directory)

The SFT formats `chat` and `prompt_completion` are read into examples by `jaxllm.data.sft`, the
preference and rollout formats by their modules; JSON lines of every format through `json_lines`.

Text is UTF-8. Undecodable bytes become U+FFFD and are counted, in text files and JSON lines alike
(a JSON line's structure is ASCII, so only its strings change), as are JSON escapes of lone
surrogates, which no tokenizer can encode. A file that starts with a UTF-16/32 byte-order
mark is refused (read as UTF-8 it would pass as text with a NUL between letters), and so are a
text file and an ArrayRecord record holding NUL bytes: binary, not text (an archive, a
serialized proto, token ids). Gzip'd text and JSON lines are decompressed (`jaxllm.data.raw`).
A JSON-lines file whose first line opens an array (a `.json` file holding one array of records,
as Alpaca ships) is read as that array, one record per element.

The shards of `jaxllm data prepare` (`train-NNNNN.arrayrecord`, `eval-NNNNN.arrayrecord`) are
token ids, never text: beside their manifest they are read via their directory
(`jaxllm.data.prepare.PreparedDir`); without it (a preparation that did not finish, or a
manifest removed) they are refused.

A file's `key` is what the eval split hashes (`jaxllm.data.split`). Bad records are counted in a
`BadRecords` and reported in one warning per source.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import re
import sysconfig
import tokenize
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from jaxllm import storage
from jaxllm.config import ConfigError, JaxllmWarning, SourceConfig
from jaxllm.data import raw, tables

MANIFEST = "manifest.json"  # marks a directory written by `jaxllm data prepare`
SHARD_NAME = re.compile(r"(train|eval)-\d{5}\.arrayrecord")  # the shards `prepare` writes
_FORMAT_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    **tables.FORMATS,
    ".arrayrecord": "arrayrecord",
    ".array_record": "arrayrecord",
}


@dataclasses.dataclass(frozen=True)
class DataFile:
    path: Path
    format: str
    key: str
    """Path relative to the source root: what the eval split hashes."""


def format_of(path: Path) -> str:
    """The format `auto` reads `path` as, by its extension (a `.gz` / `.zst` file by the one
    before)."""
    suffixes = path.suffixes[-2:] if path.suffix in (".gz", ".zst") else path.suffixes[-1:]
    return _FORMAT_BY_SUFFIX.get(suffixes[0] if suffixes else "", "text")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The standard library's .py files (no site-packages, no caches), sorted by path."""
    files = []
    for parent, dirs, names in os.walk(stdlib_root()):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "__pycache__")]  # prune early
        files += [Path(parent, n) for n in names if n.endswith(".py")]
    files = sorted(p for p in files if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {stdlib_root()}")
    return files[:max_files] if max_files else files


def is_prepared_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _glob_root(pattern: str) -> Path:
    """The directory before the first wildcard: keys of globbed files are relative to it."""
    parts = Path(pattern).parts
    first_wildcard = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:first_wildcard]) if first_wildcard else Path(".")


def fetched(src: SourceConfig, key: str) -> SourceConfig:
    """`src` with a `gs://` / `s3://` path replaced by its local copy (`jaxllm.storage.fetch`:
    the object, the prefix as a directory, or the glob's objects, in the cache). Keys relative
    to the source root are the same as the bucket's, so the held-out split does not move."""
    if not storage.is_url(src.path):
        return src
    at = key if key == "SOURCE" else f"{key}.path"  # a command's argument, or a config key
    return dataclasses.replace(src, path=str(storage.fetch(src.path, at)))


def list_files(src: SourceConfig, key: str, max_files: int | None = None) -> list[DataFile]:
    """The files of a source, sorted by path, at most `max_files`; ConfigError (naming `key`,
    e.g. `data.sources[0]`, or `SOURCE`: a command's argument) when the path is missing or
    matches no file. A URL is read from
    its local copy (`fetched`)."""
    src = fetched(src, key)
    at = key if key == "SOURCE" else f"{key}.path"  # a command's argument, or a config key
    if src.path == "stdlib":
        fmt = "stdlib" if src.format == "auto" else src.format
        root = stdlib_root()
        return [DataFile(p, fmt, p.relative_to(root).as_posix()) for p in stdlib_files(max_files)]
    path = Path(src.path).expanduser()
    if is_prepared_dir(path):  # training reads it whole (PreparedDir); it holds no text files
        raise ConfigError(
            f"{at}: {src.path} is a directory of `jaxllm data prepare` (token ids, not "
            f"text); train on it with data.sources=[{{path: {src.path}}}], or give here the "
            "files it was prepared from."
        )
    if glob.has_magic(src.path):
        root = _glob_root(str(path))
        paths = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not paths:
            raise ConfigError(f"{at}: {src.path} matches no files; check the pattern.")
    elif path.is_dir():
        root = path
        paths = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and not any(s.startswith(".") for s in p.relative_to(path).parts)
            and not tables.is_datasets_metadata(p)
        )
        if not paths:
            raise ConfigError(f"{at}: directory {src.path} holds no files.")
    elif path.is_file():
        root, paths = path.parent, [path]
    else:
        raise ConfigError(
            f"{at}: {src.path} does not exist; give a directory, a glob, a file, or stdlib."
        )
    files = []
    for p in paths[:max_files] if max_files else paths:
        fmt = src.format if src.format != "auto" else format_of(p)
        if (fmt == "arrayrecord" or SHARD_NAME.fullmatch(p.name)) and is_prepared_dir(p.parent):
            raise ConfigError(
                f"{at}: {p} is a shard of the prepared directory {p.parent}; set the path "
                "to that directory so its manifest (tokenizer, split) is used."
            )
        if SHARD_NAME.fullmatch(p.name):
            raise ConfigError(
                f"{at}: {p} is a shard of `jaxllm data prepare` (token ids, not text) but "
                f"{p.parent} has no manifest.json: that preparation did not finish or its "
                "manifest was removed; re-run `jaxllm data prepare`."
            )
        files.append(DataFile(p, fmt, p.relative_to(root).as_posix()))
    return files


def refuse_output_over(out: Path, paths: Sequence[Path], flag: str) -> None:
    """ConfigError when the output directory `out` holds one of the source files `paths`: an
    overwrite would replace the sources with their own output."""
    inside = next((p for p in paths if p.resolve().is_relative_to(out.resolve())), None)
    if inside is not None:
        raise ConfigError(
            f"{flag} {out} would replace SOURCE file {inside}, which it holds; write the "
            "output outside the sources."
        )


class BadRecords:
    """Counts what was skipped or repaired while reading one source; `warn` reports it once.
    `expected` says what a good record is (default: a JSON object with the text field)."""

    def __init__(self, key: str, text_field: str = "text", expected: str | None = None):
        self.key, self.text_field = key, text_field
        self.expected = expected or f"JSON objects with a string field {text_field!r}"
        self.records, self.first_record = 0, ""
        self.replaced, self.first_replaced = 0, ""
        self._files_replaced: set[Path] = set()
        self.surrogates, self.first_surrogate = 0, ""

    @property
    def files_replaced(self) -> int:
        return len(self._files_replaced)

    def record(self, where: str) -> None:
        self.records += 1
        self.first_record = self.first_record or where

    def repaired(self, path: Path, count: int, where: str = "") -> None:
        """`count` undecodable byte sequences replaced by U+FFFD in `path` (at `where`)."""
        self.replaced += count
        self._files_replaced.add(path)
        self.first_replaced = self.first_replaced or where or str(path)

    def lone_surrogates(self, count: int, where: str) -> None:
        """`count` JSON escapes of lone surrogates replaced by U+FFFD at `where`."""
        self.surrogates += count
        self.first_surrogate = self.first_surrogate or where

    def warn(self) -> None:
        if self.summary():
            warnings.warn(f"{self.key}: {self.summary()}.", JaxllmWarning, stacklevel=3)

    def summary(self) -> str:
        """What was skipped or repaired, in words; "" when nothing was."""
        parts = []
        if self.records:
            parts.append(
                f"skipped {self.records} record(s) that are not {self.expected} "
                f"(first: {self.first_record})"
            )
        if self.replaced:
            parts.append(
                f"replaced {self.replaced} undecodable byte sequence(s) with U+FFFD in "
                f"{self.files_replaced} file(s) (first: {self.first_replaced}; text is read as "
                "UTF-8, so convert a file in another encoding: iconv -f LATIN1 -t UTF-8)"
            )
        if self.surrogates:
            parts.append(
                f"replaced {self.surrogates} JSON escape(s) of a lone surrogate (half a UTF-16 "
                f"pair, not text) with U+FFFD (first: {self.first_surrogate})"
            )
        return " and ".join(parts)


def _decode(data: bytes, path: Path, bad: BadRecords, where: str = "") -> str:
    """`data` as UTF-8, undecodable bytes replaced by U+FFFD and counted in `bad`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        bad.repaired(path, text.count("\ufffd") - data.count("\ufffd".encode()), where)
        return text


def json_lines(f: DataFile, on_bad_record: str, bad: BadRecords) -> Iterator[tuple[str, object]]:
    """(where, value) of each non-blank line of a JSON-lines file (gzip'd or not), `where` its
    file and line; a file holding one JSON array of records (a `.json` file as Alpaca and
    LLaMA-Factory ship it) gives each element, `where` its file and record number. Bytes that
    are not UTF-8 and escapes of lone surrogates become U+FFFD, counted in `bad` (as for text
    files); a line that is not JSON is a bad record."""
    for number, line in enumerate(raw.lines(f.path), 1):
        if number == 1:
            raw.refuse_wide(line, f.path)
            line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if line.lstrip().startswith(b"["):  # every format's records are objects
                yield from _json_array(f, bad)
                return
        if not line.strip():
            continue
        where = f"{f.path} line {number}"
        try:
            value = json.loads(_decode(line, f.path, bad, where))
        except ValueError:
            _bad_record("is not valid JSON", where, on_bad_record, bad)
            continue
        yield where, raw.repaired(value, raw.has_surrogate_escape(line), where, bad)


def _json_array(f: DataFile, bad: BadRecords) -> Iterator[tuple[str, object]]:
    """The elements of a file that is one JSON array; ConfigError when it is not valid JSON
    (one broken record spoils the whole array, so there is nothing to skip)."""
    data = raw.read_bytes(f.path).removeprefix(b"\xef\xbb\xbf")
    try:
        values = json.loads(_decode(data, f.path, bad, str(f.path)))
    except ValueError as e:
        raise ConfigError(
            f"{f.path} starts a JSON array but is not valid JSON ({e}); fix it, or write one "
            "JSON object per line (JSON lines)."
        ) from e
    surrogates = raw.has_surrogate_escape(data)
    for number, value in enumerate(values, 1):
        where = f"{f.path} record {number}"
        yield where, raw.repaired(value, surrogates, where, bad)


def _python_source(data: bytes) -> str | None:
    """Python source decoded as the interpreter would (UTF-8 unless a PEP 263 line says
    otherwise); None for the few stdlib test files that are undecodable on purpose."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return None


def _bad_record(msg: str, where: str, on_bad_record: str, bad: BadRecords) -> None:
    if on_bad_record == "fail":
        raise ConfigError(f"{where} {msg}; fix it or set data.on_bad_record=skip.")
    bad.record(f"{where} {msg}")


def format_hint(fields) -> str:
    """`, or format: F, ...`: the format whose records have these `fields`, or ""."""
    fields = set(fields)
    formats = (
        ("preference", {"chosen", "rejected"}),
        ("unpaired_preference", {"prompt", "completion", "label"}),
        ("stepwise", {"prompt", "completions", "labels"}),
        ("chat", {"messages"}),
        ("chat", {"conversations"}),
        ("chat", {"instruction", "output"}),
        ("prompt_completion", {"prompt", "completion"}),
    )
    fmt = next((fmt for fmt, names in formats if names <= fields), None)
    if fmt is None:
        return ""
    return f", or format: {fmt}, whose records have these fields"


def _jsonl_texts(f: DataFile, text_field: str, on_bad_record: str, bad: BadRecords):
    for where, record in json_lines(f, on_bad_record, bad):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            hint = format_hint(record) if isinstance(record, dict) else ""
            _bad_record(
                f"has no string field {text_field!r} (set the source's text_field{hint})",
                where,
                on_bad_record,
                bad,
            )
            continue
        yield text


def _table_texts(f: DataFile, text_field: str, on_bad_record: str, bad: BadRecords):
    table = tables.Table(f.path)
    if text_field not in table.names:
        raise ConfigError(
            f"{table.what} file {f.path} has no column {text_field!r} (columns: "
            f"{', '.join(table.names)}); set the source's text_field{format_hint(table.names)}."
        )
    for row, record in enumerate(table.rows([text_field], batch_size=4096), 1):
        text = record[text_field]
        if not isinstance(text, str):
            where = f"{f.path} row {row}"
            _bad_record(f"has no string in column {text_field!r}", where, on_bad_record, bad)
            continue
        yield text


def read_arrayrecord(path: Path) -> list[bytes]:
    """All records of an ArrayRecord file; ConfigError naming the file if it is corrupt."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(str(path), "readahead_buffer_size:0")
        # a truncated file opens "successfully" with ok() False and zero records
        if not reader.ok():
            raise RuntimeError("the reader could not open it")
        records = reader.read_all()
        reader.close()
    except RuntimeError as e:
        raise ConfigError(
            f"ArrayRecord file {path} is truncated or corrupt ({str(e).splitlines()[0]}); "
            "rewrite it (for prepared data, re-run `jaxllm data prepare`)."
        ) from e
    return records


def read_texts(
    f: DataFile,
    text_field: str = "text",
    on_bad_record: str = "skip",
    bad: BadRecords | None = None,
) -> Iterator[str]:
    """The non-empty documents of one file, in file order."""
    bad = bad or BadRecords(str(f.path), text_field)
    if f.format == "jsonl":
        texts = _jsonl_texts(f, text_field, on_bad_record, bad)
    elif f.format in ("parquet", "csv", "arrow"):
        texts = _table_texts(f, text_field, on_bad_record, bad)
    elif f.format == "arrayrecord":
        texts = (_record_text(r, i, f.path, bad) for i, r in enumerate(read_arrayrecord(f.path)))
    elif f.format == "stdlib":
        texts = iter([_python_source(f.path.read_bytes()) or ""])
    else:
        data = raw.read_bytes(f.path)
        raw.refuse_wide(data[:4], f.path)
        raw.refuse_binary(data, f.path)
        texts = iter([_decode(data, f.path, bad)])
    return (t for t in texts if t)


def _record_text(record: bytes, index: int, path: Path, bad: BadRecords) -> str:
    """An ArrayRecord record as text; ConfigError when it is binary (holds NUL bytes)."""
    if b"\0" in record:
        raise ConfigError(
            f"record {index + 1} of ArrayRecord file {path} holds NUL bytes, so it is binary, "
            "not UTF-8 text (a serialized proto, or the token ids of a `jaxllm data prepare` "
            "shard away from its manifest.json); an ArrayRecord source holds one text per record."
        )
    return _decode(record, path, bad, f"{path} record {index + 1}")
