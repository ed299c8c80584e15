"""The OpenAI-compatible routes over an `EngineWorker`: `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (streamed as server-sent events with `stream: true`), `/health` and
`/metrics` (Prometheus text). Requests are validated by pydantic models (as vLLM's
`entrypoints/openai` does); every refusal is HTTP 400 with OpenAI's error body. A chat message's
content is a string or a list of parts: text, and for a vision-language model images
(`images.py`: data URLs, local files under `--allowed-local-media-path`), which the engine takes
with the request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from jaxllm.infer.chat import EndOfTurn
from jaxllm.infer.engine import SamplingParams
from jaxllm.serve.images import PartError, chat_prompt
from jaxllm.serve.texts import SampleText, chat_logprobs, completion_logprobs
from jaxllm.serve.worker import EngineWorker


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    """vLLM's extra: keep the k most likely tokens (-1 or 0: all)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """vLLM's extra: keep tokens at least min_p times as likely as the most likely."""
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    """vLLM's extra (HF semantics): > 1 discourages tokens of the prompt and output."""
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict | None = None
    """OpenAI's `{"include_usage": true}`: a last chunk (no choices) carries the usage."""
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extra: the model's end-of-sequence / end-of-turn tokens do not end the output
    (benchmarks ask for exact output lengths); `stop` and `stop_token_ids` still do."""


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class ChatRequest(_Common):
    messages: list[dict[str, str | list]]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _error(status: int, message: str, param=None, kind="invalid_request_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields of OpenAI's API this server does not honour: (field, what it may be, what it does not
# do). A request that sets one otherwise is refused with 400, never silently ignored.
_UNSUPPORTED = (
    ("echo", lambda v, r: not v, "echo (the prompt is not returned)"),
    ("suffix", lambda v, r: not v, "suffix (no text after the completion)"),
    ("best_of", lambda v, r: v is None or v == r.n, "best_of other than n"),
    ("logit_bias", lambda v, r: not v, "logit_bias"),
    ("response_format", lambda v, r: not v or v == {"type": "text"}, "response_format (JSON)"),
    ("tools", lambda v, r: not v, "tools (tool calls)"),
    ("tool_choice", lambda v, r: v in (None, "none"), "tool_choice"),
    ("functions", lambda v, r: not v, "functions (function calls)"),
    ("function_call", lambda v, r: v in (None, "none"), "function_call"),
)


def _check_supported(req: _Common) -> None:
    """400 for a field this server would otherwise ignore, and for stream_options misused."""
    fields = {**(req.model_extra or {}), **req.model_dump(exclude_unset=True)}
    for name, honoured, what in _UNSUPPORTED:
        if name in fields and not honoured(fields[name], req):
            raise BadRequest(f"{name}: this server does not support {what}", name)
    if req.stream_options is not None:
        if not req.stream:
            raise BadRequest("stream_options goes with stream: true", "stream_options")
        if set(req.stream_options) - {"include_usage"} or not isinstance(
            req.stream_options.get("include_usage", False), bool
        ):
            raise BadRequest("stream_options takes {include_usage: bool}", "stream_options")


def _check_messages(messages: list[dict]) -> None:
    if not messages:
        raise BadRequest("messages: give at least one message", "messages")
    for n, m in enumerate(messages):
        if m.get("role") not in ROLES:
            where = f"messages.{n}.role"
            raise BadRequest(f"{where}: {m.get('role')!r} is not one of {list(ROLES)}", where)
        if "content" not in m:
            raise BadRequest(f"messages.{n}: a message needs content", f"messages.{n}.content")


class Served:
    """What the routes need: the worker, tokenizer, stops and names."""

    def __init__(
        self,
        worker: EngineWorker,
        tok,
        name: str,
        stops,
        eot: EndOfTurn,
        bos,
        vision=None,
        media=None,
    ):
        self.worker, self.tok, self.name, self.bos = worker, tok, name, bos
        self.stops, self.eot = frozenset(stops), eot
        self.vision, self.media = vision, media  # model.vision; the local files' root or None
        self.created = int(time.time())
        e = worker.engine
        # the most tokens one sequence may hold: the context, or fewer when the pool is small
        self.max_len = min(e.cfg.max_seq_len, (e.pool.num_pages - 1) * e.page_size)

    def max_tokens(self, asked: int | None, prompts: list[list[int]], default=None) -> int:
        """`asked`, or when it is None the rest of the context after the longest prompt
        (at most `default`); 400 when a prompt leaves no room."""
        if asked is not None:
            return asked
        longest = max(map(len, prompts))
        if longest >= self.max_len:
            raise BadRequest(
                f"the prompt ({longest} tokens) leaves no room to generate in this server's "
                f"{self.max_len}-token context; shorten it",
                "prompt",
            )
        return min(self.max_len - longest, default or self.max_len)


def _stop_strings(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _params(s: Served, req: _Common, max_tokens, stops, logprobs: bool, top: int):
    """The engine's SamplingParams of a request; stop strings are matched on the text here."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            n=req.n,
            seed=req.seed,
            stop_tokens=tuple(
                sorted(set(() if req.ignore_eos else stops) | set(req.stop_token_ids or ()))
            ),
            logprobs=logprobs,
            top_logprobs=top,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None


async def _submit(s: Served, prompt, params, images=None):
    try:
        return await s.worker.submit(prompt, params, images)
    except ValueError as e:
        raise BadRequest(str(e), "prompt") from None


async def _follow(s: Served, rid: int, events, texts: list[SampleText]):
    """Yields (sample, text delta, its (token, log-prob, top) entries, finish reason or None)
    as a request's events come; a sample whose text reaches a stop string is ended in the
    engine."""
    left = len(texts)
    while left:
        event = await events.get()
        if event[0] == "token":
            _, i, token, logprob, top = event
            if texts[i].add(token, logprob, top):
                s.worker.abort(rid, i)
                left -= 1
                yield (i, *texts[i].take(), "stop")
            elif not texts[i].done:
                delta, entries = texts[i].take()
                if delta:
                    yield i, delta, entries, None
        elif event[0] == "done":
            out = event[1]
            text = texts[out.index]
            if text.done:  # already ended by a stop string
                continue
            stopped = text.finish(out.tokens, out.logprobs, out.top_logprobs)
            left -= 1
            yield (out.index, *text.take(), "stop" if stopped else out.finish_reason)
        elif event[0] == "cancelled":
            return
        elif event[0] == "error":
            raise BadRequest(event[1], status=500)


async def _run(s: Served, prompts: list, params: SamplingParams, stops, images=None) -> list:
    """Runs requests, one per prompt, at once to their end: each prompt's list of its samples'
    (SampleText, finish reason). A prompt the engine refuses refuses them all."""
    submitted = []
    try:
        for p in prompts:
            submitted.append(await _submit(s, p, params, images))
    except BadRequest:
        for rid, _ in submitted:
            s.worker.abort(rid)
        raise
    return await asyncio.gather(*(_collect(s, *r, params, stops) for r in submitted))


async def _collect(s: Served, rid: int, events, params: SamplingParams, stops) -> list:
    """One request's samples as (SampleText, finish reason), once all have ended."""
    texts = [SampleText(s.tok, stops) for _ in range(params.n)]
    reasons = ["stop"] * params.n  # a cancelled sample (server stopping) ends as it is
    try:
        async for i, _, _, reason in _follow(s, rid, events, texts):
            reasons[i] = reason or reasons[i]
    finally:
        s.worker.abort(rid)
    return list(zip(texts, reasons))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(
    s: Served, prompt, params, chat: bool, head: dict, stops, images=None, usage=False
):
    """Server-sent events of one request (with `usage`, a last chunk of the token counts);
    aborting it when the client goes (the generator is closed) frees its pages."""
    rid, events = await _submit(s, prompt, params, images)
    want = params.logprobs
    offsets = [0] * params.n

    def chunk(index, text, entries, finish=None):
        lp = None
        if chat:
            lp = chat_logprobs(s.tok, entries) if want else None
            choice = {"index": index, "delta": {"content": text}, "logprobs": lp}
        else:
            lp = completion_logprobs(s.tok, entries, offsets[index]) if want else None
            offsets[index] += sum(len(t) for t in lp["tokens"]) if lp else 0
            choice = {"index": index, "text": text, "logprobs": lp}
        return _sse({**head, "choices": [{**choice, "finish_reason": finish}]})

    async def gen():
        texts = [SampleText(s.tok, stops) for _ in range(params.n)]
        try:
            if chat:
                for i in range(params.n):
                    role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                    yield _sse({**head, "choices": [{**role, "finish_reason": None}]})
            try:
                async for i, delta, entries, reason in _follow(s, rid, events, texts):
                    yield chunk(i, delta, entries, reason)
            except BadRequest as e:  # the engine failed mid-stream: say so, as vLLM does
                yield _sse({"error": {"message": e.message, "type": "server_error", "code": 500}})
                yield "data: [DONE]\n\n"
                return
            if usage:
                counts = _usage(len(prompt), [(t, None) for t in texts])
                yield _sse({**head, "choices": [], "usage": counts})
            yield "data: [DONE]\n\n"
        finally:
            s.worker.abort(rid)

    return StreamingResponse(gen(), media_type="text/event-stream")


def _prompts(s: Served, prompt) -> list[list[int]]:
    """A string, strings, token ids, or lists of token ids -> one list of ids per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt: give a string, strings or token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) if isinstance(p, list) else s.bos + s.tok.encode(p).tolist() for p in prompt]


def _wants_usage(req: _Common) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


def _usage(prompt_tokens: int, outs) -> dict:
    done = sum(t.generated for t, _ in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done,
        "total_tokens": done + prompt_tokens,
    }


def make_app(s: Served, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxllm")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return _error(400, f"the body is not valid JSON ({detail})".replace(" ()", ""))
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or None
        return _error(400, f"{where or 'body'}: {err.get('msg', 'invalid request')}", where)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # 404, 405 in OpenAI's shape too
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, kind
        )

    @app.exception_handler(BadRequest)
    async def bad(request, exc: BadRequest):
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        return _error(exc.status, exc.message, exc.param, kind)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return _error(401, "invalid or missing API key", kind="authentication_error")
        return await call_next(request)

    def check_model(name: str) -> None:
        if name != s.name:
            raise BadRequest(f"model {name!r} is not served; this server has {s.name!r}", "model")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": s.name, "object": "model", "created": s.created, "owned_by": "jaxllm"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        _check_supported(req)
        prompts = _prompts(s, req.prompt)
        wants = req.logprobs is not None
        max_tokens = s.max_tokens(req.max_tokens, prompts, default=16)
        params = _params(s, req, max_tokens, s.stops, wants, req.logprobs or 0)
        stops = _stop_strings(req)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": s.name}
        head["created"] = int(time.time())
        if req.stream:
            if len(prompts) > 1:
                raise BadRequest("stream one prompt at a time", "prompt")
            return await _stream(s, prompts[0], params, False, head, stops, usage=_wants_usage(req))
        choices, all_outs = [], []
        for i, outs in enumerate(await _run(s, prompts, params, stops)):
            all_outs += outs
            for j, (t, reason) in enumerate(outs):
                entries = list(zip(t.ids, t.logprobs, t.tops))
                lp = completion_logprobs(s.tok, entries) if wants else None
                choice = {"index": i * params.n + j, "text": t.text, "logprobs": lp}
                choices.append({**choice, "finish_reason": reason})
        usage = _usage(sum(map(len, prompts)), all_outs)
        return {**head, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req.model)
        _check_supported(req)
        _check_messages(req.messages)
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        try:
            prompt, images = chat_prompt(req.messages, s.tok, s.vision, s.media)
        except PartError as e:
            raise BadRequest(e.message, e.param) from None
        except Exception as e:
            raise BadRequest(str(e), "messages") from None
        max_tokens = s.max_tokens(req.max_completion_tokens or req.max_tokens, [prompt])
        stop_ids = s.eot.stop_ids | s.stops
        params = _params(s, req, max_tokens, stop_ids, req.logprobs, req.top_logprobs or 0)
        stops = _stop_strings(req)
        if s.eot.marker and not req.ignore_eos:  # a marker of several tokens ends the reply
            stops.append(s.eot.marker)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "model": s.name}
        head["created"] = int(time.time())
        if req.stream:
            head["object"] = "chat.completion.chunk"
            usage = _wants_usage(req)
            return await _stream(s, prompt, params, True, head, stops, images, usage)
        (outs,) = await _run(s, [prompt], params, stops, images)
        choices = []
        for j, (t, reason) in enumerate(outs):
            entries = list(zip(t.ids, t.logprobs, t.tops))
            lp = chat_logprobs(s.tok, entries) if req.logprobs else None
            msg = {"role": "assistant", "content": t.text}
            choices.append({"index": j, "message": msg, "logprobs": lp, "finish_reason": reason})
        return {**head, "choices": choices, "usage": _usage(len(prompt), outs)}

    @app.get("/metrics")
    async def metrics():
        e, w = s.worker.engine, s.worker
        lines = [
            ("jaxllm_requests_running", "gauge", e.num_running),
            ("jaxllm_requests_waiting", "gauge", e.num_waiting),
            ("jaxllm_kv_pages_used", "gauge", e.pool.num_used),
            ("jaxllm_kv_pages_total", "gauge", e.pool.num_pages - 1),
            ("jaxllm_kv_pages_usage_ratio", "gauge", e.pool.num_used / (e.pool.num_pages - 1)),
            ("jaxllm_preemptions_total", "counter", e.num_preemptions),
            ("jaxllm_prefix_cache_queries_total", "counter", e.prefix_queries),
            ("jaxllm_prefix_cache_hits_total", "counter", e.prefix_hits),
            ("jaxllm_prefix_cache_hit_rate", "gauge", e.prefix_cache_hit_rate),
            ("jaxllm_requests_total", "counter", w.requests_total),
            ("jaxllm_generation_tokens_total", "counter", w.tokens_total),
            ("jaxllm_generation_tokens_per_second", "gauge", w.tokens_per_second()),
        ]
        text = "".join(f"# TYPE {n} {t}\n{n} {v}\n" for n, t, v in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
