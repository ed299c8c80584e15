"""The requests `jaxllm serve` reads, as pydantic models (as vLLM's `entrypoints/openai`
`protocol.py`), and its refusals in OpenAI's error shape.

Types are strict, as OpenAI's API is: a boolean field takes only JSON true / false (`"stream":
"yes"` is refused, not read as true), an integer field refuses strings, booleans and numbers with
a fraction (a whole number written 2.0 is 2), a number field refuses strings and booleans. A
field this server does not know, or knows but does not honour, is refused unless it is set to a
value that asks for nothing (`_NO_OPS`): a request is never served with a field silently
ignored. A field sent as null takes its default (OpenAI's optional fields are nullable).
"""

from __future__ import annotations

from typing import Annotated

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


def _whole(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_whole)]
"""An integer; a JSON number with no fraction (2.0) counts as one."""


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: Int = Field(default=-1, ge=-1)
    """vLLM's extra: keep the k most likely tokens (-1 or 0: all)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """vLLM's extra: keep tokens at least min_p times as likely as the most likely."""
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    """vLLM's extra (HF semantics): > 1 discourages tokens of the prompt and output."""
    n: Int = Field(default=1, ge=1, le=64)
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    """OpenAI's `{"include_usage": true}`: a last chunk (no choices) carries the usage; vLLM's
    `"continuous_usage_stats": true` with it: every chunk carries its sample's counts so far."""
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extra: the model's end-of-sequence / end-of-turn tokens do not end the output
    (benchmarks ask for exact output lengths); `stop` and `stop_token_ids` still do."""
    include_stop_str_in_output: bool = False
    """vLLM's extra: the `stop` string that ended a sample stays at the end of its text."""
    logit_bias: dict[str, float] | None = None
    """Token id (a string, as JSON keys are) -> bias in [-100, 100] added to its logit."""
    min_tokens: Int = Field(default=0, ge=0)
    """vLLM's extra: no end-of-sequence token, stop token or stop string ends a sample before
    it has this many tokens (at most max_tokens)."""
    response_format: dict | None = None
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict"}}: the output is any JSON object, or JSON of the schema."""
    guided_json: dict | str | None = None
    """vLLM's extras (at most one constraint per request): a JSON schema, a regex, one of
    several strings, a Lark grammar."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    """vLLM's newer form: {"json" | "regex" | "choice" | "grammar": ...}."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body):
        """A field sent as null is its default, as OpenAI's nullable fields are."""
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=None, ge=0)
    """0 (with `echo`, as vLLM): the prompt only, scored with `logprobs`; nothing generated."""
    logprobs: Int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    """The prompt comes before the completion in the text (and its tokens' log-probabilities,
    the first null, before the completion's with `logprobs`)."""
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=20)
    """vLLM's extra: each prompt token's log-probability, rank and the top ones at its
    position (not streamed)."""


class ChatRequest(_Common):
    messages: list[dict[str, str | list | None]]
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    echo: bool = False
    """vLLM's extra: when the last message is the assistant's, its text comes before each
    reply's content (streamed: in a chunk of its own after the role's)."""


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt (tokenized as completions do) or messages (as chat does)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, str | list | None]] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's `/detokenize`: token ids to text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[Int]


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error(status: int, message: str, param=None, kind="invalid_request_error", code=None):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _where(body, loc) -> str | None:
    """The dotted path of a pydantic error's `loc` in the request body, without the union
    members' names pydantic adds (`prompt.str`): the longest prefix that is in the body."""
    path = []
    for part in [p for p in loc if p != "body"]:
        inside = isinstance(body, dict) and part in body
        inside |= isinstance(body, list) and isinstance(part, int) and 0 <= part < len(body)
        if not inside:
            break
        body = body[part]
        path.append(str(part))
    return ".".join(path) or None


def invalid(exc: RequestValidationError) -> JSONResponse:
    """The 400 of a body pydantic refused: its first bad field named, and what every type of a
    union field would have needed."""
    errors = exc.errors()
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return error(400, f"the body is not valid JSON ({detail})".replace(" ()", ""))
    where = _where(exc.body, err.get("loc", ()))
    if where is None and err.get("type") in ("model_attributes_type", "dict_type"):
        return error(400, "the body is a JSON object (sent with Content-Type: application/json)")
    msgs = [e["msg"] for e in errors if _where(exc.body, e.get("loc", ())) == where]
    first, *rest = dict.fromkeys(msgs) or ["invalid request"]
    msg = " or ".join([first, *(m.removeprefix("Input should be ") for m in rest)])
    got = ""
    if where is not None and err.get("type", "").endswith("_type"):
        got = f" (got {repr(err.get('input'))[:40]})"
    return error(400, f"{where or 'body'}: {msg}{got}", where)


ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields of OpenAI's API (and vLLM's extras) this server does not honour: (field, the values that
# ask for nothing, what it does not do). One set otherwise is refused, never silently ignored.
_NO_OPS = (
    ("suffix", lambda v, r: not v, "suffix (no text after the completion)"),
    ("best_of", lambda v, r: v is None or v == r.n, "best_of other than n"),
    ("tools", lambda v, r: not v, "tools (tool calls)"),
    ("tool_choice", lambda v, r: v in (None, "none"), "tool_choice"),
    ("parallel_tool_calls", lambda v, r: True, ""),  # only with tools, which are refused
    ("functions", lambda v, r: not v, "functions (function calls)"),
    ("function_call", lambda v, r: v in (None, "none"), "function_call"),
    ("store", lambda v, r: v in (None, False), "store (completions are not stored)"),
    ("metadata", lambda v, r: v is None, "metadata (completions are not stored)"),
    ("service_tier", lambda v, r: v in (None, "auto", "default"), "service tiers"),
    ("skip_special_tokens", lambda v, r: v in (None, True), "special tokens in the text"),
    ("add_generation_prompt", lambda v, r: v in (None, True), "a prompt without the reply's start"),
)
_KNOWN = {name for name, _, _ in _NO_OPS}


def check_supported(req: _Common) -> None:
    """400 for a field this server would otherwise ignore, and for stream_options misused."""
    fields = {**(req.model_extra or {}), **req.model_dump(exclude_unset=True)}
    for name in req.model_extra or {}:
        if name not in _KNOWN:
            raise BadRequest(f"{name}: this server does not know this field", name)
    for name, honoured, what in _NO_OPS:
        if name in fields and not honoured(fields[name], req):
            raise BadRequest(f"{name}: this server does not support {what}", name)
    if req.stream_options is not None:
        if not req.stream:
            raise BadRequest("stream_options goes with stream: true", "stream_options")
        keys = {"include_usage", "continuous_usage_stats"}
        opts = req.stream_options
        if set(opts) - keys or not all(isinstance(opts.get(k, False), bool) for k in keys):
            raise BadRequest(
                "stream_options takes {include_usage: bool, continuous_usage_stats: bool}",
                "stream_options",
            )
        if opts.get("continuous_usage_stats") and not opts.get("include_usage"):
            raise BadRequest(
                "stream_options: continuous_usage_stats goes with include_usage: true",
                "stream_options",
            )


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise BadRequest("messages: give at least one message", "messages")
    for n, m in enumerate(messages):
        if m.get("role") not in ROLES:
            where = f"messages.{n}.role"
            raise BadRequest(f"{where}: {m.get('role')!r} is not one of {list(ROLES)}", where)
        if "content" not in m:
            raise BadRequest(f"messages.{n}: a message needs content", f"messages.{n}.content")
        if m["content"] is None and m["role"] != "assistant":
            where = f"messages.{n}.content"
            raise BadRequest(f"{where}: only an assistant message may have null content", where)
        if m.get("tool_calls"):
            where = f"messages.{n}.tool_calls"
            raise BadRequest(f"{where}: this server does not support tool calls", where)
