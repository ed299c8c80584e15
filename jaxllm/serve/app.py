"""The OpenAI-compatible routes over an `EngineWorker`: `/v1/models` (and `/v1/models/{id}`),
`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events with `stream: true`,
`streaming.py`), `/health` and `/metrics` (Prometheus text). Requests are validated by the
pydantic models of `protocol.py` (as vLLM's `entrypoints/openai` does); every refusal is HTTP 400
with OpenAI's error body (404 for a model `/v1/models/{id}` does not serve). A chat message's
content is a string or a list of parts: text, and for a vision-language model images
(`images.py`: data URLs, local files under `--allowed-local-media-path`), which the engine takes
with the request.
"""

from __future__ import annotations

import functools
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException

from jaxllm import __version__
from jaxllm.infer.engine import SamplingParams
from jaxllm.serve.guided import structured
from jaxllm.serve.images import PartError, chat_prompt
from jaxllm.serve.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_messages,
    check_supported,
    error,
    invalid,
)
from jaxllm.serve.streaming import Served, run, stream, usage
from jaxllm.serve.texts import (
    SampleText,
    chat_logprobs,
    completion_logprobs,
    echo_entries,
    vllm_prompt_logprobs,
)

__all__ = ["Served", "make_app"]


def _stop_strings(req: CompletionRequest | ChatRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _texts(s: Served, req: CompletionRequest | ChatRequest, stops: list[str]):
    """A sample's empty `SampleText`, cut at `stops`; the request's own stop strings kept in the
    text with vLLM's `include_stop_str_in_output`."""
    keep = _stop_strings(req) if req.include_stop_str_in_output else ()
    return functools.partial(SampleText, s.tok, stops, keep, req.min_tokens)


def _params(
    s: Served,
    req: CompletionRequest | ChatRequest,
    max_tokens,
    stops,
    logprobs: bool,
    top: int,
    prompt_logprobs: int | None = None,
):
    """The engine's SamplingParams of a request; stop strings are matched on the text here."""
    spec = structured(req)  # response_format, guided_* (400 naming the field)
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
            logit_bias=_logit_bias(s, req),
            min_tokens=req.min_tokens,
            prompt_logprobs=prompt_logprobs,
            structured=spec,
        )
    except ValueError as e:
        field = next((f for f in ("logit_bias", "min_tokens") if str(e).startswith(f)), None)
        raise BadRequest(str(e), field) from None


def _logit_bias(s: Served, req: CompletionRequest | ChatRequest) -> dict[int, float]:
    """`logit_bias` with its keys read as token ids; 400 for a key that is not one of the
    vocabulary's or a bias outside [-100, 100] (OpenAI's range)."""
    vocab, out = s.worker.engine.cfg.vocab_size, {}
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(f"logit_bias: the key {key!r} is not a token id", "logit_bias")
        if int(key) >= vocab:
            msg = f"logit_bias: token id {int(key)} is outside the vocabulary [0, {vocab})"
            raise BadRequest(msg, "logit_bias")
        if not -100 <= bias <= 100:
            msg = f"logit_bias: the bias {bias} of token {int(key)} is outside [-100, 100]"
            raise BadRequest(msg, "logit_bias")
        out[int(key)] = bias
    return out


def _prompts(s: Served, prompt) -> list[list[int]]:
    """A string, strings, token ids, or lists of token ids -> one list of ids per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt: give a string, strings or token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) if isinstance(p, list) else s.bos + s.tok.encode(p).tolist() for p in prompt]


def _echoed(s: Served, prompt, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text as `echo` returns it: as sent, or decoded when sent as token ids."""
    sent = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    return [p if isinstance(p, str) else s.tok.decode(ids) for p, ids in zip(sent, prompts)]


def _chat_prompt(s: Served, messages: list[dict]):
    """(prompt ids, images' `Pixels` or None) of chat messages; 400 when they cannot be used.
    An assistant message's null content (OpenAI's, beside tool calls) is empty text."""
    check_messages(messages)
    messages = [m if m["content"] is not None else {**m, "content": ""} for m in messages]
    try:
        return chat_prompt(messages, s.tok, s.vision, s.media)
    except PartError as e:
        raise BadRequest(e.message, e.param) from None
    except Exception as e:
        raise BadRequest(str(e), "messages") from None


def _chat_echo(req: ChatRequest) -> str:
    """The text chat's `echo` puts before the reply: the last message's when it is the
    assistant's (its text parts joined, as the prompt reads them), else nothing."""
    last = req.messages[-1]
    if not req.echo or last.get("role") != "assistant":
        return ""
    content = last.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if isinstance(p.get("text"), str))


def _usage_options(req: CompletionRequest | ChatRequest) -> dict:
    """`stream`'s with_usage and continuous of a request's stream_options."""
    opts = req.stream_options or {}
    return {
        "with_usage": opts.get("include_usage", False),
        "continuous": opts.get("continuous_usage_stats", False),
    }


def make_app(s: Served, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="jaxllm")

    @app.exception_handler(RequestValidationError)
    async def refused(request, exc: RequestValidationError):
        return invalid(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):  # 404, 405 in OpenAI's shape too
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, kind
        )

    @app.exception_handler(BadRequest)
    async def bad(request, exc: BadRequest):
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        kind = "not_found_error" if exc.status == 404 else kind
        return error(exc.status, exc.message, exc.param, kind, exc.code)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error(401, "invalid or missing API key", kind="authentication_error")
        return await call_next(request)

    def check_model(name: str) -> None:
        if name != s.name:
            raise BadRequest(f"model {name!r} is not served; this server has {s.name!r}", "model")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():  # vLLM's route: the server's version
        return {"version": __version__}

    def card() -> dict:
        return {
            "id": s.name,
            "object": "model",
            "created": s.created,
            "owned_by": "jaxllm",
            "max_model_len": s.max_len,  # vLLM's extra: the most tokens a sequence may hold
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != s.name:
            raise BadRequest(
                f"the model {model_id!r} does not exist; this server has {s.name!r}",
                "model",
                status=404,
                code="model_not_found",
            )
        return card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        check_supported(req)
        if req.prompt_logprobs is not None and req.stream:
            raise BadRequest(
                "prompt_logprobs is not streamed: ask without stream", "prompt_logprobs"
            )
        if req.max_tokens == 0 and not req.echo:
            raise BadRequest(
                "max_tokens: 0 generates nothing; it goes with echo: true (to score the prompt "
                "with logprobs)",
                "max_tokens",
            )
        prompts = _prompts(s, req.prompt)
        wants = req.logprobs is not None
        asked = [
            k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None
        ]
        max_tokens = s.max_tokens(req.max_tokens, prompts, default=16)
        params = _params(
            s, req, max_tokens, s.stops, wants, req.logprobs or 0, max(asked, default=None)
        )
        new_text = _texts(s, req, _stop_strings(req))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": s.name}
        head["created"] = int(time.time())
        echo = list(zip(_echoed(s, req.prompt, prompts), prompts)) if req.echo else None
        if req.stream:
            opts = _usage_options(req)
            return await stream(s, prompts, params, False, head, new_text, echo=echo, **opts)
        choices, all_outs = [], []
        for i, outs in enumerate(await run(s, prompts, params, new_text)):
            all_outs += outs
            for j, (t, reason) in enumerate(outs):
                text, entries = t.text, list(zip(t.ids, t.logprobs, t.tops))
                if echo:
                    text = echo[i][0] + text
                    entries = echo_entries(prompts[i], t.prompt_logprobs, req.logprobs) + entries
                lp = completion_logprobs(s.tok, entries) if wants else None
                choice = {"index": i * params.n + j, "text": text, "logprobs": lp}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(
                        s.tok, prompts[i], t.prompt_logprobs, req.prompt_logprobs
                    )
                choices.append({**choice, "finish_reason": reason})
        counts = usage(sum(map(len, prompts)), all_outs)
        return {**head, "choices": choices, "usage": counts}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req.model)
        check_supported(req)
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        prompt, images = _chat_prompt(s, req.messages)
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = s.max_tokens(asked, [prompt], field=field)
        stop_ids = s.eot.stop_ids | s.stops
        params = _params(s, req, max_tokens, stop_ids, req.logprobs, req.top_logprobs or 0)
        stops = _stop_strings(req)
        if s.eot.marker and not req.ignore_eos:  # a marker of several tokens ends the reply
            stops.append(s.eot.marker)
        new_text = _texts(s, req, stops)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "model": s.name}
        head["created"] = int(time.time())
        echoed = _chat_echo(req)
        if req.stream:
            head["object"] = "chat.completion.chunk"
            opts = _usage_options(req)
            return await stream(
                s, [prompt], params, True, head, new_text, images, **opts, chat_echo=echoed
            )
        (outs,) = await run(s, [prompt], params, new_text, images)
        choices = []
        for j, (t, reason) in enumerate(outs):
            entries = list(zip(t.ids, t.logprobs, t.tops))
            lp = chat_logprobs(s.tok, entries) if req.logprobs else None
            msg = {"role": "assistant", "content": echoed + t.text}
            choices.append({"index": j, "message": msg, "logprobs": lp, "finish_reason": reason})
        return {**head, "choices": choices, "usage": usage(len(prompt), outs)}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model or s.name)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give a prompt or messages (one of them)", "prompt")
        if req.prompt is not None:
            (ids,) = _prompts(s, req.prompt)
        else:
            ids = _chat_prompt(s, req.messages)[0]
        return {"count": len(ids), "max_model_len": s.max_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model or s.name)
        vocab = s.worker.engine.cfg.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"tokens: {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": s.tok.decode(req.tokens)}

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
