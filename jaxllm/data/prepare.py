"""`jaxllm data prepare`: tokenize corpora once into ArrayRecord shards that training reads back.

    jaxllm data prepare SOURCE... --out DIR [--tokenizer T] [--workers N] [--shard-docs N]

One record is one document's int32 tokens (little-endian, no BOS/EOS: the packer adds them per
`data.add_bos` / `data.add_eos`, so one preparation serves both). Files are split into train and
eval by the same rule as on-the-fly loading (`--eval-fraction`, default that of DataConfig: whole
files by a path hash, or records when a source has too few files; 0 holds out nothing),
written to `train-NNNNN.arrayrecord` and `eval-NNNNN.arrayrecord`, and `DIR/manifest.json`
records the tokenizer (with a SHA-256 of its file), every shard's documents and tokens, and the
totals. The directory is built in a hidden temporary sibling with the manifest written last, and
renamed into place when complete (`jaxllm.config.outputs.written`), so a preparation that fails
(a full disk: exit 1; a bad record under `--on-bad-record fail`: exit 2) or is interrupted leaves
nothing at DIR. A DIR that holds anything is refused unless `--overwrite` (never one holding a
SOURCE). Shards without their manifest are refused wherever a source names them
(`jaxllm.data.sources`): they are token ids, never text.

Tokenization runs in a pool of `--workers` processes (spawned, so no inherited threads) fed
chunks of documents in order, with at most two chunks per worker in flight; a training source
`path: DIR` then reads the shards back without tokenizing anything.

SFT sources (format chat / prompt_completion, all of one format) make a directory of their own,
format `jaxllm-prepared-sft/1`: one record is one example's int32 ids followed by one byte per
id, 1 where the id belongs to an assistant turn / the completion (`sft.to_record`). BOS/EOS of
prompt_completion examples, `data.train_on_prompt` and `data.truncation` apply when training
reads them, as for examples read from their files. The manifest keeps the SHA-256 of the chat
template (and its special tokens) that rendered the conversations, so training with another is
caught.

Preference sources (format preference / unpaired_preference) and step-labelled solutions
(stepwise) are prepared the same way, a format to a directory: one record is one pair (both
sequences' ids and loss masks; an unpaired example with its mismatched sequence,
`jaxllm.data.unpaired`) or one solution (ids, one label per id), kind named in the manifest. A
training source names the same format: `{path: DIR, format: unpaired_preference}`.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.config.outputs import check_output, written
from jaxllm.data import chat, detect, preference, sft, stepwise, unpaired
from jaxllm.data.sources import (
    MANIFEST,
    BadRecords,
    list_files,
    read_arrayrecord,
    read_texts,
    refuse_output_over,
)
from jaxllm.data.split import by_records, split_records
from jaxllm.data.tokenizer import encode_documents, load_tokenizer, tokenizer_fingerprint

FORMAT = "jaxllm-prepared/1"
FORMAT_SFT = "jaxllm-prepared-sft/1"  # records carry a loss mask
_CHUNK_DOCS, _CHUNK_CHARS = 512, 4_000_000  # a chunk is one task of the pool
_worker_tokenizer = None  # set in each worker (and in-process) by _init_worker
PAIR_KINDS = ("preference", "unpaired_preference")
KINDS = (*sft.KINDS, *PAIR_KINDS, "stepwise")  # the record formats besides text


def _init_worker(tokenizer: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer, "--tokenizer")


def _encode_chunk(chunk: tuple[str, list, int, str]) -> tuple[str, list[bytes], int]:
    """Records of a chunk of texts (kind `text`), SFT examples, pairs or solutions."""
    split, items, files_done, kind = chunk
    if kind == "text":
        docs = encode_documents(_worker_tokenizer, items)
        return split, [(d.astype("<i4").tobytes(), len(d)) for d in docs], files_done
    if kind in PAIR_KINDS:
        pairs = preference.encode_pairs(_worker_tokenizer, items)
        sizes = [len(c) + len(r) for (c, _), (r, _) in zip(pairs.chosen, pairs.rejected)]
        records = [(preference.to_record(pairs, i), n) for i, n in enumerate(sizes)]
        return split, records, files_done
    if kind == "stepwise":  # BOS is added when training reads them, as data.add_bos says
        sol = stepwise.encode_solutions(_worker_tokenizer, items, add_bos=False)
        records = [(stepwise.to_record(t, lab), len(t)) for t, lab in zip(sol.tokens, sol.labels)]
        return split, records, files_done
    ex = sft.encode_examples(_worker_tokenizer, items, kind)
    records = [(sft.to_record(t, m), len(t)) for t, m in zip(ex.tokens, ex.masks)]
    return split, records, files_done


def _ordered_map(fn, chunks: Iterator, workers: int, tokenizer: str) -> Iterator:
    """`map(fn, chunks)` in order, in `workers` processes (0: here), never reading far ahead
    (multiprocessing's own imap would queue the whole corpus in memory)."""
    if workers == 0:
        _init_worker(tokenizer)
        yield from map(fn, chunks)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer,)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(fn, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _ShardWriter:
    """Writes one split's documents into shards of at most `shard_docs` records."""

    def __init__(self, out: Path, split: str, shard_docs: int):
        self.out, self.split, self.shard_docs = out, split, shard_docs
        self.shards: list[dict] = []
        self._writer = None

    def write(self, docs: list[tuple[bytes, int]]) -> None:
        """Writes (record, its number of tokens) pairs."""
        from array_record.python.array_record_module import ArrayRecordWriter

        for record, tokens in docs:
            if self._writer is None or self.shards[-1]["docs"] == self.shard_docs:
                self.close()
                name = f"{self.split}-{len(self.shards):05d}.arrayrecord"
                # group_size 64: small groups keep random reads of one document cheap
                self._writer = _io(ArrayRecordWriter, str(self.out / name), "group_size:64")
                self.shards.append({"file": name, "split": self.split, "docs": 0, "tokens": 0})
            _io(self._writer.write, record)
            self.shards[-1]["docs"] += 1
            self.shards[-1]["tokens"] += tokens

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            _io(writer.close)


def _io(fn, *args):
    """`fn(*args)` of array_record, whose failed writes (a full disk) raise RuntimeError, not
    OSError: re-raised as the OSError they are, with the reason and the file."""
    try:
        return fn(*args)
    except RuntimeError as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        reason = re.search(r"failed: ([^;]+)", text)
        path = re.search(r"writing (\S+);", text)
        raise OSError(
            None, reason.group(1) if reason else text, path.group(1) if path else None
        ) from e


def prepare(
    sources: Sequence[SourceConfig],
    out_dir: str | Path,
    *,
    tokenizer: str = "byte",
    workers: int = 0,
    shard_docs: int = 10_000,
    max_files: int | None = None,
    eval_fraction: float = DataConfig.eval_fraction,
    on_bad_record: str = "skip",
    overwrite: bool = False,
) -> dict:
    """Tokenizes `sources` (concatenated in order) into shards at `out_dir`, whole or not at all
    (an `out_dir` holding anything is replaced only with `overwrite`); returns the manifest."""
    if shard_docs < 1 or workers < 0 or not 0 <= eval_fraction < 1:
        raise ConfigError("--shard-docs must be >= 1, --workers >= 0, --eval-fraction in [0, 1).")
    out = check_output(out_dir, flag="--out", overwrite=overwrite)
    sources = [detect.of_source(src, "SOURCE", max_files) for src in sources]  # format: auto
    kinds = {src.format if src.format in KINDS else "text" for src in sources}
    if len(kinds) > 1:
        raise ConfigError(
            f"the sources mix {' and '.join(sorted(kinds))} records; prepare each format "
            f"({' / '.join(KINDS)}) and text into directories of their own."
        )
    kind = kinds.pop()
    tok = load_tokenizer(tokenizer, "--tokenizer")  # a bad path fails before anything is written
    files = [(f, src) for src in sources for f in list_files(src, "SOURCE", max_files)]
    refuse_output_over(out, [f.path for f, _ in files], "--out")
    names = ", ".join(src.path for src in sources)
    readers = {  # kind: its module and the module's reader of one file
        "preference": (preference, preference.read_pairs),
        "unpaired_preference": (unpaired, unpaired.read_examples),
        "stepwise": (stepwise, stepwise.read_solutions),
    }
    if kind == "text":
        bad = BadRecords(names, sources[0].text_field)
    else:
        bad = readers.get(kind, (sft,))[0].bad_records(names, sources[0])

    def read(f, src):
        if kind == "text":
            return read_texts(f, src.text_field, on_bad_record, bad)
        if kind in readers:
            return readers[kind][1](f, src, tok, on_bad_record, bad)
        no_vision = "prepared shards hold token ids only, for a model without a vision tower"
        return sft.read_examples(f, src, tok, on_bad_record, bad, no_vision)

    # each source's split, by its files or (too few files) its records, as training makes it
    records = {
        id(src): by_records([f for f, s in files if s is src], eval_fraction) for src in sources
    }

    def chunks() -> Iterator[tuple[str, list, int, str]]:
        items, chars, split, files_done = [], 0, "train", 0
        for f, src in files:
            for item_split, item in split_records(f, read(f, src), eval_fraction, records[id(src)]):
                if items and (
                    item_split != split or len(items) == _CHUNK_DOCS or chars > _CHUNK_CHARS
                ):
                    yield split, items, files_done, kind
                    items, chars, files_done = [], 0, 0
                split = item_split
                items.append(item)
                chars += _chars(item, kind)
            files_done += 1
        yield split, items, files_done, kind

    with written(out, flag="--out", overwrite=overwrite) as tmp:
        shards = _write_shards(tmp, chunks(), shard_docs, workers, tokenizer, len(files))
        if not shards:
            why = f" ({bad.summary()})" if bad.summary() else ""
            raise ConfigError(
                f"the {len(files)} file(s) of the sources hold nothing to prepare{why}."
            )
        manifest = _manifest(kind, tok, tokenizer, sources, len(files), eval_fraction, shards)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")  # last
    bad.warn()
    return manifest


def _chars(item, kind: str) -> int:
    """The characters of one item read from a source (the size of a chunk of the pool)."""
    if kind == "text":
        return len(item)
    if kind in PAIR_KINDS:
        return len(item.chosen.text) + len(item.rejected.text)
    if kind == "stepwise":
        return len(item.prompt) + sum(len(step) for step in item.steps)
    return len(item.text)


def _write_shards(
    out: Path, chunks: Iterator, shard_docs: int, workers: int, tokenizer: str, files: int
) -> list[dict]:
    """Encodes `chunks` into the train and eval shards under `out`; their manifest entries."""
    from tqdm import tqdm

    writers = {split: _ShardWriter(out, split, shard_docs) for split in ("train", "eval")}
    bar = tqdm(total=files, unit="file", desc="prepare", disable=None)
    try:
        for split, docs, files_done in _ordered_map(_encode_chunk, chunks, workers, tokenizer):
            writers[split].write(docs)
            bar.update(files_done)
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    return writers["train"].shards + writers["eval"].shards


def _manifest(kind, tok, tokenizer, sources, files, eval_fraction, shards) -> dict:
    """The manifest.json of `shards`, made from `files` files of `sources` with `tok`."""

    def total(split=None) -> dict:
        chosen = [s for s in shards if split in (None, s["split"])]
        return {"docs": sum(s["docs"] for s in chosen), "tokens": sum(s["tokens"] for s in chosen)}

    return {
        "format": FORMAT if kind == "text" else FORMAT_SFT,
        **({} if kind == "text" else {"kind": kind}),
        **({"chat_template": chat.fingerprint(tok)} if kind in ("chat", *PAIR_KINDS) else {}),
        "tokenizer": {
            "spec": tokenizer,
            "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
        },
        "sources": [_source_record(src) for src in sources],
        "files": files,
        "eval_fraction": eval_fraction,
        "shards": shards,
        **total(),
        "splits": {"train": total("train"), "eval": total("eval")},
    }


def _source_record(src: SourceConfig) -> dict:
    fields = {
        "chat": ("messages_field",),
        "prompt_completion": ("prompt_field", "completion_field"),
        "preference": ("prompt_field", "chosen_field", "rejected_field"),
        "unpaired_preference": unpaired.FIELDS,
        "stepwise": ("prompt_field",),
    }.get(src.format, ("text_field",))
    return {"path": src.path, "format": src.format, **{k: getattr(src, k) for k in fields}}


def _whole(manifest: dict) -> bool:
    """Whether a manifest has every entry that training reads."""
    made_with, shards = manifest.get("tokenizer"), manifest.get("shards")
    return (
        isinstance(made_with, dict)
        and {"spec", "fingerprint"} <= made_with.keys()
        and isinstance(manifest.get("eval_fraction"), int | float)
        and isinstance(shards, list)
        and all(
            isinstance(s, dict)
            and isinstance(s.get("file"), str)
            and s.get("split") in ("train", "eval")
            and isinstance(s.get("docs"), int)
            for s in shards
        )
    )


class PreparedDir:
    """A directory written by `prepare`, read back as token documents."""

    def __init__(self, path: str | Path, key: str, tokenizer: str):
        self.path = Path(path)
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except ValueError as e:
            raise ConfigError(f"{key}.path: {self.path / MANIFEST} is not valid JSON ({e}).")
        found = self.manifest.get("format") if isinstance(self.manifest, dict) else None
        if found not in (FORMAT, FORMAT_SFT):
            raise ConfigError(
                f"{key}.path: {self.path / MANIFEST} is not a `jaxllm data prepare` manifest "
                f"(format {found!r}, expected {FORMAT!r} or {FORMAT_SFT!r})."
            )
        if not _whole(self.manifest):
            raise ConfigError(
                f"{key}.path: {self.path / MANIFEST} lacks the tokenizer, eval_fraction or "
                "shards (file, split, docs) of a `jaxllm data prepare` manifest; re-run "
                "`jaxllm data prepare`."
            )
        made_with = self.manifest["tokenizer"]
        if made_with["fingerprint"] != tokenizer_fingerprint(tokenizer):
            raise ConfigError(
                f"{key}.path: {self.path} was tokenized with {made_with['spec']!r} but "
                f"data.tokenizer is {tokenizer!r}; set data.tokenizer to the same tokenizer or "
                "re-run `jaxllm data prepare` with this one."
            )
        self.key = key
        self.eval_fraction = self.manifest["eval_fraction"]
        self.kind = self.manifest.get("kind", "text")
        rendered_with = self.manifest.get("chat_template")
        if rendered_with and rendered_with != chat.fingerprint(load_tokenizer(tokenizer)):
            raise ConfigError(
                f"{key}.path: the conversations of {self.path} were rendered by another chat "
                f"template than that of data.tokenizer={tokenizer!r}; re-run `jaxllm data "
                "prepare` with this tokenizer."
            )

    def documents(self, split: str | None, max_files: int | None = None, bos_id=None):
        """Token documents of the `train` or `eval` shards (None: all), in shard order; for SFT
        shards an `sft.Examples`, for pairs `preference.Pairs`, for solutions
        `stepwise.Solutions` (with `bos_id` first when given)."""
        shards = [s for s in self.manifest["shards"] if split in (None, s["split"])]
        docs: list = []
        for shard in shards[:max_files] if max_files else shards:
            path = self.path / shard["file"]
            if not path.is_file():
                raise ConfigError(f"{self.key}.path: shard {path} of the manifest is missing.")
            records = read_arrayrecord(path)
            if len(records) != shard["docs"]:
                raise ConfigError(
                    f"{self.key}.path: shard {path} holds {len(records)} documents but the "
                    f"manifest lists {shard['docs']}: it is truncated; re-run `jaxllm data prepare`."
                )
            if self.kind == "text":
                docs.extend(np.frombuffer(r, dtype="<i4") for r in records)
            elif self.kind in sft.KINDS:
                docs.extend(sft.from_record(r) for r in records)
            else:
                docs.extend(records)
        if self.kind == "text":
            return docs
        if self.kind in PAIR_KINDS:
            return preference.from_records(docs)
        if self.kind == "stepwise":
            return stepwise.from_records(docs, bos_id)
        return sft.Examples(self.kind, [t for t, _ in docs], [m for _, m in docs])
