"""Chat templates: a conversation rendered as its model reads it, and the parts the assistant wrote.

`render(messages, tok)` renders the tokenizer's own chat template (`chat_template.jinja`, else
tokenizer_config.json's `chat_template`) exactly as transformers' `apply_chat_template(...,
tokenize=False)` does: Jinja2's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
loop controls; `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `dict`
and `namespace` hardened as there (templates come from model hubs: untrusted code); the
variables `messages` (each message without its None values), `add_generation_prompt`, `tools` and
`documents` (None) and the special tokens of tokenizer_config.json (`bos_token`, `eos_token`,
...). A tokenizer without a template (the byte tokenizer, a SentencePiece model, a bare
tokenizer.json) gets `BUILTIN_TEMPLATE`, ChatML written as plain text:

    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello.<|im_end|>\\n

`assistant_spans` finds the characters of each assistant turn, which the SFT loss covers. A
template that marks them with `{% generation %}` ... `{% endgeneration %}` says so itself (what
transformers' `return_assistant_tokens_mask` reads). Otherwise turn i is what rendering
messages[:i + 1] adds to rendering messages[:i] with the generation prompt, trailing whitespace
left out: the reply and the end-of-turn marker (`Hello.<|im_end|>`, Llama 3's
`Hello.<|eot_id|>`), never the header the generation prompt writes. A template whose renderings
are not prefixes of each other (one that rewrites earlier turns or writes something after the
last one) falls back to finding the reply's text in the whole conversation, from where the
previous turn ended, plus the end-of-turn marker when it follows. Rendering the same conversation always gives the same text, so
`jaxllm generate --chat` renders its prompt with `render(..., add_generation_prompt=True)`.

This module does not import jax; Jinja2 loads on the first render.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Sequence
from datetime import datetime

from jaxllm.config import ConfigError

ROLES = ("system", "user", "assistant")
IMAGE_TYPES = ("image", "image_url")  # content parts that hold an image (Qwen-VL's, OpenAI's)
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatError(ValueError):
    """A conversation its template cannot render (the template raised, or wrote a reply in a
    way its span cannot be found): a bad record, not a bad configuration."""


def is_image_part(part) -> bool:
    """Whether a content part holds an image: `{"type": "image", "image": ...}` or OpenAI's
    `{"type": "image_url", "image_url": {"url": ...}}`; without a type, one whose `image` or
    `image_url` is set (a Parquet row of parts has every key, None where unset)."""
    if not isinstance(part, dict):
        return False
    if part.get("type") is not None:
        return part["type"] in IMAGE_TYPES
    return any(part.get(k) is not None for k in IMAGE_TYPES)


def image_message(messages) -> int | None:
    """The number (from 1) of the first message whose content parts hold an image, else None."""
    for n, m in enumerate(messages if isinstance(messages, list) else [], 1):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(map(is_image_part, content)):
            return n
    return None


def template_of(tok) -> str:
    """The tokenizer's default chat template, else `BUILTIN_TEMPLATE`."""
    return getattr(tok, "chat_template", None) or BUILTIN_TEMPLATE


def fingerprint(tok) -> str:
    """SHA-256 of what a rendering depends on besides the messages: the template and the
    special tokens it sees (prepared conversations record it)."""
    seen = json.dumps([template_of(tok), tok.special_tokens], sort_keys=True)
    return hashlib.sha256(seen.encode()).hexdigest()


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """(the template compiled in transformers' environment, its `{% generation %}` recorder,
    whether the template marks replies with it)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}`: records the character span of its output while `out` is set."""

        tags = {"generation"}
        out: list[str] | None = None  # the blocks rendered so far
        spans: list[tuple[int, int]] = []

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(
                lineno
            )

        def _mark(self, caller):
            text = caller()
            if self.out is not None:
                start = sum(map(len, self.out))
                self.spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class TemplateDict:  # `dict` without attribute access to the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no dunder names: no way to internals
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot store the attribute {name!r} on a namespace"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"the chat template does not parse (line {e.lineno}: {e.message}); fix "
            "chat_template in tokenizer_config.json (or chat_template.jinja)."
        ) from None
    marked = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None
    return compiled, env.extensions[Generation.identifier], marked


def _variables(messages: Sequence[dict], tok, add_generation_prompt: bool) -> dict:
    return {
        **tok.special_tokens,
        "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }


def _render(template: str, variables: dict, spans: list | None = None) -> str:
    compiled, generation, _ = _compile(template)
    try:
        if spans is None:
            return compiled.render(**variables)
        generation.out, generation.spans = [], spans
        try:
            for block in compiled.generate(**variables):
                generation.out.append(block)
            return "".join(generation.out)
        finally:
            generation.out, generation.spans = None, []
    except Exception as e:  # template code is the model's, not ours: any failure is the record's
        raise ChatError(f"the chat template failed: {str(e).splitlines()[0]}") from e


def render(
    messages: Sequence[dict],
    tok,
    *,
    add_generation_prompt: bool = False,
    template: str | None = None,
) -> str:
    """The conversation as text, by `template` or the tokenizer's (see the module docstring)."""
    return _render(template or template_of(tok), _variables(messages, tok, add_generation_prompt))


def assistant_spans(
    messages: Sequence[dict], tok, template: str | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the [start, end) character span of each assistant turn)."""
    template = template or template_of(tok)
    if _compile(template)[2]:  # the template marks the replies itself
        spans: list[tuple[int, int]] = []
        text = _render(template, _variables(messages, tok, False), spans)
        if spans:
            return text, spans
    text = render(messages, tok, template=template)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        upto = render(messages[: i + 1], tok, template=template)
        try:
            head = render(messages[:i], tok, add_generation_prompt=True, template=template)
        except ChatError:  # a template that refuses a conversation without a user turn
            head = None
        if head is not None and upto.startswith(head) and text.startswith(upto):
            start, end = len(head), max(len(head), len(upto.rstrip()))
        else:
            start, end = _find_reply(message["content"], upto, text, cursor, i)
        spans.append((start, end))
        cursor = end
    return text, spans


def _find_reply(content: str, upto: str, text: str, cursor: int, i: int) -> tuple[int, int]:
    """The span of reply `i` found by its text, for templates that rewrite earlier turns: the
    reply, plus the end-of-turn marker (the non-space characters the template writes right after
    it when the reply is the last message) where the whole conversation has it too."""
    start, after = text.find(content, cursor), upto.rfind(content)
    if start < 0 or after < 0:
        raise ChatError(f"the chat template does not write message {i + 1} verbatim")
    end = start + len(content)
    marker = re.match(r"\S*", upto[after + len(content) :]).group()
    return start, end + len(marker) if text.startswith(marker, end) else end
