"""Unpaired preferences: records of one answer marked desirable or not, for KTO
(`jaxllm.objectives.kto`), as preference pairs of (the example, its mismatched sequence).

A `format: unpaired_preference` record holds a prompt, one completion and a boolean label
(true: desirable, thumbs up) in the source's `prompt_field`, `completion_field` and
`label_field`, in the string or the conversational form of `format: preference` records
(`jaxllm.data.preference`; TRL's unpaired preference type):

    {"prompt": "2 + 2 =", "completion": " 4", "label": true}
    {"prompt": [{"role": "user", "content": "2 + 2?"}],
     "completion": [{"role": "assistant", "content": "5"}], "label": false}

KTO's reference point is KL(pi || pi_ref) estimated on mismatched (prompt, completion) pairs
(Ethayarajh et al. 2024, arXiv:2402.01306, §4.1): each record is read as a pair whose first
sequence is prompt + its own completion and whose second is prompt + the completion of the
record before it in its file (the first record takes the last one's), TRL's rotation of the
completions by one (`KTOTrainer`, `KL_completion_ids`), done once per file instead of per
batch. The pair is packed as a preference pair is, so the mismatched sequence travels in the
same row, and the row's `label` array marks the tokens of desirable examples' pairs. A label
that is not a boolean is an error whatever `data.on_bad_record` says: guessing what 1, "yes"
or null mean would train on wrong feedback.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxllm.config import ConfigError, SourceConfig
from jaxllm.data import preference, sft
from jaxllm.data.sources import BadRecords, DataFile

FIELDS = ("prompt_field", "completion_field", "label_field")


def is_unpaired(src: SourceConfig) -> bool:
    return src.format == "unpaired_preference"


def bad_records(key: str, src: SourceConfig) -> BadRecords:
    """A BadRecords whose warning says what a good unpaired record is."""
    expected = (
        f"objects with a prompt {src.prompt_field!r} (a string, or chat messages with a user "
        f"turn), a non-empty completion {src.completion_field!r} and a boolean "
        f"{src.label_field!r}"
    )
    return BadRecords(key, src.text_field, expected)


def _as_text(value) -> str:
    """A string prompt's mismatched completion: a chat answer's contents, joined."""
    return value if isinstance(value, str) else "".join(m["content"] for m in value)


def read_examples(
    f: DataFile, src: SourceConfig, tok, on_bad_record: str = "skip", bad: BadRecords | None = None
) -> Iterator[preference.Pair]:
    """The examples of one file as (example, mismatched) pairs with their labels, in file order
    (see the module docstring); a malformed record is skipped into `bad` or, with `fail`, a
    ConfigError; a label that is not a boolean is always a ConfigError."""
    bad = bad or bad_records(str(f.path), src)
    columns = {k: getattr(src, k) for k in FIELDS}
    kept = []  # (where, prompt, completion, label)
    for where, record in sft._records(f, columns, on_bad_record, bad):
        label = record.get(src.label_field)
        if not isinstance(label, bool | np.bool_):
            raise ConfigError(
                f"{where} has label {label!r} in field {src.label_field!r}; format: "
                "unpaired_preference labels are booleans (true: desirable, false: undesirable)."
            )
        prompt = record.get(src.prompt_field)
        why = preference.prompt_problem(prompt, src)
        chat_prompt = not isinstance(prompt, str)
        if why is None:
            value = record.get(src.completion_field)
            completion, why = preference.answer(value, "completion_field", src, chat_prompt)
        if why is not None:
            sft._bad(why, where, on_bad_record, bad)
            continue
        kept.append((where, prompt, completion, bool(label)))
    for i, (where, prompt, completion, label) in enumerate(kept):
        other = kept[i - 1][2]  # the completion before, cyclically: TRL's rotation by one
        if isinstance(prompt, str):
            other = _as_text(other)
        elif isinstance(other, str):
            other = [{"role": "assistant", "content": other}]
        examples = preference.sequences(prompt, [completion, other], tok)
        if isinstance(examples, str):
            sft._bad(examples, where, on_bad_record, bad)
            continue
        yield preference.Pair(*examples, not isinstance(prompt, str), label)
