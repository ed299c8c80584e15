"""The OpenAI-compatible routes over an `EngineWorker`: `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (streamed as server-sent events with `stream: true`), `/health` and
`/metrics` (Prometheus text). Requests are validated by pydantic models (as vLLM's
`entrypoints/openai` does); every refusal is HTTP 400 with OpenAI's error body.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxllm.infer.chat import EndOfTurn, prompt_ids
from jaxllm.infer.engine import SamplingParams
from jaxllm.serve.worker import EngineWorker


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extra: the model's end-of-sequence / end-of-turn tokens do not end the output
    (benchmarks ask for exact output lengths); `stop` and `stop_token_ids` still do."""


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=0)
    echo: bool = Field(default=False, le=False)


class ChatRequest(_Common):
    messages: list[dict[str, str]]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _error(status: int, message: str, param=None, kind="invalid_request_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


class Served:
    """What the routes need: the worker, tokenizer, stops and names."""

    def __init__(self, worker: EngineWorker, tok, name: str, stops, eot: EndOfTurn, bos):
        self.worker, self.tok, self.name, self.bos = worker, tok, name, bos
        self.stops, self.eot = frozenset(stops), eot
        self.created = int(time.time())


def _stop_ids(s: Served, req: _Common, base) -> tuple[int, ...]:
    """The request's stops as token ids: `stop` strings of one token each, `stop_token_ids`."""
    stops = set(base) | set(req.stop_token_ids or ())
    for text in [req.stop] if isinstance(req.stop, str) else req.stop or []:
        ids = s.tok.encode_offsets(text, specials=True)[0].tolist()
        if len(ids) != 1:
            raise BadRequest(
                f"stop {text!r} is {len(ids)} tokens; only stops of one token are supported "
                "(stop sequences of several tokens are not yet)",
                "stop",
            )
        stops.add(ids[0])
    return tuple(sorted(stops))


def _params(s: Served, req: _Common, max_tokens, stops, logprobs: bool) -> SamplingParams:
    if req.stream and logprobs:
        raise BadRequest("logprobs are not streamed yet; ask without stream", "logprobs")
    return SamplingParams(
        max_tokens=max_tokens or 16,
        temperature=req.temperature,
        top_p=req.top_p,
        n=req.n,
        seed=req.seed,
        stop_tokens=_stop_ids(s, req, () if req.ignore_eos else stops),
        logprobs=logprobs,
    )


async def _run(s: Served, prompt: list[int], params: SamplingParams, outs: list) -> None:
    """Runs one request to its end, filling outs[index] with each sample's Output."""
    try:
        rid, events = await s.worker.submit(prompt, params)
    except ValueError as e:
        raise BadRequest(str(e), "prompt") from None
    try:
        left = params.n
        while left:
            event = await events.get()
            if event[0] == "done":
                outs[event[1].index] = event[1]
                left -= 1
            elif event[0] == "cancelled":
                return
    finally:
        s.worker.abort(rid)


class _Text:
    """Decodes a sample's tokens into text deltas (whole characters only)."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.shown = text[self.shown :], len(text)
        return delta

    def rest(self) -> str:
        return self.tok.decode(self.ids)[self.shown :]


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(s: Served, prompt, params, chat: bool, head: dict):
    """Server-sent events of one request; aborting it when the client goes (the generator is
    closed) frees its pages."""
    try:
        rid, events = await s.worker.submit(prompt, params)
    except ValueError as e:
        raise BadRequest(str(e), "prompt") from None

    def chunk(index, text, finish=None):
        if chat:
            choice = {"index": index, "delta": {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        return _sse({**head, "choices": [choice]})

    async def gen():
        texts = [_Text(s.tok) for _ in range(params.n)]
        try:
            if chat:
                for i in range(params.n):
                    role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                    yield _sse({**head, "choices": [{**role, "finish_reason": None}]})
            left = params.n
            while left:
                event = await events.get()
                if event[0] == "token":
                    delta = texts[event[1]].add(event[2])
                    if delta:
                        yield chunk(event[1], delta)
                elif event[0] == "done":
                    out, left = event[1], left - 1
                    yield chunk(out.index, texts[out.index].rest(), out.finish_reason)
                else:
                    break
            yield "data: [DONE]\n\n"
        finally:
            s.worker.abort(rid)

    return StreamingResponse(gen(), media_type="text/event-stream")


def _prompts(s: Served, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [s.bos + s.tok.encode(p).tolist() for p in prompt]


def _usage(prompt_tokens: int, outs) -> dict:
    done = sum(len(o.tokens) for o in outs)
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
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or None
        return _error(400, f"{where or 'body'}: {err.get('msg', 'invalid request')}", where)

    @app.exception_handler(BadRequest)
    async def bad(request, exc: BadRequest):
        return _error(exc.status, exc.message, exc.param)

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
        prompts = _prompts(s, req.prompt)
        params = _params(s, req, req.max_tokens, s.stops, req.logprobs is not None)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": s.name}
        head["created"] = int(time.time())
        if req.stream:
            if len(prompts) > 1:
                raise BadRequest("stream one prompt at a time", "prompt")
            return await _stream(s, prompts[0], params, False, head)
        choices, all_outs = [], []
        for i, p in enumerate(prompts):
            outs: list = [None] * params.n
            await _run(s, p, params, outs)
            all_outs += outs
            for o in outs:
                lp = None
                if req.logprobs is not None:
                    toks = [s.tok.decode([t]) for t in o.tokens]
                    lp = {"tokens": toks, "token_logprobs": o.logprobs, "top_logprobs": None}
                    lp["text_offset"] = [sum(len(t) for t in toks[:k]) for k in range(len(toks))]
                text = s.tok.decode(o.tokens)
                choices.append(
                    {
                        "index": i * params.n + o.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": o.finish_reason,
                    }
                )
        usage = _usage(sum(map(len, prompts)), all_outs)
        return {**head, "choices": choices, "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req.model)
        try:
            prompt = prompt_ids(req.messages, s.tok)
        except Exception as e:
            raise BadRequest(str(e), "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = _params(s, req, max_tokens, s.eot.stop_ids | s.stops, req.logprobs)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "model": s.name}
        head["created"] = int(time.time())
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return await _stream(s, prompt, params, True, head)
        outs: list = [None] * params.n
        await _run(s, prompt, params, outs)
        choices = []
        for o in outs:
            text = s.tok.decode(o.tokens)
            if s.eot.marker and s.eot.marker in text:  # a marker of several tokens
                text = text[: text.index(s.eot.marker)]
            lp = None
            if req.logprobs:
                lp = {
                    "content": [
                        {
                            "token": s.tok.decode([t]),
                            "logprob": v,
                            "bytes": None,
                            "top_logprobs": [],
                        }
                        for t, v in zip(o.tokens, o.logprobs)
                    ]
                }
            msg = {"role": "assistant", "content": text}
            choices.append(
                {"index": o.index, "message": msg, "logprobs": lp, "finish_reason": o.finish_reason}
            )
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
