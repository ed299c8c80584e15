"""Step-labelled solutions for process reward models (`train.objective=prm`): records ->
token sequences with a label at the end of every step -> first-fit rows.

A `format: stepwise` record is TRL's `stepwise_supervision` shape: a prompt (the source's
`prompt_field`, a string), the solution's steps in `completions` (a list of strings) and one
boolean per step in `labels` (whether the step is correct):

    {"prompt": "2 + 3 * 4 =", "completions": ["3 * 4 = 12", "2 + 12 = 15"],
     "labels": [true, false]}

Tokenized as TRL's `PRMTrainer.tokenize_row` does: the prompt's ids (after BOS, per
`data.add_bos`), then each step's ids followed by the separator's ("\\n", `STEP_SEPARATOR`),
each piece encoded on its own; no EOS. A step's label sits at its last token, the separator,
and no other token is scored. A row holds whole sequences first-fit, each its own segment,
with `inputs` every token of the sequence (no shift: a token classifier reads each token),
`targets` the label (0 / 1) at the scored tokens and `loss_mask` 1 there. A sequence longer
than a row is cut to it (`data.truncation=truncate`, keeping the steps whose separator fits)
or left out (`drop`). A record without labels is a ConfigError whatever `data.on_bad_record`
says: a PRM cannot learn from it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxllm.config import ConfigError, DataConfig, JaxllmWarning, SourceConfig
from jaxllm.data import sft
from jaxllm.data.packing import first_fit
from jaxllm.data.sources import BadRecords, DataFile

STEP_SEPARATOR = "\n"  # TRL's PRMConfig.step_separator
FIELDS = ("completions", "labels")


class Solution(NamedTuple):
    """One record: the prompt, its steps and a label per step."""

    prompt: str
    steps: tuple[str, ...]
    labels: tuple[bool, ...]


@dataclasses.dataclass
class Solutions:
    """Tokenized solutions: per solution the ids and the label of each token (-1: unscored)."""

    tokens: list[np.ndarray]
    labels: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.tokens)


def is_stepwise(src: SourceConfig) -> bool:
    return src.format == "stepwise"


def bad_records(key: str, src: SourceConfig) -> BadRecords:
    expected = (
        f"objects with a string prompt {src.prompt_field!r}, a list of step strings "
        "'completions' and a list of booleans 'labels', one per step"
    )
    return BadRecords(key, src.text_field, expected)


def _solution(record: dict, src: SourceConfig, where: str) -> Solution | str:
    """The solution a record holds, or why it holds none (ConfigError: no step labels)."""
    prompt, steps = record.get(src.prompt_field), record.get("completions")
    if not isinstance(prompt, str):
        return f"has no string field {src.prompt_field!r} (set the source's prompt_field)"
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        return "has no non-empty list of step strings in field 'completions'"
    labels = record.get("labels")
    if labels is None:
        raise ConfigError(
            f"data {where} has no step labels (field 'labels'): train.objective=prm needs one "
            "boolean per step; label the steps or use another objective."
        )
    if not isinstance(labels, list) or not all(isinstance(x, bool) for x in labels):
        raise ConfigError(
            f"data {where}: field 'labels' must be a list of booleans (true / false), one per "
            f"step, not {labels!r}."
        )
    if len(labels) != len(steps):
        return f"has {len(labels)} labels for {len(steps)} steps"
    return Solution(prompt, tuple(steps), tuple(labels))


def read_solutions(
    f: DataFile, src: SourceConfig, tok, on_bad_record: str = "skip", bad: BadRecords | None = None
) -> Iterator[Solution]:
    """The solutions of one file of a stepwise source, in file order; a malformed record is
    skipped into `bad` or, with `fail`, a ConfigError naming its file and line."""
    bad = bad or bad_records(str(f.path), src)
    columns = {"prompt_field": src.prompt_field, **{k: k for k in FIELDS}}
    for where, record in sft._records(f, columns, on_bad_record, bad):
        solution = _solution(record, src, where)
        if isinstance(solution, str):
            sft._bad(solution, where, on_bad_record, bad)
            continue
        yield solution


def encode_solution(tok, prompt: str, steps: Sequence[str], labels, add_bos: bool):
    """(ids, per-token labels: the step's label at its separator, -1 elsewhere) of one
    solution, as TRL's PRMTrainer.tokenize_row lays them out. `labels` None: all -1 (a
    solution to score rather than learn from; the scores are read at the separators)."""
    sep = list(tok.encode(STEP_SEPARATOR))
    ids = ([tok.bos_id] if add_bos and tok.bos_id is not None else []) + list(tok.encode(prompt))
    out = [-1] * len(ids)
    for k, step in enumerate(steps):
        piece = list(tok.encode(step)) + sep
        ids += piece
        label = 1 if labels is None else int(labels[k])
        out += [-1] * (len(piece) - 1) + [label]
    return np.asarray(ids, np.int32), np.asarray(out, np.int32)


def encode_solutions(tok, solutions: Sequence[Solution], add_bos: bool) -> Solutions:
    out = Solutions([], [])
    for s in solutions:
        ids, labels = encode_solution(tok, s.prompt, s.steps, s.labels, add_bos)
        out.tokens.append(ids)
        out.labels.append(labels)
    return out


def pack_solutions(ex: Solutions, cfg: DataConfig, tok, what: str) -> StepRows:
    """Rows of whole solutions, `data.truncation` on those longer than a row (one warning)."""
    if cfg.train_on_prompt:
        raise ConfigError(
            f"{what}: data.train_on_prompt does not apply to format: stepwise sources, whose "
            "loss covers the step labels only; set it to false."
        )
    tokens, labels, long = [], [], 0
    for ids, lab in zip(ex.tokens, ex.labels):
        if len(ids) > cfg.seq_len:
            long += 1
            if cfg.truncation == "drop":
                continue
            ids, lab = ids[: cfg.seq_len], lab[: cfg.seq_len]
        if (lab >= 0).any():
            tokens.append(ids)
            labels.append(lab)
    if long:
        done = "cut to fit" if cfg.truncation == "truncate" else "left out"
        warnings.warn(
            f"{what}: {long} of {len(ex)} solutions are longer than data.seq_len={cfg.seq_len} "
            f"and were {done} (data.truncation={cfg.truncation}).",
            JaxllmWarning,
            stacklevel=3,
        )
    if not tokens:
        raise ConfigError(
            f"{what}: none of its {len(ex)} solutions keeps a labelled step within a row of "
            f"data.seq_len={cfg.seq_len}; raise data.seq_len"
            + " or set data.truncation=truncate" * (cfg.truncation == "drop")
            + "."
        )
    return StepRows(tokens, labels, cfg.seq_len, tok.pad_id)


class StepRows:
    """First-fit rows of whole step-labelled solutions (see the module docstring), a Grain
    random-access source; `num_docs` counts solutions."""

    def __init__(self, tokens: list[np.ndarray], labels: list[np.ndarray], seq_len, pad_id):
        self.seq_len, self.pad_id = seq_len, pad_id
        lengths = np.array([len(t) for t in tokens], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self.tokens, self.labels = np.concatenate(tokens), np.concatenate(labels)
        self.num_docs = len(tokens)
        rows = first_fit(lengths, seq_len)
        self._len = int(rows.max()) + 1
        self._docs = np.argsort(rows, kind="stable")  # by row, in record order within one
        self._row_ptr = np.searchsorted(rows[self._docs], np.arange(self._len + 1))

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        row = {k: np.zeros(self.seq_len, np.int32) for k in ("targets", "segment_ids", "positions")}
        row["inputs"] = np.full(self.seq_len, self.pad_id, np.int32)
        row["loss_mask"] = np.zeros(self.seq_len, np.int32)
        at = 0
        for k, doc in enumerate(self._docs[self._row_ptr[index] : self._row_ptr[index + 1]]):
            start, stop = self._starts[doc], self._starts[doc + 1]
            n, lab = stop - start, self.labels[start:stop]
            row["inputs"][at : at + n] = self.tokens[start:stop]
            row["targets"][at : at + n] = np.maximum(lab, 0)
            row["loss_mask"][at : at + n] = lab >= 0
            row["segment_ids"][at : at + n] = k + 1
            row["positions"][at : at + n] = np.arange(n)
            at += n
        return {k: row[k] for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}


def to_record(ids: np.ndarray, labels: np.ndarray) -> bytes:
    """A prepared shard's record of one solution encoded without BOS (`jaxllm data prepare`):
    the int32 ids (little-endian), then one int8 label per id (-1: unscored)."""
    return ids.astype("<i4").tobytes() + labels.astype(np.int8).tobytes()


def from_records(records, bos_id: int | None) -> Solutions:
    """The solutions of prepared records (`to_record`), BOS first (unscored) when `bos_id`."""
    out = Solutions([], [])
    head = [] if bos_id is None else [bos_id]
    for record in records:
        n = len(record) // 5
        ids = np.frombuffer(record, "<i4", n)
        labels = np.frombuffer(record, np.int8, n, 4 * n)
        out.tokens.append(np.asarray([*head, *ids], np.int32))
        out.labels.append(np.asarray([-1] * len(head) + list(labels), np.int32))
    return out
