"""Chat rows with image parts: token ids, the loss mask, and the pixels of their images, lined up.

A message's content is a string or a list of parts, in any turn:

    {"type": "text", "text": "What is in"}
    {"type": "image", "image": "cat.png"}                              a path or base64 data
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}     (OpenAI's)

The conversation is read in any shape a text chat is (`jaxllm.data.conversations`: TRL's
messages, ShareGPT, Alpaca, ...), and images beside it (LLaVA's `image`, LLaMA-Factory's
`images`, placed where the turns say `<image>`) become image parts. Relative image paths are
read under the data file's directory (`jaxllm.data.images.load_image`).
Each message's parts are joined into one string, an image written as the model's vision markers
around one image pad token (Qwen-VL: `<|vision_start|><|image_pad|><|vision_end|>`, what its chat
template writes for an image part), so any chat template renders it, the built-in ChatML too.
The text is tokenized with specials read as such, the loss mask is `jaxllm.data.sft`'s
(assistant turns only), and then each pad token is expanded to its image's token count
(grid_t * grid_h * grid_w / merge_size², `images.tokens_of_grid`), never trained, as the
Qwen2-VL processor expands `<|image_pad|>` before the model sees the ids. So position j of the
ids is the k-th image token exactly where the k-th image's merged patches go.

A rendered conversation holding more placeholders than images or fewer (text that spells the
pad token, a template that drops a turn) is a bad record, as is a missing, corrupt or non-image
file (`images.ImageError`): skipped and counted, or with `data.on_bad_record=fail` a ConfigError
naming the file and line, through the same `BadRecords` as every source.

The token strings are arguments (`VisionTokens`, Qwen-VL's by default), never hard-coded ids:
the pad's id is what `tok` reads it as, and it must read it as one token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxllm.config import ConfigError, SourceConfig
from jaxllm.data import chat, conversations, images, sft
from jaxllm.data.sources import BadRecords, DataFile


@dataclasses.dataclass(frozen=True)
class VisionTokens:
    """The strings the template writes for one image: `start + pad + end`. Defaults: Qwen-VL's."""

    start: str = "<|vision_start|>"
    pad: str = "<|image_pad|>"
    end: str = "<|vision_end|>"

    @property
    def placeholder(self) -> str:
        return self.start + self.pad + self.end

    def pad_id(self, tok) -> int:
        """The id of `pad` in `tok`; ConfigError when `tok` does not read it as one token."""
        ids, _ = tok.encode_offsets(self.pad, specials=True)
        if len(ids) != 1:
            raise ConfigError(
                f"tokenizer {getattr(tok, 'name', tok)} does not read the image pad token "
                f"{self.pad!r} as one token (it gives {len(ids)}); use the vision model's "
                "tokenizer, which has it as a special token."
            )
        return int(ids[0])


class VisionExample(NamedTuple):
    """One conversation: ids with each image's pad tokens expanded, 1 per trained target, and
    its images' patches and (grid_t, grid_h, grid_w), in the order the images appear."""

    tokens: np.ndarray  # int32 [L]
    mask: np.ndarray  # uint8 [L]
    pixel_values_NxP: np.ndarray  # float32 [patches, C * temporal_patch * patch²]
    image_grid_thw: np.ndarray  # int64 [images, 3]


def image_source(part: dict, where: str) -> str:
    """The path or data of an image part; ChatError when it holds none."""
    kind = part.get("type")
    if kind == "image_url" or (kind is None and part.get("image") is None):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str) and url:
            return url
        raise chat.ChatError(f"{where} has no string image_url.url")
    source = part.get("image")
    if isinstance(source, str) and source:
        return source
    raise chat.ChatError(f"{where} has no string 'image' (a path or base64 data)")


def flatten(
    messages: Sequence[dict], tokens: VisionTokens = VisionTokens()
) -> tuple[list[dict], list[str]]:
    """(the messages with string contents, each image part written as `tokens.placeholder`;
    the image sources in order). ChatError for a part that is neither text nor an image."""
    flat, sources = [], []
    for n, message in enumerate(messages, 1):
        content = message.get("content")
        if isinstance(content, list):
            text = []
            for k, part in enumerate(content, 1):
                where = f"message {n} part {k}"
                if chat.is_image_part(part):
                    sources.append(image_source(part, where))
                    text.append(tokens.placeholder)
                elif isinstance(part, dict) and part.get("type") in (None, "text"):
                    if not isinstance(part.get("text"), str):
                        raise chat.ChatError(f"{where} has no string 'text'")
                    text.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise chat.ChatError(
                        f"{where} is of type {kind!r} (parts are text, image, image_url)"
                    )
            content = "".join(text)
        flat.append({**message, "content": content})
    return flat, sources


def _problem(messages, field: str) -> str | None:
    """Why `messages` is not a conversation to train on (contents may be lists of parts)."""
    if not isinstance(messages, list) or not messages:
        return f"has no list of messages in field {field!r} (set the source's messages_field)"
    for n, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"has message {n} without a string role"
        if m["role"] not in chat.ROLES:
            return f"has message {n} with role {m['role']!r} (roles are {', '.join(chat.ROLES)})"
        if not isinstance(m.get("content"), (str, list)):
            return f"has message {n} whose content is neither a string nor a list of parts"
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant message"
    return None


def encode(
    messages: Sequence[dict],
    tok,
    spec: images.ImageSpec = images.ImageSpec(),
    tokens: VisionTokens = VisionTokens(),
    base_dir: str | Path | None = None,
    template: str | None = None,
    trained: int = 0,
) -> VisionExample:
    """One conversation as ids, loss mask and pixels (see the module docstring). ChatError when
    it cannot be rendered or its placeholders and images do not pair up, ImageError for an
    image that cannot be used; ConfigError when `tok` lacks the pad token. `trained` > 0
    trains only the last that many assistant turns (a conversational prompt-completion)."""
    pad_id = tokens.pad_id(tok)
    flat, sources = flatten(messages, tokens)
    text, spans = chat.assistant_spans(flat, tok, template)
    spans = spans[len(spans) - trained :] if trained else spans
    ids, offsets = tok.encode_offsets(text, specials=True)
    mask = sft.token_mask(offsets, spans, len(text))
    at = np.flatnonzero(ids == pad_id)
    if len(at) != len(sources):
        raise chat.ChatError(
            f"the rendered conversation holds {len(at)} image placeholder(s) {tokens.pad!r} "
            f"for {len(sources)} image part(s)"
        )
    if not sources:
        patch = 3 * spec.temporal_patch_size * spec.patch_size**2
        pixels = images.Pixels(np.zeros((0, patch), np.float32), np.zeros((0, 3), np.int64))
    else:
        pixels = images.load_pixels(sources, spec, base_dir)
    repeats = np.ones(len(ids), np.int64)
    repeats[at] = images.tokens_of_grid(pixels.image_grid_thw, spec.merge_size)
    mask = mask.copy()
    mask[at] = 0  # image tokens are inputs, never targets
    return VisionExample(
        np.repeat(ids, repeats).astype(np.int32),
        np.repeat(mask, repeats).astype(np.uint8),
        pixels.pixel_values_NxP,
        pixels.image_grid_thw,
    )


def read_vision_examples(
    f: DataFile,
    src: SourceConfig,
    tok,
    spec: images.ImageSpec = images.ImageSpec(),
    tokens: VisionTokens = VisionTokens(),
    on_bad_record: str = "skip",
    bad: BadRecords | None = None,
) -> Iterator[VisionExample]:
    """The conversations of one `chat` file (JSONL or Parquet), images read under its
    directory, in file order; a bad record (malformed, unrenderable, placeholders and images
    that do not pair up, an unusable image) is skipped into `bad` or, with `fail`, a
    ConfigError naming the file and line."""
    bad = bad or sft.bad_records(str(f.path), src)
    tokens.pad_id(tok)  # a tokenizer without the pad fails before any record is read
    fields = {"messages_field": src.messages_field}
    for where, record in sft._records(f, fields, on_bad_record, bad):
        # the shapes text chats are read in (ShareGPT, Alpaca, ...), LLaVA's images beside them
        messages, trained, why = conversations.messages_of(record, src.messages_field)
        if why is None:
            messages, why = conversations.with_images(messages, record)
        why = why or _problem(messages, src.messages_field)
        if why is None:
            try:
                yield encode(messages, tok, spec, tokens, f.path.parent, trained=trained)
                continue
            except chat.ChatError as e:
                why = f"cannot be rendered ({e})"
            except images.ImageError as e:
                why = f"holds an unusable {e}"
        sft._bad(why, where, on_bad_record, bad)
