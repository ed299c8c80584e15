"""Preference pairs: records -> a chosen and a rejected sequence with loss masks -> rows of whole
pairs, for the DPO family (`jaxllm.objectives.preference`) and reward models.

A `format: preference` record holds a prompt and two answers to it, the preferred and the
dispreferred one, in the source's `prompt_field`, `chosen_field` and `rejected_field` (rows of a
.parquet file, lines of any other file read as JSONL, as `jaxllm.data.sft` reads its formats):

    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
    {"prompt": [{"role": "user", "content": "2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}

With a string prompt, each sequence is the prompt's text followed by the answer's, tokenized as
`prompt_completion` examples are, between BOS and EOS per `data.add_bos` / `data.add_eos` (EOS
trained). With a chat prompt (messages up to the last user turn; earlier assistant turns are
context), each answer is a list of assistant messages, or a string taken as one assistant
message's content, and the sequence is prompt + answer rendered by the tokenizer's chat
template (`jaxllm.data.chat`) as `chat` examples are. Either way the loss mask covers the
answer only (its assistant turns, end-of-turn marker included), never the prompt.

Packing keeps a pair together and apart: pair k of a row is segments 2k + 1 (chosen) and
2k + 2 (rejected), so neither sequence attends to the other, and whole pairs are placed first-fit
(`packing.first_fit`), in record order. A pair takes (n_c - 1) + (n_r - 1) slots for sequences of
n_c and n_r tokens; one longer than a row is cut (`data.truncation=truncate`) or left out (`drop`),
counted in one warning per source (and in `PairRows.truncated`), as `sft.pack_examples` does.
Cut as TRL's DPOTrainer cuts (`max_prompt_length` with the prompt's `keep_end`, then
`max_completion_length`): the prompt (the tokens both sequences share before an answer) loses its
start, BOS kept, keeping at least a quarter of a row of it when the answers need the room; then the
answers lose their ends, the longer one first, both to half of what is left when both are long.
A pair that fits is never changed. A pair whose chosen or rejected sequence keeps no trained
token is left out either way.

`whole_inputs=True` (reward models) gives each sequence one more slot whose input is the
sequence's last token (its target is padding, loss_mask 0): the last input position of each
segment then holds the whole sequence, where a reward model reads its score.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxllm.config import ConfigError, DataConfig, JaxllmWarning, SourceConfig
from jaxllm.data import chat, conversations, sft
from jaxllm.data.packing import first_fit
from jaxllm.data.sources import BadRecords, DataFile

FIELDS = ("prompt_field", "chosen_field", "rejected_field")


class Pair(NamedTuple):
    """One record: the chosen and rejected sequences as text with their trained spans, and
    whether they are chat renderings (their specials are read as such, no BOS/EOS is added)."""

    chosen: sft.Example
    rejected: sft.Example
    is_chat: bool
    label: bool | None = None  # unpaired rows (`jaxllm.data.unpaired`): desirable or not


@dataclasses.dataclass
class Pairs:
    """Tokenized pairs: per pair the ids and loss masks of both sequences, and whether they are
    chat renderings."""

    chosen: list[tuple[np.ndarray, np.ndarray]]
    rejected: list[tuple[np.ndarray, np.ndarray]]
    is_chat: list[bool]
    labels: list[bool | None] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chosen)


def is_preference(src: SourceConfig) -> bool:
    """Pairs of sequences: `preference` records, or `unpaired_preference` ones, each paired with
    its mismatched sequence (`jaxllm.data.unpaired`)."""
    return src.format in ("preference", "unpaired_preference")


def bad_records(key: str, src: SourceConfig) -> BadRecords:
    """A BadRecords whose warning says what a good preference record is."""
    expected = (
        f"objects with a prompt {src.prompt_field!r} (a string, or chat messages with a user "
        f"turn) and non-empty answers {src.chosen_field!r} and {src.rejected_field!r}"
    )
    return BadRecords(key, src.text_field, expected)


def messages_problem(messages, what: str) -> str | None:
    """Why `messages` is not a list of chat messages, or None."""
    if not isinstance(messages, list) or not messages:
        return f"has a {what} that is neither a string nor a list of messages"
    for n, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            return f"has {what} message {n} without string content"
        if m.get("role") not in chat.ROLES:
            return f"has {what} message {n} whose role is not one of {', '.join(chat.ROLES)}"
    return None


def answer(value, key: str, src: SourceConfig, chat_prompt: bool):
    """(the answer of field `key`: a string for string prompts, assistant messages for chat
    prompts; None) or (None, why the record holds none)."""
    field = getattr(src, key)
    what = key.removesuffix("_field")
    if value is None:
        return None, f"has no field {field!r} (set the source's {key})"
    if isinstance(value, str):
        if not value.strip():
            return None, f"has an empty {what} answer"
        return ([{"role": "assistant", "content": value}] if chat_prompt else value), None
    if not chat_prompt:
        return None, f"has a {what} answer in field {field!r} that is not a string"
    why = messages_problem(value, what)
    if why is not None:
        return None, why
    if any(m["role"] != "assistant" for m in value):
        return None, f"has a {what} answer with a message that is not an assistant turn"
    if not any(m["content"].strip() for m in value):
        return None, f"has an empty {what} answer"
    return value, None


def prompt_problem(prompt, src: SourceConfig) -> str | None:
    """Why `prompt` is neither a string nor chat messages with a user turn, or None."""
    if prompt is None:
        return f"has no field {src.prompt_field!r} (set the source's prompt_field)"
    if isinstance(prompt, str):
        return None
    why = messages_problem(prompt, "prompt")
    if why is None and not any(m["role"] == "user" for m in prompt):
        return "has a chat prompt without a user turn"
    return why


def _pair(record: dict, src: SourceConfig, tok) -> Pair | str:
    """The pair a record holds, or why it holds none."""
    prompt = record.get(src.prompt_field)
    given = [record.get(src.chosen_field), record.get(src.rejected_field)]
    if prompt is None and src.format == "preference":  # TRL's implicit prompt
        prompt, *given = conversations.implicit_prompt(*given)
    why = prompt_problem(prompt, src)
    if why is not None:
        return why
    chat_prompt = not isinstance(prompt, str)
    answers = []
    for key, value in zip(("chosen_field", "rejected_field"), given):
        value, why = answer(value, key, src, chat_prompt)
        if why is not None:
            return why
        answers.append(value)
    examples = sequences(prompt, answers, tok)
    return examples if isinstance(examples, str) else Pair(*examples, chat_prompt)


def sequences(prompt, answers, tok) -> list[sft.Example] | str:
    """The examples prompt + answer, one per answer (checked by `answer`), the loss on the
    answer only; or why one cannot be rendered."""
    if isinstance(prompt, str):
        return [sft.Example(prompt + a, ((len(prompt), len(prompt + a)),)) for a in answers]
    examples = []
    for turns in answers:
        try:
            text, spans = chat.assistant_spans([*prompt, *turns], tok)
        except chat.ChatError as e:
            return f"cannot be rendered ({e})"
        # the prompt's own assistant turns (earlier in a conversation) are context, not trained
        examples.append(sft.Example(text, tuple(spans[len(spans) - len(turns) :])))
    return examples


def read_pairs(
    f: DataFile, src: SourceConfig, tok, on_bad_record: str = "skip", bad: BadRecords | None = None
) -> Iterator[Pair]:
    """The pairs of one file of a preference source, in file order; a malformed record is
    skipped into `bad` or, with `fail`, a ConfigError naming its file and line."""
    bad = bad or bad_records(str(f.path), src)
    columns = {k: getattr(src, k) for k in FIELDS}
    implicit = ("prompt_field",) if src.format == "preference" else ()  # TRL's implicit prompt
    for where, record in sft._records(f, columns, on_bad_record, bad, implicit):
        pair = _pair(record, src, tok)
        if isinstance(pair, str):
            sft._bad(pair, where, on_bad_record, bad)
            continue
        yield pair


def encode_pairs(tok, pairs: Sequence[Pair]) -> Pairs:
    """Ids and loss masks of both sequences of every pair (see the module docstring)."""
    out = Pairs([], [], [])
    for pair in pairs:
        for ex, into in ((pair.chosen, out.chosen), (pair.rejected, out.rejected)):
            ids, offsets = tok.encode_offsets(ex.text, specials=pair.is_chat)
            into.append((ids, sft.token_mask(offsets, ex.spans, len(ex.text))))
        out.is_chat.append(pair.is_chat)
        out.labels.append(pair.label)
    return out


def _prompt_len(pair) -> int:
    """Tokens the two sequences share before either's first trained token: the prompt."""
    (ids_c, mask_c), (ids_r, mask_r) = pair
    n = min(len(ids_c), len(ids_r))
    differ = np.flatnonzero(ids_c[:n] != ids_r[:n])
    shared = int(differ[0]) if len(differ) else n
    firsts = [int(np.argmax(m)) if m.any() else len(m) for m in (mask_c, mask_r)]
    return min(shared, *firsts)


def _cut(pair, slots: int, lead: int):
    """The pair cut to fit `slots` predictions as TRL's DPOTrainer cuts it: the prompt from its
    start (its first `lead` tokens, BOS, are kept), to no fewer than a quarter of a row when the
    answers need the room, then the answers from their ends, the longer one first, both to half
    what is left when both are long."""
    p = _prompt_len(pair)
    lead = min(lead, p)
    c, r = (len(ids) - p for ids, _ in pair)
    keep = min(p, max(lead, (slots + 2) // 4, (slots + 2 - c - r) // 2))
    room = slots + 2 - 2 * keep  # tokens left for the two answers
    short = min(c, r)
    cap = room - short if 2 * short <= room else room // 2
    return [
        tuple(np.concatenate([x[:lead], x[p - keep + lead : p], x[p : p + cap]]) for x in seq)
        for seq in pair
    ]


def pack_pairs(ex: Pairs, cfg: DataConfig, tok, what: str, whole_inputs: bool = False) -> PairRows:
    """Rows of whole pairs: BOS/EOS around string sequences, `data.truncation` on pairs longer
    than a row, reported in one warning; `whole_inputs` adds each sequence's closing slot (see
    the module docstring)."""
    if cfg.train_on_prompt:
        raise ConfigError(
            f"{what}: data.train_on_prompt does not apply to format: preference sources, whose "
            "losses compare the answers only; set it to false."
        )
    head, tail = [tok.bos_id] * cfg.add_bos, [tok.eos_id] * cfg.add_eos
    extra = int(whole_inputs)
    slots = cfg.seq_len - 2 * extra  # the closing slots come on top of the predictions
    seqs, labels, long, empty, cut = [], [], 0, 0, 0
    unpaired = bool(ex.labels) and ex.labels[0] is not None
    for (ids_c, mask_c), (ids_r, mask_r), is_chat, label in zip(
        ex.chosen, ex.rejected, ex.is_chat, ex.labels or [None] * len(ex)
    ):
        pair = []
        for ids, mask in ((ids_c, mask_c), (ids_r, mask_r)):
            if not is_chat:
                ids = np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])
                mask = np.concatenate(
                    [np.zeros(len(head), np.uint8), mask, np.ones(len(tail), np.uint8)]
                )
            pair.append((ids.astype(np.int32), mask.astype(np.uint8)))
        (ids_c, mask_c), (ids_r, mask_r) = pair
        if len(ids_c) + len(ids_r) - 2 > slots:
            long += 1
            if cfg.truncation == "drop":
                continue
            pair = _cut(pair, slots, 0 if is_chat else len(head))
        if not all(mask[1:].any() for _, mask in pair):  # the first token is never a target
            empty += 1
            continue
        cut += len(ids_c) + len(ids_r) - 2 > slots
        seqs.append(pair)
        labels.append(label)
    if long or empty:
        done = (
            "cut to fit, the prompt's start first" if cfg.truncation == "truncate" else "left out"
        )
        parts = [
            f"{long} of {len(ex)} pairs do not fit a row of data.seq_len={cfg.seq_len} and were "
            f"{done} (data.truncation={cfg.truncation})"
        ] * bool(long)
        parts += [
            f"{empty} kept no trained token of an answer within a row and were left out"
        ] * bool(empty)
        warnings.warn(f"{what}: {'; '.join(parts)}.", JaxllmWarning, stacklevel=3)
    if not seqs:
        raise ConfigError(
            f"{what}: none of its {len(ex)} pairs fits a row of data.seq_len={cfg.seq_len} with a "
            "trained token in both answers; raise data.seq_len"
            + " or set data.truncation=truncate" * (cfg.truncation == "drop")
            + "."
        )
    if whole_inputs:  # the closing slot: input = the last token, target = padding, untrained
        seqs = [
            [
                (np.r_[ids, tok.pad_id].astype(np.int32), np.r_[mask, 0].astype(np.uint8))
                for ids, mask in pair
            ]
            for pair in seqs
        ]
    rows = PairRows(seqs, cfg.seq_len, tok.pad_id, labels if unpaired else None)
    rows.truncated = cut
    return rows


class PairRows:
    """First-fit rows of whole preference pairs, a Grain random-access source (see the module
    docstring); `num_docs` counts pairs. With `labels` (unpaired rows), each row also holds
    `label` [L]: 1 on both segments of a desirable example's pair, 0 elsewhere."""

    def __init__(
        self,
        pairs: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]],
        seq_len: int,
        pad_id: int,
        labels: Sequence[bool] | None = None,
    ):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.labels = None if labels is None else np.asarray(labels, bool)
        seqs = [s for pair in pairs for s in pair]  # chosen, rejected, chosen, ...
        lengths = np.array([len(ids) for ids, _ in seqs], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])
        self.tokens = np.concatenate([ids for ids, _ in seqs])
        self.masks = np.concatenate([mask for _, mask in seqs]).astype(bool)
        self.num_docs = len(pairs)
        self.truncated = 0  # pairs cut to fit a row (`pack_pairs`)
        pair_slots = (lengths[0::2] - 1) + (lengths[1::2] - 1)
        rows = first_fit(pair_slots, seq_len)  # bins are numbered in order of first use
        self._len = int(rows.max()) + 1
        self._pairs = np.argsort(rows, kind="stable")  # by row, in record order within one
        self._row_ptr = np.searchsorted(rows[self._pairs], np.arange(self._len + 1))

    def __len__(self) -> int:
        return self._len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} of {self._len}")
        row = {
            k: np.zeros(self.seq_len, np.int32) for k in ("segment_ids", "positions", "loss_mask")
        }
        row["inputs"] = np.full(self.seq_len, self.pad_id, np.int32)
        row["targets"] = np.full(self.seq_len, self.pad_id, np.int32)
        label = np.zeros(self.seq_len, np.int32)
        at = 0
        for k, pair in enumerate(self._pairs[self._row_ptr[index] : self._row_ptr[index + 1]]):
            for s in (2 * pair, 2 * pair + 1):  # chosen: segment 2k + 1, rejected: 2k + 2
                start, stop = self._starts[s], self._starts[s + 1]
                n = stop - start - 1
                row["inputs"][at : at + n] = self.tokens[start : stop - 1]
                row["targets"][at : at + n] = self.tokens[start + 1 : stop]
                row["loss_mask"][at : at + n] = self.masks[start + 1 : stop]
                row["segment_ids"][at : at + n] = 2 * k + 1 + s - 2 * pair
                row["positions"][at : at + n] = np.arange(n)
                if self.labels is not None:
                    label[at : at + n] = self.labels[pair]
                at += n
        keys = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
        return {k: row[k] for k in keys} | ({} if self.labels is None else {"label": label})


def to_record(pairs: Pairs, i: int) -> bytes:
    """Pair i as a prepared shard's record (`jaxllm data prepare`): an int32 header (the chosen
    and rejected lengths, is_chat, the label: -1 none, 0 or 1), both sequences' int32 ids, then
    one loss-mask byte per id, all little-endian."""
    (ids_c, mask_c), (ids_r, mask_r) = pairs.chosen[i], pairs.rejected[i]
    label = pairs.labels[i]
    head = [len(ids_c), len(ids_r), int(pairs.is_chat[i]), -1 if label is None else int(label)]
    ids = np.concatenate([ids_c, ids_r]).astype("<i4")
    masks = np.concatenate([mask_c, mask_r]).astype(np.uint8)
    return np.asarray(head, "<i4").tobytes() + ids.tobytes() + masks.tobytes()


def from_records(records) -> Pairs:
    """The pairs of prepared records (`to_record`)."""
    out = Pairs([], [], [])
    for record in records:
        n_c, n_r, is_chat, label = (int(x) for x in np.frombuffer(record, "<i4", 4))
        n = n_c + n_r
        ids = np.frombuffer(record, "<i4", n, 16)
        masks = np.frombuffer(record, np.uint8, n, 16 + 4 * n)
        out.chosen.append((ids[:n_c], masks[:n_c]))
        out.rejected.append((ids[n_c:], masks[n_c:]))
        out.is_chat.append(bool(is_chat))
        out.labels.append(None if label < 0 else bool(label))
    return out
