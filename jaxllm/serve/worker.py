"""The engine's thread: one background thread owns the `Engine` and steps it while requests
are pending; HTTP handlers (on the event loop) hand it requests and aborts through a queue and
receive each request's tokens on an asyncio queue of their own.

Events sent to a request's queue: ("prompt", sample index, `Output.prompt_logprobs`) when a
sample that asked for them has its prompt's log-probabilities (before its tokens), ("token", sample index, token id, log-probability, top
(token, log-prob) pairs or None) per new token, ("done", `Output`) per finished sample,
("cancelled",) when the server stops, ("error", message) when a step failed.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import traceback

from jaxllm.infer.engine import Engine, SamplingParams


class EngineWorker:
    """Runs `engine` in a thread; `submit` and `abort` are called from the event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self.tokens_total = 0
        self.requests_total = 0
        self._recent: collections.deque = collections.deque()  # (time, tokens) of recent steps
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancels what is in flight (each stream gets its samples as finished so far) and ends
        the thread."""
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)

    async def submit(
        self, prompt: list[int], params: SamplingParams, images=None
    ) -> tuple[int, asyncio.Queue]:
        """Queues a request (with its images' `Pixels`, if any); returns (request id, its event
        queue). ValueError when the engine refuses it, EngineFailed when it fails on it."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        fut = loop.create_future()
        self._commands.put(("add", prompt, params, loop, events, fut, images))
        rid = await fut
        if isinstance(rid, Exception):
            raise rid
        return rid, events

    def abort(self, rid: int, index: int | None = None) -> None:
        """Ends request `rid` (only its sample `index` if given) in the engine."""
        self._commands.put(("abort", rid) if index is None else ("abort", rid, index))

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [n for t, n in list(self._recent) if now - t <= window]
        return sum(recent) / window

    def _emit(self, rid: int, event: tuple) -> None:
        loop, events = self._streams.get(rid, (None, None))
        if loop is not None:
            loop.call_soon_threadsafe(events.put_nowait, event)

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, prompt, params, loop, events, fut, images = cmd
            try:
                rid = self.engine.add_request(prompt, params, images=images)
            except ValueError as e:  # the request's fault: a 400
                loop.call_soon_threadsafe(_resolve, fut, e)
                return
            except Exception as e:  # the engine's: a 500, and the thread goes on serving
                traceback.print_exc()
                failed = EngineFailed(f"the engine failed: {type(e).__name__}: {e}")
                loop.call_soon_threadsafe(_resolve, fut, failed)
                return
            self._streams[rid] = (loop, events)
            self.requests_total += 1
            loop.call_soon_threadsafe(_resolve, fut, rid)
        elif cmd[0] == "abort":
            self.engine.abort(*cmd[1:])
            if len(cmd) == 2:
                self._streams.pop(cmd[1], None)

    def _fail_all(self, message: str) -> None:
        """Ends every request in flight with ("error", message) and frees its pages."""
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            finally:
                self._emit(rid, ("error", message))
        self._streams.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._command(self._commands.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                result = self.engine.step()
            except Exception as e:  # fail what is in flight, keep serving the next requests
                traceback.print_exc()
                self._fail_all(f"the engine failed: {type(e).__name__}: {e}")
                continue
            now = time.monotonic()
            self._recent.append((now, len(result.new_tokens)))
            while self._recent and now - self._recent[0][0] > 60:
                self._recent.popleft()
            self.tokens_total += len(result.new_tokens)
            for rid, index, logprobs in result.prompts:
                self._emit(rid, ("prompt", index, logprobs))
            for (rid, index, token), (lp, top) in zip(result.new_tokens, result.new_logprobs):
                self._emit(rid, ("token", index, token, lp, top))
            for out in result.finished:
                self._emit(out.request_id, ("done", out))
        for rid in list(self._streams):  # shutting down: cancel what is left
            self.engine.abort(rid)
            self._emit(rid, ("cancelled",))
        self._streams.clear()


class EngineFailed(RuntimeError):
    """The engine could not take a request for a reason of its own (not the request's)."""


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
