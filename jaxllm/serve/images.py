"""A chat request's messages -> (prompt ids, its images' pixels or None).

A content part may be an image, as OpenAI's API writes it:
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`. A vision-language
model's server decodes such data URLs with the project's image loader and cuts them as the
model's processor does (`jaxllm.infer.vision.prompt_example`: each image's pad token expanded to
its merged patches, images in the order they come). Local files are read only when the server
was started with `--allowed-local-media-path DIR`, and only under DIR (a `file://` URL or a
path); remote URLs are not fetched. Every refusal is a `PartError`: one message and the field it
names, which the routes answer with HTTP 400.
"""

from __future__ import annotations

from pathlib import Path

from jaxllm.config import ConfigError
from jaxllm.data import chat as templates
from jaxllm.data import vision_chat
from jaxllm.data.chat import is_image_part
from jaxllm.infer.chat import prompt_ids
from jaxllm.infer.vision import image_spec, prompt_example


class PartError(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.message, self.param = message, param


def _local(source: str, root: Path, where: str) -> str:
    path = Path(source.removeprefix("file://")).resolve()
    if not path.is_relative_to(root):
        raise PartError(f"{where}: {path} is not under the allowed media path {root}", where)
    return str(path)


def _checked(messages: list[dict], vision, local_root: Path | None) -> tuple[list[dict], int]:
    """The messages with every image source checked (local paths made absolute) and how many
    images they hold."""
    out, count = [], 0
    for n, m in enumerate(messages):
        content, where = m.get("content"), f"messages.{n}.content"
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            if is_image_part(part):
                if vision is None:
                    raise PartError(
                        f"{where} holds an image part: this model is text-only (it has no "
                        "model.vision); send text, or serve a vision-language model",
                        where,
                    )
                try:
                    source = vision_chat.image_source(part, where)
                except templates.ChatError as e:
                    raise PartError(str(e), where) from None
                remote = "://" in source and not source.startswith("file://")
                if not source.startswith("data:"):
                    if remote or local_root is None:
                        raise PartError(f"{where}: {_NO_FILES}", where)
                    source = _local(source, local_root, where)
                parts.append({"type": "image", "image": source})
                count += 1
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise PartError(
                    f"{where}: parts are {{type: text, text: ...}} or {{type: image_url, "
                    "image_url: {url: data:image/...;base64,...}}",
                    where,
                )
        out.append({**m, "content": parts})
    return out, count


_NO_FILES = (
    "an image is sent as a data URL (data:image/png;base64,...); this server reads no remote "
    "URLs, and local files only when started with --allowed-local-media-path DIR"
)


def chat_prompt(messages: list[dict], tok, vision, local_root: Path | None = None):
    """(prompt ids, `Pixels` or None) of a chat request to a model whose `model.vision` is
    `vision` (None: text-only); PartError when a part or an image cannot be used."""
    messages, count = _checked(messages, vision, local_root)
    try:
        if not count:
            return prompt_ids(messages, tok), None
        tokens = vision_chat.VisionTokens()
        if tokens.pad_id(tok) != vision.image_token_id:
            raise ConfigError(
                f"the tokenizer's {tokens.pad!r} is not the model's image token "
                f"({vision.image_token_id}); serve the run with its own tokenizer"
            )
        return prompt_example(messages, tok, image_spec(vision), tokens)
    except ConfigError as e:
        raise PartError(str(e), "messages") from None
