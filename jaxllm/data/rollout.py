"""Rollout prompts: the `format: rollout` records GRPO samples its completions from.

A record holds a prompt and the answer a reward checks completions against, read from the
source's `prompt_field` and `answer_field` (JSONL lines or Parquet rows):

    {"prompt": "12+34=", "answer": "46"}
    {"prompt": [{"role": "user", "content": "12+34?"}], "answer": "46"}

A string prompt is encoded after BOS (`data.add_bos`), as the prompt of a prompt_completion
example; a chat prompt is rendered by the tokenizer's chat template with the generation prompt
(the assistant turn's opening), as the chat examples of SFT are, so a model fine-tuned on those
completes it in the same format. Nothing is packed: the rollout makes the rows.

With a vision-language model (`images`: the run's `vision_rows.ImageInputs`), a chat prompt's
contents may be lists of text and image parts (`jaxllm.data.vision_chat`), and the prompt field
may hold one such list of parts (the user turn). Image paths are read under the file's directory;
each image's pad token is expanded to its token count, and the prompt keeps its `pixels`. A chat
whose last turn is the assistant's and whose record has no answer field (a `chat` row such as
shapes-vqa's, read with `prompt_field: messages`) is the prompt before that turn, its content the
answer. Image parts with a text-only model are refused (ConfigError).

On-policy distillation samples from the prompts of packed SFT examples instead
(`example_prompts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import chat, images, sft, vision_chat
from jaxllm.data.sources import BadRecords, list_files
from jaxllm.data.split import split_source


class Prompt(NamedTuple):
    """One rollout prompt: its token ids, the answer, and the prompt as written (for a reward
    function of your own)."""

    ids: np.ndarray
    answer: Any
    prompt: Any
    pixels: images.Pixels | None = None  # a vision-language model's prompt images


def bad_records(key: str, src: SourceConfig) -> BadRecords:
    expected = (
        f"objects with a prompt field {src.prompt_field!r} (a string or chat messages) and an "
        f"answer field {src.answer_field!r}"
    )
    return BadRecords(key, src.text_field, expected)


def _image_prompt(messages, tok, inp, base_dir):
    """(ids with each image's pad expanded, pixels or None), or why it has none."""
    try:
        flat, sources = vision_chat.flatten(messages, inp.tokens)
        text = chat.render(flat, tok, add_generation_prompt=True)
    except chat.ChatError as e:
        return f"cannot be rendered ({e})"
    ids = np.asarray(tok.encode_offsets(text, specials=True)[0], np.int32)
    if not sources:
        return ids, None
    at = np.flatnonzero(ids == inp.tokens.pad_id(tok))
    if len(at) != len(sources):
        return f"holds {len(at)} image placeholder(s) for {len(sources)} image part(s)"
    try:
        pixels = images.load_pixels(sources, inp.spec, base_dir)
    except images.ImageError as e:
        return f"holds an unusable {e}"
    repeats = np.ones(len(ids), np.int64)
    repeats[at] = images.tokens_of_grid(pixels.image_grid_thw, inp.spec.merge_size)
    return np.repeat(ids, repeats).astype(np.int32), pixels


def _prompt_ids(prompt, tok, add_bos: bool, inp=None, base_dir=None):
    """(the prompt's ids, its pixels or None), or why it has none. `inp`: the run's
    `ImageInputs` (None: a text-only model)."""
    if isinstance(prompt, str):
        if not prompt:
            return "has an empty prompt"
        ids = np.asarray(tok.encode(prompt), np.int32)
        bos = getattr(tok, "bos_id", None)
        if add_bos and bos is not None:
            ids = np.concatenate([[bos], ids]).astype(np.int32)
        return ids, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, dict) and "role" not in p and "type" in p for p in prompt)
    ):  # the user turn's content parts
        prompt = [{"role": "user", "content": prompt}]
    content = (str, list) if inp is not None else str
    if not isinstance(prompt, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), content) for m in prompt
    ):
        return "has a prompt that is neither a string nor a list of {role, content} messages"
    if not any(m.get("role") == "user" for m in prompt):
        return "has a chat prompt without a user turn"
    if inp is not None:
        return _image_prompt(prompt, tok, inp, base_dir)
    try:
        text = chat.render(prompt, tok, add_generation_prompt=True)
    except chat.ChatError as e:
        return f"cannot be rendered ({e})"
    return np.asarray(tok.encode_offsets(text, specials=True)[0], np.int32), None


def _has_image(prompt) -> bool:
    parts = [prompt] if isinstance(prompt, list) else []
    parts += [m.get("content") for m in parts[0] if isinstance(m, dict)] if parts else []
    return any(isinstance(p, list) and any(map(chat.is_image_part, p)) for p in parts)


def _file_prompts(f, src, cfg: DataConfig, tok, bad: BadRecords, inp=None) -> list[Prompt]:
    """The prompts of one file of `src`, in record order."""
    out = []
    columns = {"prompt_field": src.prompt_field, "answer_field": src.answer_field}
    for where, record in sft._records(f, columns, cfg.on_bad_record, bad):
        prompt, answer = record.get(src.prompt_field), record.get(src.answer_field)
        if src.answer_field not in record and isinstance(prompt, list) and len(prompt) > 1:
            last = prompt[-1]  # a chat row: the prompt before its last (assistant) turn
            if isinstance(last, dict) and last.get("role") == "assistant":
                prompt, answer = prompt[:-1], last.get("content")
        if answer is None and src.answer_field not in record:
            why = f"has no field {src.answer_field!r} (set the source's answer_field)"
            sft._bad(why, where, cfg.on_bad_record, bad)
            continue
        if inp is None and _has_image(prompt):
            raise ConfigError(
                f"{where} holds an image part, but model.vision is null: a text-only model "
                "cannot take images; use a vision-language model or text prompts."
            )
        got = _prompt_ids(prompt, tok, cfg.add_bos, inp, f.path.parent)
        if isinstance(got, str):
            sft._bad(got, where, cfg.on_bad_record, bad)
            continue
        out.append(Prompt(got[0], answer, prompt, got[1]))
    return out


def read_prompts(
    sources: Sequence[SourceConfig],
    cfg: DataConfig,
    tok,
    key: str = "data.sources",
    eval_fraction: float = 0.0,
    inp=None,
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) prompts of every file of `sources` (files in path order, records in
    file order). With `eval_fraction` > 0 each source holds out that fraction of its files, or
    of its records when it has too few files, by the same rule as every other format
    (`jaxllm.data.split.split_source`); otherwise nothing is held out. ConfigError naming `key`
    when the sources hold no prompt. `inp`: a vision-language model's `ImageInputs`."""
    train, held = [], []
    for i, src in enumerate(sources):
        where_key = f"{key}[{i}]"
        files = list_files(src, where_key, cfg.max_files)
        bad = bad_records(where_key, src)
        per_file = [_file_prompts(f, src, cfg, tok, bad, inp) for f in files]
        bad.warn()
        if eval_fraction > 0 and any(per_file):
            t, e = split_source(files, per_file, eval_fraction, where_key)
        else:
            t, e = [p for ps in per_file for p in ps], []
        train += t
        held += e
    if not train and sources:
        raise ConfigError(f"{key} hold no rollout prompt; see docs/alignment.md for the format.")
    return train, held


def prompt_splits(cfg: DataConfig, tok, inp=None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) rollout prompts of a run: `data.eval_sources` when set; otherwise
    `data.eval_fraction` of `data.sources` held out (0: no eval prompts). `inp`: a
    vision-language model's `ImageInputs` (the tokenizer's image ids are checked when a prompt
    holds an image)."""
    if cfg.eval_sources:
        train = read_prompts(cfg.sources, cfg, tok, inp=inp)[0]
        held = read_prompts(cfg.eval_sources, cfg, tok, "data.eval_sources", inp=inp)[0]
    else:
        train, held = read_prompts(cfg.sources, cfg, tok, eval_fraction=cfg.eval_fraction, inp=inp)
    if any(p.pixels is not None for p in (*train, *held)):
        inp.check(tok)
    return train, held


def example_prompts(rows) -> list[np.ndarray]:
    """The prompts of the SFT examples packed in `rows` (`FirstFitRows` with loss masks, or a
    `MixtureRows` of them), in corpus order, for on-policy distillation: each example's tokens
    before its last trained span, so a prompt_completion example's BOS + prompt, and a
    conversation up to its last assistant reply (the template's opening of that reply
    included). An example trained from its first token (`data.train_on_prompt`) has no prompt
    and is left out. ConfigError when `rows` are not SFT examples (text has no prompts)."""
    out = []
    for part in getattr(rows, "parts", [rows]):
        masks = getattr(part, "masks", None)
        if masks is None:
            raise ConfigError(
                "on-policy distillation (train.distill_lambda > 0) samples completions of the "
                "prompts of chat or prompt_completion examples, but data.sources hold text."
            )
        starts = part.doc_starts
        for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
            trained = np.flatnonzero(masks[a:b])
            untrained = np.flatnonzero(~masks[a : a + trained[-1]]) if len(trained) else []
            if len(untrained):  # the last trained span starts after its last untrained token
                out.append(np.asarray(part.tokens[a : a + untrained[-1] + 1], np.int32))
    return out
