"""`format: auto` for records: a JSON-lines or columnar source whose first records are plainly
chats or preference pairs is read as one, and says so in one line.

`auto` reads a `.jsonl` / `.json` / `.parquet` / `.csv` / `.arrow` file as documents in the
source's `text_field`. When the first records of a source's first file (`RECORDS` of them) lack
that field and all have the keys of one shape below, the source is read in that shape's format,
with the fields the source names (`messages_field`, `prompt_field`, ...):

    chat         `messages` (TRL), `conversations` (ShareGPT), or `instruction` + `output`
                 (Alpaca): the shapes `jaxllm.data.conversations` reads
    preference   `prompt` + `chosen` + `rejected`, or `chosen` + `rejected` conversations (TRL's
                 implicit prompt)

A format that is set is never second-guessed, and records that fit no shape, or more than one
(a `messages` record that also holds `chosen` and `rejected`), or first records of different
shapes are read as text, whose error then names the format to set (`sources.format_hint`).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable, Sequence

from jaxllm.config import DataConfig, SourceConfig
from jaxllm.data import tables
from jaxllm.data.sources import (
    BadRecords,
    DataFile,
    fetched,
    is_prepared_dir,
    json_lines,
    list_files,
)

RECORDS = 8  # the first records of a file that decide its source's format
RECORD_FORMATS = ("jsonl", "parquet", "csv", "arrow")  # the file formats records come in


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def shape(record, src: SourceConfig) -> str | None:
    """The format a record plainly has, `text` when it holds the source's text field, None
    when it fits no shape or several (see the module docstring)."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get(src.text_field), str):
        return "text"
    found = set()
    if src.messages_field == "messages":
        field = next((f for f in ("messages", "conversations") if f in record), None)
    else:
        field = src.messages_field if src.messages_field in record else None
    alpaca = isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str)
    if (field is not None and isinstance(record[field], list)) or alpaca:
        found.add("chat")
    chosen, rejected = record.get(src.chosen_field), record.get(src.rejected_field)
    if chosen is not None and rejected is not None:
        conversational = isinstance(chosen, list) and isinstance(rejected, list)
        if record.get(src.prompt_field) is not None or conversational:
            found.add("preference")
    return found.pop() if len(found) == 1 else None


def _first_records(f: DataFile) -> list:
    if tables.is_table(f.path):
        table = tables.Table(f.path)
        return list(itertools.islice(table.rows(table.names, batch_size=RECORDS), RECORDS))
    records = json_lines(f, "skip", BadRecords(str(f.path)))  # bad lines are the reader's
    return [record for _, record in itertools.islice(records, RECORDS)]


def detected(
    src: SourceConfig, files: Sequence[DataFile], key: str, say: Callable[[str], None] = _say
) -> SourceConfig:
    """`src` with `format: auto` replaced by the format its first records plainly have (said
    in one line through `say`); `src` itself when its format is set or its records are text,
    of no shape, or of several."""
    if src.format != "auto" or not files or any(f.format not in RECORD_FORMATS for f in files):
        return src
    shapes = {shape(record, src) for record in _first_records(files[0])}
    if len(shapes) != 1 or None in shapes or "text" in shapes:
        return src
    fmt = shapes.pop()
    say(
        f"{key}: the records of {src.path} are {fmt} records, read as format: {fmt} "
        f"(set {key}.format to read them otherwise)"
    )
    return dataclasses.replace(src, format=fmt)


def of_source(
    src: SourceConfig, key: str, max_files: int | None = None, say: Callable[[str], None] = _say
) -> SourceConfig:
    """`detected` of a source whose files are not listed yet (`format: auto` only; a prepared
    directory keeps the format it was prepared with)."""
    if src.format != "auto" or src.path == "stdlib" or is_prepared_dir(fetched(src, key).path):
        return src
    return detected(src, list_files(src, key, max_files), key, say)


def resolve(data: DataConfig, say: Callable[[str], None] = _say) -> DataConfig:
    """`data` with every `format: auto` source whose records are plainly chats or pairs given
    that format (`detected`); `data` itself when none is."""
    changed = {}
    for name in ("sources", "eval_sources"):
        sources = list(getattr(data, name))
        for i, src in enumerate(sources):
            sources[i] = of_source(src, f"data.{name}[{i}]", data.max_files, say)
        if sources != list(getattr(data, name)):
            changed[name] = tuple(sources)
    return dataclasses.replace(data, **changed) if changed else data


def all_chat(data: DataConfig) -> bool:
    """Whether `data` has sources and every one of them, eval sources too, is chat: set, or
    detected from `format: auto` (without saying so; training says it when it reads them)."""
    sources = [
        of_source(src, f"data.{name}[{i}]", data.max_files, lambda _: None)
        for name in ("sources", "eval_sources")
        for i, src in enumerate(getattr(data, name))
    ]
    return bool(sources) and all(src.format == "chat" for src in sources)
