"""From `DataConfig` to Grain batches: load every source, split, pack, mix, shuffle, batch.

    train_rows, eval_rows = load_splits(cfg.data)             # random-access rows [L]
    batches = train_batches(train_rows, cfg.data, B, local)   # endless iterator, get/set_state
    held_out = eval_batches(eval_rows, B, n, local)           # the same n batches every time

Each source is packed on its own (a row never mixes sources); several sources become a
`MixtureRows` (`CurriculumRows` under `data.order=curriculum`; `data.order=length` sorts each
source's documents before packing and keeps the rows unshuffled). Text is packed by `data.packing`;
SFT examples (format chat / prompt_completion, `jaxllm.data.sft`) are packed whole, first-fit, with
their loss masks; preference pairs (`jaxllm.data.preference`) likewise, a pair's two sequences side
by side. Without `data.eval_sources` each source holds out `data.eval_fraction` of its files, or of
its records when it has too few files (`jaxllm.data.sources.split_source`); a prepared directory
holds out the files `prepare` held out, by the same rule (so its rows equal those of tokenizing the
same files here), and `data.max_files` caps its shards.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import grain
import numpy as np

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import detect, preference, sft, stepwise, unpaired, vision_chat, vision_rows
from jaxllm.data.packing import FirstFitRows, PackedRows, pack
from jaxllm.data.prepare import PreparedDir
from jaxllm.data.sources import BadRecords, fetched, is_prepared_dir, list_files, read_texts
from jaxllm.data.split import split_source
from jaxllm.data.tokenizer import Tokenizer, encode_documents, make_tokenizer

Rows = PackedRows | FirstFitRows | preference.PairRows | stepwise.StepRows | vision_rows.VisionRows


@dataclasses.dataclass
class VisionExamples:
    """The image-text examples of a chat source read for a model with a vision tower."""

    items: list

    def __len__(self) -> int:
        return len(self.items)


class MixtureRows:
    """Rows drawn from several sources in proportion to their weights, deterministic in `seed`.

    Each source's rows are shuffled and repeated (a new permutation per pass), and
    `grain.MapDataset.mix` interleaves them exactly by weight. One pass of the mixture is as long
    as it takes to show every row of the most under-weighted source once: max_i(len_i / p_i) rows
    for normalised weights p_i, so no row of any source goes unseen and smaller sources repeat.
    `shuffle=False` keeps each source's rows in their order (`data.order=length`).
    """

    def __init__(
        self, parts: Sequence[Rows], weights: Sequence[float], seed: int, shuffle: bool = True
    ):
        self.parts = list(parts)
        shares = np.asarray(weights, np.float64) / sum(weights)
        self._len = int(max(np.ceil(len(p) / s) for p, s in zip(self.parts, shares)))
        sources = [grain.MapDataset.source(p) for p in self.parts]
        if shuffle:
            sources = [ds.shuffle(seed=seed + i) for i, ds in enumerate(sources)]
        self._ds = grain.MapDataset.mix([ds.repeat() for ds in sources], list(weights))
        self.num_docs = sum(p.num_docs for p in self.parts)
        self.num_tokens = sum(p.num_tokens for p in self.parts)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        return self._ds[int(index)]


class CurriculumRows:
    """The rows of several sources one source after another, in the order listed
    (`data.order=curriculum`): all of source 1, each source's rows shuffled by `seed` as in
    `MixtureRows`, then all of source 2, ..."""

    def __init__(self, parts: Sequence[Rows], seed: int):
        self.parts = list(parts)
        self._ds = [grain.MapDataset.source(p).shuffle(seed=seed + i) for i, p in enumerate(parts)]
        self._ends = np.cumsum([len(p) for p in self.parts])
        self.num_docs = sum(p.num_docs for p in self.parts)
        self.num_tokens = sum(p.num_tokens for p in self.parts)

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        part = int(np.searchsorted(self._ends, index, "right"))
        return self._ds[part][int(index - (self._ends[part - 1] if part else 0))]


def _by_length(docs, key: str) -> list[np.ndarray]:
    """`data.order=length`: the documents shortest first (ties in their order)."""
    if not isinstance(docs, list):
        raise ConfigError(
            f"data.order=length sorts text documents, but {key} holds SFT examples or preference "
            "pairs; use data.order=shuffled or curriculum."
        )
    return sorted(docs, key=len)


def _source_documents(
    src: SourceConfig,
    key: str,
    cfg: DataConfig,
    tok: Tokenizer,
    hold_out: bool,
    images=None,
    blocks: dict | None = None,
):
    """(train documents, eval documents) of one source, all in train unless `hold_out`: token
    arrays, `sft.Examples` for a chat / prompt_completion source, `preference.Pairs` for a
    preference source, `stepwise.Solutions` for a stepwise one, `VisionExamples` for a chat
    source when `images` (a model with a vision tower, `vision_rows.ImageInputs`) is given.
    `blocks`, when given, gets each split's blocks of lines of a text source that holds out
    records (`jaxllm.data.split`), whose documents are runs of such blocks."""
    src = fetched(src, key)  # a bucket's source is read from its local copy
    if is_prepared_dir(src.path):
        prepared = PreparedDir(src.path, key, cfg.tokenizer)
        records = ("preference", "unpaired_preference", "stepwise")
        if (prepared.kind in records or src.format in records) and prepared.kind != src.format:
            raise ConfigError(
                f"{key}.path: {src.path} was prepared from {prepared.kind} records, but the "
                f"source has format {src.format}; set format: {prepared.kind}."
            )
        bos_id = tok.bos_id if cfg.add_bos else None  # stepwise solutions are stored without
        if not hold_out:
            return prepared.documents(None, cfg.max_files, bos_id), []
        if prepared.eval_fraction != cfg.eval_fraction:
            raise ConfigError(
                f"{key}.path: {src.path} was prepared with --eval-fraction "
                f"{prepared.eval_fraction}, so data.eval_fraction must be "
                f"{prepared.eval_fraction}, not {cfg.eval_fraction} (or set data.eval_sources)."
            )
        return tuple(
            prepared.documents(split, cfg.max_files, bos_id) for split in ("train", "eval")
        )
    files = list_files(src, key, cfg.max_files)
    if (seen := detect.detected(src, files, key)) is not src:  # format: auto, plain records
        src, files = seen, [dataclasses.replace(f, format=seen.format) for f in files]
    seeing = images is not None and src.format == "chat"
    if seeing:
        images.check(tok)  # the chats' image tokens must be the model's (text runs skip this)
        bad = sft.bad_records(key, src)
        spec, read = images.spec, vision_chat.read_vision_examples
        texts = [
            list(read(f, src, tok, spec, images.tokens, cfg.on_bad_record, bad)) for f in files
        ]
    elif sft.is_sft(src):
        bad = sft.bad_records(key, src)
        texts = [list(sft.read_examples(f, src, tok, cfg.on_bad_record, bad)) for f in files]
    elif unpaired.is_unpaired(src):
        bad = unpaired.bad_records(key, src)
        texts = [list(unpaired.read_examples(f, src, tok, cfg.on_bad_record, bad)) for f in files]
    elif preference.is_preference(src):
        bad = preference.bad_records(key, src)
        texts = [list(preference.read_pairs(f, src, tok, cfg.on_bad_record, bad)) for f in files]
    elif stepwise.is_stepwise(src):
        bad = stepwise.bad_records(key, src)
        read = stepwise.read_solutions
        texts = [list(read(f, src, tok, cfg.on_bad_record, bad)) for f in files]
    else:
        bad = BadRecords(key, src.text_field)
        texts = [list(read_texts(f, src.text_field, cfg.on_bad_record, bad)) for f in files]
    if not any(texts):  # one line: why the records were skipped, if they were
        why = f": {bad.summary()}" if bad.summary() else " (they are empty)"
        raise ConfigError(
            f"{key}.path: the {len(files)} file(s) of {src.path} hold no documents{why}."
        )
    bad.warn()
    if hold_out:
        text = all(f.format in ("text", "stdlib") for f in files)
        train, evals = split_source(files, texts, cfg.eval_fraction, key, blocks if text else None)
    else:
        train, evals = [t for ts in texts for t in ts], []
    if seeing:
        return VisionExamples(train), VisionExamples(evals)
    if sft.is_sft(src):
        return sft.encode_examples(tok, train, src.format), sft.encode_examples(
            tok, evals, src.format
        )
    if preference.is_preference(src):
        return preference.encode_pairs(tok, train), preference.encode_pairs(tok, evals)
    if stepwise.is_stepwise(src):
        encode = stepwise.encode_solutions
        return encode(tok, train, cfg.add_bos), encode(tok, evals, cfg.add_bos)
    return encode_documents(tok, train), encode_documents(tok, evals)


def _rows(
    docs: list[np.ndarray] | sft.Examples | preference.Pairs | stepwise.Solutions,
    what: str,
    cfg: DataConfig,
    tok,
    virtual_tokens=0,
    whole_inputs=False,
    images=None,
) -> Rows:
    if not docs:
        raise ConfigError(f"{what} has no documents; add data or change data.eval_fraction.")
    if isinstance(docs, VisionExamples):
        if virtual_tokens:
            raise ConfigError(
                f"{what} holds images, which peft.method=prompt does not train on; use "
                "peft.method=lora or full fine-tuning."
            )
        return vision_rows.VisionRows(docs.items, cfg, tok, what, images)
    if isinstance(docs, preference.Pairs):
        if virtual_tokens:
            raise ConfigError(
                f"{what} holds preference pairs, which peft.method=prompt does not train on; use "
                "peft.method=lora or qlora."
            )
        return preference.pack_pairs(docs, cfg, tok, what, whole_inputs)
    if isinstance(docs, stepwise.Solutions):
        if virtual_tokens:
            raise ConfigError(
                f"{what} holds step-labelled solutions, which peft.method=prompt does not "
                "train on; use peft.method=lora or qlora."
            )
        return stepwise.pack_solutions(docs, cfg, tok, what)
    if isinstance(docs, sft.Examples):
        return sft.pack_examples(docs, cfg, tok, what, virtual_tokens)
    if virtual_tokens:
        raise ConfigError(
            f"{what} is text, but peft.method=prompt puts its virtual tokens before every SFT "
            "example; use chat or prompt_completion sources (or a directory prepared from them)."
        )
    try:
        return pack(docs, cfg, tok)
    except ValueError as e:
        raise ConfigError(
            f"{what} is too small for one row of data.seq_len={cfg.seq_len} ({e}); add data or "
            "lower data.seq_len."
        ) from e


def _mix(
    parts: list[Rows], sources: Sequence[SourceConfig], seed: int, order: str = "shuffled"
) -> Rows | MixtureRows | CurriculumRows:
    """One source's rows, or the sources' rows in `order` (held-out rows always mix shuffled)."""
    if len(parts) == 1:
        return parts[0]
    if order == "curriculum":
        return CurriculumRows(parts, seed)
    return MixtureRows(parts, [s.weight for s in sources], seed, shuffle=order == "shuffled")


def load_splits(
    cfg: DataConfig, virtual_tokens: int = 0, whole_inputs: bool = False, images=None
) -> tuple[Rows | MixtureRows | CurriculumRows, Rows | MixtureRows | CurriculumRows | None]:
    """(train rows, eval rows) of the configured sources, eval rows None when nothing is held out
    (`data.eval_fraction=0` without `data.eval_sources`); ConfigError for anything the user can
    fix (missing path, no files, no text, bad records under on_bad_record=fail, tokenizer).
    `virtual_tokens`: a soft prompt's length (peft.method=prompt), whose placeholder ids start
    every SFT example. `whole_inputs`: preference sequences get their closing slot (reward
    models, see `jaxllm.data.preference`). `images` (`vision_rows.ImageInputs`, a model with a
    vision tower): chat sources are read with their images and every row carries the image
    keys of `jaxllm.data.vision_rows`, with one patch budget for the run."""
    tok = make_tokenizer(cfg)
    for name, sources in (("sources", cfg.sources), ("eval_sources", cfg.eval_sources)):
        for i, src in enumerate(sources):
            if not src.weight > 0:
                raise ConfigError(f"data.{name}[{i}].weight must be positive, not {src.weight}.")
    if not cfg.sources:
        raise ConfigError("data.sources is empty; name at least one corpus.")
    hold_out = not cfg.eval_sources and cfg.eval_fraction > 0
    train_parts, eval_parts = [], []
    for i, src in enumerate(cfg.sources):
        key = f"data.sources[{i}]"
        blocks: dict[str, int] = {}  # a text file's 100-line blocks, when it holds them out
        train_docs, eval_docs = _source_documents(src, key, cfg, tok, hold_out, images, blocks)
        if cfg.order == "length":
            train_docs = _by_length(train_docs, key)
        what = f"the train split of {key}"
        train_parts.append(_rows(train_docs, what, cfg, tok, virtual_tokens, whole_inputs, images))
        if hold_out:
            what = f"the eval split of {key}"
            eval_parts.append(
                _rows(eval_docs, what, cfg, tok, virtual_tokens, whole_inputs, images)
            )
        if blocks:  # counted as the blocks held out, not the runs of them packed
            train_parts[-1].num_docs, eval_parts[-1].num_docs = blocks["train"], blocks["eval"]
    for i, src in enumerate(cfg.eval_sources):
        key = f"data.eval_sources[{i}]"
        docs = _source_documents(src, key, cfg, tok, False, images)[0]
        eval_parts.append(_rows(docs, key, cfg, tok, virtual_tokens, whole_inputs, images))
    if images is not None:  # one patch budget: the train and eval steps compile once
        shared = vision_rows.share_budget(train_parts + eval_parts, images.vision)
        train_parts, eval_parts = shared[: len(train_parts)], shared[len(train_parts) :]
    eval_weights_from = cfg.sources if hold_out else cfg.eval_sources
    train = _mix(train_parts, cfg.sources, cfg.seed, cfg.order)
    if not eval_parts:
        return train, None
    return train, _mix(eval_parts, eval_weights_from, cfg.seed)


def _local_rows(ds: grain.MapDataset, batch_size: int, rows: slice | None) -> grain.MapDataset:
    """Global batch b is rows [b*B, (b+1)*B) of `ds`; this process reads only `rows` of it."""
    if rows is None or (rows.start in (0, None) and rows.stop in (batch_size, None)):
        return ds.batch(batch_size, drop_remainder=True)
    start, stop = rows.start, rows.stop

    def local_batch(b: int) -> dict:
        items = [ds[b * batch_size + r] for r in range(start, stop)]
        return {k: np.stack([it[k] for it in items]) for k in items[0]}

    return grain.MapDataset.range(len(ds) // batch_size).map(local_batch)


class BatchIterator:
    """Endless iterator of global batches whose state is the number of the next batch.

    The stream is a pure function of the batch number (a shuffled, repeated `MapDataset`), so
    `{"next_batch": n}` restores the exact position whatever `data.workers` was when it was
    saved, and a checkpoint stays small and readable. Grain builds the batches, in-process or in
    `workers` processes (`mp_prefetch`: worker w makes batches w, w + workers, ..., returned in
    order); `set_state` reopens the Grain iterator at batch n, starting workers on first use.
    """

    def __init__(self, batches: grain.MapDataset, workers: int):
        self._batches, self._workers = batches, workers
        self._next, self._it = 0, None
        self._closer = None

    def _open(self):
        ds = self._batches[self._next :].to_iter_dataset()
        if self._workers > 0:
            from absl import flags

            # Grain <= 0.2.18 reads an absl flag when starting workers and fails if the program
            # never parsed absl flags (google/grain#1355, fixed by #1362); defaults are wanted.
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers))
        it = iter(ds)
        if hasattr(it, "close"):
            # stop the workers and free their shared memory even if nobody calls close(): at
            # garbage collection or interpreter exit (else Python reports leaked shared_memory)
            self._closer = weakref.finalize(self, it.close)
        return it

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self._it = self._open()
        batch = next(self._it)
        self._next += 1
        if self._workers > 0:
            # workers hand over arrays in shared memory, freed only when the last reference to
            # them dies; a copy (a few hundred KB) frees it now, whoever keeps the batch
            batch = {k: np.array(v) for k, v in batch.items()}
        return batch

    def get_state(self) -> dict:
        return {"next_batch": self._next}

    def set_state(self, state: dict) -> None:
        self.close()
        self._next = int(state["next_batch"])

    def close(self) -> None:
        """Stops the worker processes (also done when the iterator is garbage-collected)."""
        if self._closer is not None:
            self._closer()  # runs it.close() at most once
        self._it, self._closer = None, None


def train_batches(
    rows: Rows | MixtureRows | CurriculumRows,
    cfg: DataConfig,
    batch_size: int,
    local: slice | None = None,
    transform=None,
) -> BatchIterator:
    """Endless global batches of `batch_size` rows: shuffled, a new permutation every epoch
    (fixed by `data.seed`), or in the rows' own order when `data.order` is length or curriculum
    (`load_splits` put them in that order); each process gets only its `local` rows of every
    batch. Batches are made in `data.workers` Grain processes when that is above 0 (the same
    stream as in-process); `get_state()` / `set_state()` save and restore the position.
    `transform(index, row)`, when given, rewrites row number `index` of the stream (masked LM's
    corruption, `data.mlm`)."""
    ds = grain.MapDataset.source(rows)
    if cfg.order == "shuffled":
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat()
    if transform is not None:
        ds = ds.map_with_index(transform)
    return BatchIterator(_local_rows(ds, batch_size, local), cfg.workers)


def eval_batches(
    rows: Rows | MixtureRows | CurriculumRows | None,
    batch_size: int,
    num_batches: int,
    local: slice | None = None,
    transform=None,
) -> list[dict]:
    """The same first `num_batches` batches of the held-out rows at every evaluation, each row
    rewritten by `transform(index, row)` when given (as `train_batches`); none when `rows` is
    None (no held-out split). Every row of the first `num_batches * batch_size` is read: a last
    part-batch (a split of fewer rows than one batch is one) is filled up with padding rows (all
    zeros: no segment, loss_mask 0), which every objective leaves out of its sums and its
    counts."""
    if rows is None:
        return []
    if len(rows) == 0:
        raise ConfigError("the eval split has no rows; add eval data or raise data.eval_fraction.")
    n = min(num_batches * batch_size, len(rows))
    ds = grain.MapDataset.source(rows)[:n]
    if transform is not None:
        ds = ds.map_with_index(transform)
    full = _local_rows(ds, batch_size, local)  # the whole batches; a part-batch is dropped
    batches = [{k: np.asarray(v) for k, v in full[i].items()} for i in range(len(full))]
    if n % batch_size:
        items = [ds[i] for i in range(n - n % batch_size, n)]
        pad = {k: np.zeros_like(v) for k, v in items[0].items()}
        items += [pad] * (batch_size - len(items))
        items = items[local] if local is not None else items
        batches.append({k: np.stack([it[k] for it in items]) for k in items[0]})
    return batches
