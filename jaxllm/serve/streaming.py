"""`Served` (the worker, tokenizer and names the routes share) and a request's run through the
engine's worker: its events followed as text (`SampleText`, cut
at stop strings), to the end (`run`) or as OpenAI's server-sent events (`stream`, with a last
usage chunk on `stream_options.include_usage`). A client that goes away (the stream's generator
is closed) aborts its request, whose pages go back to the pool."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi.responses import StreamingResponse

from jaxllm.infer.chat import EndOfTurn
from jaxllm.infer.engine import SamplingParams
from jaxllm.serve.protocol import BadRequest
from jaxllm.serve.texts import SampleText, chat_logprobs, completion_logprobs, echo_entries
from jaxllm.serve.worker import EngineFailed, EngineWorker


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

    def max_tokens(
        self, asked: int | None, prompts: list[list[int]], default=None, field="max_tokens"
    ) -> int:
        """`asked`, or when it is None the rest of the context after the longest prompt
        (at most `default`); 400 when a prompt leaves no room, or no room for `asked`."""
        longest = max(map(len, prompts))
        if asked is not None:
            if longest + asked > self.max_len:
                raise BadRequest(
                    f"this server's context is {self.max_len} tokens; the prompt ({longest} "
                    f"tokens) and {field} ({asked}) ask for {longest + asked}: lower {field} or "
                    "shorten the prompt",
                    field,
                )
            return asked
        if longest >= self.max_len:
            raise BadRequest(
                f"the prompt ({longest} tokens) leaves no room to generate in this server's "
                f"{self.max_len}-token context; shorten it",
                "prompt",
            )
        return min(self.max_len - longest, default or self.max_len)


async def submit(s: Served, prompt, params, images=None):
    try:
        return await s.worker.submit(prompt, params, images)
    except EngineFailed as e:
        raise BadRequest(str(e), status=500) from None
    except ValueError as e:
        raise BadRequest(str(e), "prompt") from None


async def follow(s: Served, rid: int, events, texts: list[SampleText]):
    """Yields (sample, text delta, its (token, log-prob, top) entries, finish reason or None)
    as a request's events come; a sample whose text reaches a stop string is ended in the
    engine."""
    left = len(texts)
    while left:
        event = await events.get()
        if event[0] == "prompt":
            texts[event[1]].prompt_logprobs = event[2]
        elif event[0] == "token":
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


async def submit_all(s: Served, prompts: list, params, images=None) -> list:
    """(request id, events) of one request per prompt; a prompt the engine refuses refuses
    them all."""
    submitted = []
    try:
        for p in prompts:
            submitted.append(await submit(s, p, params, images))
    except BadRequest:
        for rid, _ in submitted:
            s.worker.abort(rid)
        raise
    return submitted


async def run(s: Served, prompts: list, params: SamplingParams, new_text, images=None) -> list:
    """Runs requests, one per prompt, at once to their end: each prompt's list of its samples'
    (SampleText, finish reason). `new_text()`: a sample's empty `SampleText` (its stops)."""
    submitted = await submit_all(s, prompts, params, images)
    return await asyncio.gather(*(collect(s, *r, params, new_text) for r in submitted))


async def merged(s: Served, submitted: list, texts: list[list[SampleText]]):
    """`follow`'s items of several requests as they come, each led by its request's place."""
    out: asyncio.Queue = asyncio.Queue()

    async def pump(k, rid, events):
        try:
            async for item in follow(s, rid, events, texts[k]):
                await out.put((k, *item))
        except BadRequest as e:
            await out.put(e)
        finally:
            await out.put(None)

    tasks = [asyncio.create_task(pump(k, *r)) for k, r in enumerate(submitted)]
    try:
        left = len(tasks)
        while left:
            item = await out.get()
            if isinstance(item, BadRequest):
                raise item
            left -= item is None
            if item is not None:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def collect(s: Served, rid: int, events, params: SamplingParams, new_text) -> list:
    """One request's samples as (SampleText, finish reason), once all have ended."""
    texts = [new_text() for _ in range(params.n)]
    reasons = ["stop"] * params.n  # a cancelled sample (server stopping) ends as it is
    try:
        async for i, _, _, reason in follow(s, rid, events, texts):
            reasons[i] = reason or reasons[i]
    finally:
        s.worker.abort(rid)
    return list(zip(texts, reasons))


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream(
    s: Served,
    prompts,
    params,
    chat: bool,
    head: dict,
    new_text,
    images=None,
    with_usage=False,
    continuous=False,
    echo=None,
    chat_echo: str = "",
):
    """Server-sent events of one request per prompt (their choices numbered prompt * n +
    sample, as OpenAI's; `with_usage`: a last chunk of the token counts; `continuous`: vLLM's
    `continuous_usage_stats`, every chunk with its sample's counts so far; `echo`: (text, ids)
    per prompt, a sample's first chunk holding its prompt and log-probabilities; `chat_echo`:
    chat's echoed text, a chunk of each sample's after its role's); aborting them when the
    client goes (the generator is closed) frees their pages."""
    submitted = await submit_all(s, prompts, params, images)
    want, n = params.logprobs, params.n
    offsets = [0] * (n * len(prompts))
    texts = [[new_text() for _ in range(n)] for _ in prompts]

    def event(choice, k=0, i=None) -> str:
        counts = {}
        if continuous:
            outs = [] if i is None else [(texts[k][i], None)]
            counts["usage"] = usage(len(prompts[k]), outs)
        return sse({**head, "choices": [choice], **counts})

    def chunk(index, text, entries, finish=None):
        lp = None
        if chat:
            lp = chat_logprobs(s.tok, entries) if want else None
            choice = {"index": index, "delta": {"content": text}, "logprobs": lp}
        else:
            lp = completion_logprobs(s.tok, entries, offsets[index]) if want else None
            offsets[index] += sum(len(t) for t in lp["tokens"]) if lp else 0
            choice = {"index": index, "text": text, "logprobs": lp}
        return event({**choice, "finish_reason": finish}, *divmod(index, n))

    echoed = set()

    async def gen():
        try:
            if chat:
                for i in range(n):
                    role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                    yield event({**role, "finish_reason": None})
                for i in range(n if chat_echo else 0):
                    said = {"index": i, "delta": {"content": chat_echo}, "logprobs": None}
                    yield event({**said, "finish_reason": None})
            try:
                async with contextlib.aclosing(merged(s, submitted, texts)) as items:
                    async for k, i, delta, entries, reason in items:
                        if echo and (k, i) not in echoed:  # the engine has its prompt's now
                            echoed.add((k, i))
                            text, ids = echo[k]
                            top = params.top_logprobs
                            head_entries = echo_entries(ids, texts[k][i].prompt_logprobs, top)
                            yield chunk(k * n + i, text, head_entries)
                        yield chunk(k * n + i, delta, entries, reason)
            except BadRequest as e:  # the engine failed mid-stream: say so, as vLLM does
                yield sse({"error": {"message": e.message, "type": "server_error", "code": 500}})
                yield "data: [DONE]\n\n"
                return
            if with_usage:
                outs = [(t, None) for ts in texts for t in ts]
                counts = usage(sum(map(len, prompts)), outs)
                yield sse({**head, "choices": [], "usage": counts})
            yield "data: [DONE]\n\n"
        finally:
            for rid, _ in submitted:
                s.worker.abort(rid)

    return StreamingResponse(gen(), media_type="text/event-stream")


def usage(prompt_tokens: int, outs) -> dict:
    done = sum(t.generated for t, _ in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done,
        "total_tokens": done + prompt_tokens,
    }
