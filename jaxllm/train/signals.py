"""SIGINT and SIGTERM during `jaxllm train`, with exit codes a scheduler can rely on.

- During start-up (loading, restoring, compiling) nothing has been trained, so nothing needs
  saving: the process exits at once, 130 for SIGINT and 143 for SIGTERM (128 + the signal), with
  one line on stderr. A watcher thread woken through `signal.set_wakeup_fd` does it, so the
  signal is answered even while the main thread is inside XLA's compiler (a Python handler would
  wait for it to return, and a KeyboardInterrupt raised there can crash the process).
- Once training runs, a signal only sets `received`: the loop finishes the step in flight,
  writes a checkpoint and ends normally (exit 0).
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Signals:
    """Context manager; a no-op outside the main thread (signals go to the main thread)."""

    def __init__(self):
        self.received: int | None = None
        self.starting = True
        self._cleanups: list[Callable[[], None]] = []
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        # Held by start-up while it creates files, and by an exit during start-up while it
        # removes them, so the two never interleave (compiling does not hold it).
        self.writing = threading.Lock()

    def on_startup_exit(self, fn: Callable[[], None]) -> None:
        """`fn` runs before an exit during start-up (e.g. releasing the run's lock)."""
        self._cleanups.append(fn)

    def running(self) -> None:
        """From now on a signal stops the loop gracefully instead of exiting."""
        self.starting = False

    def __enter__(self) -> Signals:
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._watcher = threading.Thread(
            target=self._watch, args=(r,), name="jaxllm-signals", daemon=True
        )
        self._watcher.start()
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def _watch(self, r: int) -> None:
        while True:
            try:
                select.select([r], [], [])
                data = os.read(r, 64)
            except OSError:
                return  # the pipe was closed: the context ended
            if not data:
                return
            for signum in data:
                if self.starting and signum in SIGNALS:
                    self._exit_now(signum)

    def _exit_now(self, signum: int) -> None:
        self.writing.acquire()  # never released: the process ends below
        for fn in self._cleanups:
            try:
                fn()
            except Exception:
                pass
        name = signal.Signals(signum).name
        os.write(2, f"jaxllm: {name} during start-up; nothing was trained yet, exiting.\n".encode())
        os._exit(128 + signum)

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        r, w = self._pipe
        os.close(w)  # the watcher reads end-of-file and returns
        self._watcher.join(timeout=5)
        os.close(r)
        self._pipe = None
