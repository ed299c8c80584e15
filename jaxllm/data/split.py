"""The held-out split of a source: which of its files, or of its records, `data.eval_fraction`
holds out for evaluation.

Files are held out by a CRC32 of their key (the path relative to the source root), so the split
never changes when files are added elsewhere. A source whose files that rule cannot split (one
file, or too few for the fraction: one side would be empty) holds out records instead, by a hash
of (file key, record index in file order): appending records never moves earlier ones. A text
file's records are blocks of `TEXT_RECORD_LINES` lines. A source that grows from such a file to
files the file rule can split changes to the file rule (and its split with it, once). Training
(`jaxllm.data.pipeline`) and `jaxllm data prepare` split by these functions.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator, Sequence

from jaxllm.config import ConfigError
from jaxllm.data.sources import DataFile

TEXT_RECORD_LINES = 100  # a text file split by records is cut into blocks of this many lines


def held_out(key: str, eval_fraction: float) -> bool:
    return zlib.crc32(key.encode()) < int(eval_fraction * 2**32)


def by_records(files: Sequence[DataFile], eval_fraction: float) -> bool:
    """Whether a source holds out records instead of files: when holding out whole files by
    their key would leave either side empty (one file, or too few for the fraction)."""
    if eval_fraction <= 0:
        return False
    held = sum(held_out(f.key, eval_fraction) for f in files)
    return held in (0, len(files))


def record_held_out(file_key: str, index: int, eval_fraction: float) -> bool:
    """Whether record `index` (0-based, in file order) of the file keyed `file_key` is held out
    by the record-level split: a hash of both, so appended records never move earlier ones."""
    digest = hashlib.blake2b(f"{file_key}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < int(eval_fraction * 2**64)


def _text_blocks(text: str) -> list[str]:
    """A text document as records: blocks of `TEXT_RECORD_LINES` lines."""
    lines = text.splitlines(keepends=True)
    n = TEXT_RECORD_LINES
    return ["".join(lines[i : i + n]) for i in range(0, len(lines), n)] or [text]


def split_records(
    f: DataFile, items: Iterable, eval_fraction: float, records: bool, counts=None
) -> Iterator[tuple[str, object]]:
    """(split, item) of each item of file `f`, split 'train' or 'eval'. With `records` (see
    `by_records`) item i is held out by `record_held_out`, a text file's documents being cut
    into blocks of lines first (consecutive blocks of one split are joined back into one
    document); otherwise the whole file is, by `held_out`. `counts` (a dict), when given, adds
    up the records (items, or blocks of lines) of each split."""
    if not records:
        side = "eval" if held_out(f.key, eval_fraction) else "train"
        yield from ((side, item) for item in items)
        return
    counts = {} if counts is None else counts
    if f.format not in ("text", "stdlib"):
        for i, item in enumerate(items):
            side = "eval" if record_held_out(f.key, i, eval_fraction) else "train"
            counts[side] = counts.get(side, 0) + 1
            yield side, item
        return
    index = 0
    for doc in items:
        run, run_side = [], None
        for block in _text_blocks(doc):
            side = "eval" if record_held_out(f.key, index, eval_fraction) else "train"
            counts[side] = counts.get(side, 0) + 1
            index += 1
            if run and side != run_side:
                yield run_side, "".join(run)
                run = []
            run.append(block)
            run_side = side
        if run:
            yield run_side, "".join(run)


def split_files(
    files: Sequence[DataFile], eval_fraction: float, key: str = "data.sources"
) -> tuple[list[DataFile], list[DataFile]]:
    """(train, eval) by the hash of each file's key; ConfigError if either side is empty."""
    train = [f for f in files if not held_out(f.key, eval_fraction)]
    held = [f for f in files if held_out(f.key, eval_fraction)]
    if not held or not train:
        raise ConfigError(
            f"data.eval_fraction={eval_fraction} leaves {len(train)} train and {len(held)} eval "
            f"files of the {len(files)} in {key}; choose a fraction that leaves both non-empty, "
            "or set data.eval_sources."
        )
    return train, held


def split_source(
    files: Sequence[DataFile],
    items: Sequence[Iterable],
    eval_fraction: float,
    key: str = "data.sources",
    counts: dict | None = None,
) -> tuple[list, list]:
    """(train, eval) items of `files` (`items[i]` those of `files[i]`, in file order): whole
    files by the hash of their key, or records when that would leave a side empty
    (`by_records`); ConfigError if a side is still empty. `counts`, when given, gets the
    records of each split when records are held out (`split_records`)."""
    records = by_records(files, eval_fraction)
    sides: dict[str, list] = {"train": [], "eval": []}
    counts = {} if counts is None else counts
    for f, its in zip(files, items):
        for side, item in split_records(f, its, eval_fraction, records, counts):
            sides[side].append(item)
    train, held = sides["train"], sides["eval"]
    if not held or not train:
        unit = "documents"
        if records:
            unit = "records"
            if any(f.format in ("text", "stdlib") for f in files):
                unit += f" (a text file's are blocks of {TEXT_RECORD_LINES} lines)"
        n_train, n_eval = (
            (counts.get("train", 0), counts.get("eval", 0)) if records else (len(train), len(held))
        )
        counted = f"{n_train} train and {n_eval} eval {unit} of the {len(files)} file(s)"
        raise ConfigError(
            f"data.eval_fraction={eval_fraction} leaves {counted} in {key}; choose a fraction that "
            "leaves both non-empty, set data.eval_sources, or train without evaluation: "
            "data.eval_fraction=0."
        )
    return train, held
