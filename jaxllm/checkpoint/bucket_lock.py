"""One writer per run on object storage: a lock object in the bucket.

`<run.dir>/.jaxllm.lock.json` is created only if absent (S3 `If-None-Match: *`, GCS
`ifGenerationMatch=0`, which s3fs and gcsfs send for `pipe_file(..., mode="create")`) and names
its holder (pid, host, since), as `jaxllm.train.run_dir.RunLock`'s holder file does locally.
The holder renews it every `RENEW_S` seconds (`renew`, from the mirror's worker thread). A lock
is stale, and is taken over with a warning, when its holder is a process of this host that is
no longer running (what the kernel's file lock tells locally) or when it was not renewed for
`STALE_S` seconds (a holder on another machine that died). On S3 the takeover is a write
conditional on the stale object's ETag (`If-Match`), so of two machines taking over the same
dead lock one wins; elsewhere it deletes the object and creates it again, and two takers racing
in that moment can both succeed. A holder whose lock was taken over finds out at its next
renewal and stops.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import uuid
import warnings

from jaxllm import storage
from jaxllm.config import JaxllmWarning, RunError

RENEW_S = 60.0
STALE_S = 300.0


def _stamp() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class BucketLock:
    """The lock object at `path` (fsspec's `bucket/key`) of the run at `url`, through `fs`."""

    def __init__(self, fs, url: str, key: str, path: str):
        self.fs, self.url, self.key, self.path = fs, url, key, path
        self._token = uuid.uuid4().hex  # tells our lock from a taker's
        self._since: str | None = None  # set while this process holds the lock
        self._renewed = 0.0

    def _errors(self):
        return storage.errors(self.url, self.key, self.fs)

    def _body(self) -> bytes:
        body = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": self._since or _stamp(),
            "renewed": time.time(),
            "token": self._token,
        }
        return (json.dumps(body) + "\n").encode()

    def holder(self) -> tuple[dict, dict] | None:
        """(the holder's record, the object's info), or None when there is no lock."""
        with self._errors():
            self.fs.invalidate_cache(self.path)
            try:
                info = self.fs.info(self.path)
                data = self.fs.cat_file(self.path)
            except FileNotFoundError:
                return None
        try:
            value = json.loads(data)
        except ValueError:
            value = {}
        return (value if isinstance(value, dict) else {}), info

    def acquire(self) -> None:
        """Creates the lock object, or takes a stale one over; RunError naming the holder."""
        with self._errors():
            try:
                self.fs.pipe_file(self.path, self._body(), mode="create")
            except FileExistsError:
                self._take_over()
            self._since = json.loads(self.fs.cat_file(self.path)).get("since")
        self._renewed = time.monotonic()

    def _stale(self, h: dict) -> bool:
        if h.get("host") == socket.gethostname() and isinstance(h.get("pid"), int):
            try:
                os.kill(h["pid"], 0)
            except ProcessLookupError:
                return True
            except OSError:  # alive, another user's
                return False
            return False
        renewed = h.get("renewed")
        return not isinstance(renewed, (int, float)) or time.time() - renewed > STALE_S

    def _take_over(self) -> None:
        found = self.holder()
        if found is None:  # released meanwhile
            self.fs.pipe_file(self.path, self._body(), mode="create")
            return
        h, info = found
        if not self._stale(h):
            raise RunError(
                f"{self.url} is being written by another jaxllm train (pid {h.get('pid', '?')} "
                f"on {h.get('host', '?')}, since {h.get('since', '?')}); wait for it to finish or "
                f"stop it (a lock not renewed for {STALE_S:.0f} s is taken over)."
            )
        if info.get("ETag"):  # S3: only one taker can replace that very object
            try:
                self.fs.pipe_file(self.path, self._body(), IfMatch=info["ETag"])
            except OSError:
                raise RunError(
                    f"{self.url}: another jaxllm train took the run over just now; wait for it "
                    "to finish or stop it."
                ) from None
        else:
            self.fs.rm_file(self.path)
            self.fs.pipe_file(self.path, self._body(), mode="create")
        warnings.warn(
            f"{self.url} was locked by pid {h.get('pid', '?')} on {h.get('host', '?')}, which "
            "is no longer running (or stopped renewing its lock); taking the run over.",
            JaxllmWarning,
            stacklevel=5,
        )

    def renew(self, force: bool = False) -> None:
        """Writes the lock again with a new `renewed` time (due every RENEW_S seconds, or at
        once with `force`); RunError when it is no longer ours."""
        if not self._since or (not force and time.monotonic() - self._renewed < RENEW_S):
            return
        found = self.holder()
        if found is None or found[0].get("token") != self._token:
            self._since = None
            raise RunError(
                f"{self.url}: the run's lock was taken over by another jaxllm train (on "
                f"{(found or ({},))[0].get('host', '?')}); this one stopped uploading."
            )
        match = {"IfMatch": found[1]["ETag"]} if found[1].get("ETag") else {}
        with self._errors():
            self.fs.pipe_file(self.path, self._body(), **match)
        self._renewed = time.monotonic()

    def release(self) -> None:
        """Deletes the lock object if it is still ours (a no-op when not held); never raises."""
        if not self._since:
            return
        self._since = None
        try:
            found = self.holder()
            if found is not None and found[0].get("token") == self._token:
                self.fs.rm_file(self.path)
        except Exception:
            pass  # it goes stale and is taken over by the next start
