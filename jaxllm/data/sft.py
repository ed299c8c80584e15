"""Supervised fine-tuning examples: records -> text with trained spans -> ids with a loss mask ->
whole examples packed first-fit.

A `chat` record holds a conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`, and
a `prompt_completion` record a prompt and its completion, `{"prompt": ..., "completion": ...}`
(the fields are the source's `messages_field`, `prompt_field` and `completion_field`); a chat
record may also be in the shape of ShareGPT, Alpaca or TRL's conversational prompt-completion
(`jaxllm.data.conversations`). A .parquet, .csv/.tsv or .arrow file (`jaxllm.data.tables`)
gives one record per row, any other file one per JSONL line.

A conversation is rendered by the tokenizer's chat template (`jaxllm.data.chat`) and tokenized
with the special tokens the template writes read as such, as `apply_chat_template` does; the
template owns BOS and the end-of-turn marker, so nothing is added. A prompt/completion pair is
the prompt's text followed by the completion's, tokenized as documents are (specials spelled in
the text stay text), between BOS and EOS per data.add_bos / data.add_eos, EOS trained: as in
TRL, no template.

The loss mask (1 where a token is a trained target) comes from character spans: a token is
trained when its characters overlap an assistant turn / the completion, a token straddling the
edge included (as transformers' `char_to_token` maps its assistant spans), so tokens that do not
end on a character boundary (byte-level BPE splitting a character, SentencePiece's merged
spaces) are still covered. `data.train_on_prompt` trains every token instead. Prepared shards
keep the mask of the assistant turns; `train_on_prompt`, BOS/EOS and truncation apply when the
examples are packed, so one preparation serves every setting.

Examples are packed first-fit and whole (`FirstFitRows` with their masks): one longer than a row
is cut to one (`data.truncation=truncate`) or left out (`drop`), counted in one warning per
source.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from jaxllm.config import ConfigError, DataConfig, JaxllmWarning, SourceConfig
from jaxllm.data import chat, conversations, tables
from jaxllm.data.packing import FirstFitRows
from jaxllm.data.sources import BadRecords, DataFile, json_lines

KINDS = ("chat", "prompt_completion")
NO_VISION = "the model of this run has no vision tower"  # why text-only reading refuses images


class Example(NamedTuple):
    """One example as text, with the [start, end) character spans the loss covers."""

    text: str
    spans: tuple[tuple[int, int], ...]


@dataclasses.dataclass
class Examples:
    """Tokenized examples of one kind: ids, and per id 1 where it is a trained target."""

    kind: str
    tokens: list[np.ndarray]
    masks: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.tokens)


def is_sft(src: SourceConfig) -> bool:
    return src.format in KINDS


def bad_records(key: str, src: SourceConfig) -> BadRecords:
    """A BadRecords whose warning says what a good `src` record is."""
    if src.format == "chat":
        expected = "conversations of system/user/assistant messages with an assistant turn"
    else:
        expected = f"objects with string fields {src.prompt_field!r} and {src.completion_field!r}"
    return BadRecords(key, src.text_field, expected)


def _bad(why: str, where: str, on_bad_record: str, bad: BadRecords) -> None:
    if on_bad_record == "fail":
        raise ConfigError(f"{where} {why}; fix it or set data.on_bad_record=skip.")
    bad.record(f"{where} {why}")


def _records(
    f: DataFile, columns: dict[str, str], on_bad_record: str, bad: BadRecords, optional=()
):
    """(where, record) of each Parquet row or JSONL line; `columns` maps config keys to fields,
    those of `optional` keys may be absent."""
    if tables.is_table(f.path):
        yield from _table_records(f, columns, optional)
        return
    for where, record in json_lines(f, on_bad_record, bad):
        if not isinstance(record, dict):
            _bad("is not a JSON object", where, on_bad_record, bad)
            continue
        yield where, record


def _table_records(f: DataFile, columns: dict[str, str], optional=()):
    table = tables.Table(f.path)
    names = table.names
    if columns == {"messages_field": "messages"} and "messages" not in names:
        columns = {name: name for name in names}  # another shape (`jaxllm.data.conversations`)
    if "messages_field" in columns:  # images beside the turns (`conversations.images_of`)
        columns |= {k: k for k in conversations.IMAGE_KEYS if k in names}
    columns = {k: c for k, c in columns.items() if c in names or k not in optional}
    for key, column in columns.items():
        if column not in names:
            raise ConfigError(
                f"{table.what} file {f.path} has no column {column!r} (columns: "
                f"{', '.join(names)}); set the source's {key}."
            )
    for row, record in enumerate(table.rows(list(columns.values())), 1):
        yield f"{f.path} row {row}", record


def _message_problem(messages, field: str) -> str | None:
    """Why `messages` is not a conversation to train on, or None."""
    if not isinstance(messages, list) or not messages:
        return f"has no list of messages in field {field!r} (set the source's messages_field)"
    for n, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            return f"has message {n} that is not an object"
        if not isinstance(m.get("role"), str):
            return f"has message {n} without a string role"
        if m["role"] not in chat.ROLES:
            return f"has message {n} with role {m['role']!r} (roles are {', '.join(chat.ROLES)})"
        if not isinstance(m.get("content"), str):
            return f"has message {n} whose content is not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant message"
    return None


def _example(record: dict, src: SourceConfig, tok) -> Example | str:
    """The example a record holds, or why it holds none."""
    if src.format == "chat":
        messages, trained, why = conversations.messages_of(record, src.messages_field)
        why = why or _message_problem(messages, src.messages_field)
        if why is not None:
            return why
        try:
            text, spans = chat.assistant_spans(messages, tok)
        except chat.ChatError as e:
            return f"cannot be rendered ({e})"
        return Example(text, tuple(spans[len(spans) - trained :] if trained else spans))
    if isinstance(record.get(src.prompt_field), list):
        return "holds a conversational prompt (messages): read it with format: chat"
    for key in ("prompt_field", "completion_field"):
        field = getattr(src, key)
        if not isinstance(record.get(field), str):
            return f"has no string field {field!r} (set the source's {key})"
    prompt = record[src.prompt_field]
    text = prompt + record[src.completion_field]
    return Example(text, ((len(prompt), len(text)),))


def read_examples(
    f: DataFile,
    src: SourceConfig,
    tok,
    on_bad_record: str = "skip",
    bad: BadRecords | None = None,
    no_vision: str = NO_VISION,
) -> Iterator[Example]:
    """The examples of one file of an SFT source, in file order (chats rendered by `tok`'s
    template); a malformed record is skipped into `bad` or, with `fail`, a ConfigError. A chat
    holding an image part is a ConfigError whatever on_bad_record says: text-only reading
    (`no_vision` says why) cannot use it, so skipping would silently train on nothing
    (`jaxllm.data.vision_chat` reads such chats)."""
    bad = bad or bad_records(str(f.path), src)
    keys = ("messages_field",) if src.format == "chat" else ("prompt_field", "completion_field")
    for where, record in _records(f, {k: getattr(src, k) for k in keys}, on_bad_record, bad):
        if src.format == "chat" and (
            chat.image_message(record.get(src.messages_field))
            or conversations.images_of(record) is not None  # LLaVA's image beside the turns
        ):
            raise ConfigError(
                f"data {where} holds an image part, but {no_vision}; train a vision-language "
                "model on it, or remove the image parts from the source."
            )
        example = _example(record, src, tok)
        if isinstance(example, str):
            _bad(example, where, on_bad_record, bad)
            continue
        yield example


def token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]], length: int) -> np.ndarray:
    """uint8 [n]: 1 for each token whose characters [start, end) overlap a span; a token of no
    characters (a BPE piece of a character already counted) counts where it stands."""
    inside = np.zeros(length + 1, np.int64)
    for start, end in spans:
        inside[start:end] = 1
    before = np.concatenate([[0], np.cumsum(inside)])  # trained characters before each position
    start, end = offsets[:, 0], offsets[:, 1]
    overlap = before[end] > before[start]
    at = (start == end) & (inside[np.minimum(start, length)] == 1)
    return (overlap | at).astype(np.uint8)


def encode_examples(tok, examples: Sequence[Example], kind: str) -> Examples:
    """Ids and loss masks of `examples` (see the module docstring); empty examples are left out."""
    out = Examples(kind, [], [])
    for ex in examples:
        ids, offsets = tok.encode_offsets(ex.text, specials=kind == "chat")
        if len(ids):
            out.tokens.append(ids)
            out.masks.append(token_mask(offsets, ex.spans, len(ex.text)))
    return out


def to_record(ids: np.ndarray, mask: np.ndarray) -> bytes:
    """A prepared shard's record: the int32 ids (little-endian), then one mask byte per id."""
    return ids.astype("<i4").tobytes() + mask.astype(np.uint8).tobytes()


def from_record(record: bytes) -> tuple[np.ndarray, np.ndarray]:
    n = len(record) // 5
    return np.frombuffer(record, "<i4", n), np.frombuffer(record, np.uint8, n, 4 * n)


def pack_examples(
    ex: Examples, cfg: DataConfig, tok, what: str, virtual_tokens: int = 0
) -> FirstFitRows:
    """Rows of whole examples: BOS/EOS around prompt_completion ones, `data.train_on_prompt`,
    then `data.truncation` on those longer than a row, reported in one warning. With
    `virtual_tokens` (prompt tuning) every example starts with the placeholder ids -1 .. -n of
    the soft prompt (untrained targets), before its BOS, as Hugging Face PEFT prepends them."""
    wrap = ex.kind == "prompt_completion"
    head = list(range(-1, -virtual_tokens - 1, -1))
    head += [tok.bos_id] if wrap and cfg.add_bos else []
    tail = [tok.eos_id] if wrap and cfg.add_eos else []
    limit = cfg.seq_len + 1  # a row makes seq_len predictions, of seq_len + 1 tokens
    tokens, masks, long, empty = [], [], 0, 0
    for ids, mask in zip(ex.tokens, ex.masks):
        if cfg.train_on_prompt:
            mask = np.ones_like(mask)
        ids = np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])
        mask = np.concatenate([np.zeros(len(head), np.uint8), mask, np.ones(len(tail), np.uint8)])
        if len(ids) > limit:
            long += 1
            if cfg.truncation == "drop":
                continue
            ids, mask = ids[:limit], mask[:limit]
        if not mask[1:].any():  # the first token is never a target
            empty += 1
            continue
        tokens.append(ids)
        masks.append(mask)
    if long or empty:
        done = "cut to that length" if cfg.truncation == "truncate" else "left out"
        parts = [
            f"{long} of {len(ex)} examples are longer than data.seq_len + 1 = {limit} tokens and "
            f"were {done} (data.truncation={cfg.truncation})"
        ] * bool(long)
        parts += [f"{empty} had no trained token within a row and were left out"] * bool(empty)
        warnings.warn(f"{what}: {'; '.join(parts)}.", JaxllmWarning, stacklevel=3)
    if not tokens:
        raise ConfigError(
            f"{what}: none of its {len(ex)} examples has a trained token within a row of "
            f"data.seq_len={cfg.seq_len}; raise data.seq_len"
            + " or set data.truncation=truncate" * (cfg.truncation == "drop")
            + "."
        )
    return FirstFitRows(
        tokens, cfg.seq_len, bos_id=None, eos_id=None, pad_id=tok.pad_id, masks=masks
    )
