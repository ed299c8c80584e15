"""`run.dir` on object storage (`s3://bucket/key`, `gs://bucket/key`): a local staging
directory mirrored to the bucket.

Orbax writes arrays only to a file system (and to gs:// through TensorStore, not to s3://), so a
run on object storage trains in a local directory with all of the local code unchanged, and
that directory is mirrored to the bucket, which stays the truth:

- `staging_dir(url)`: `$JAXLLM_CACHE/runs/<scheme>/<bucket>/<key>` (`~/.cache/jaxllm` when
  unset). Readers (`jaxllm eval / generate / convert export`, `load_model`) fetch the run into
  `.../remote/...` (`jaxllm.load.fetched`), so they never touch a writer's staging directory.
- `Remote.pull`: the bucket's run comes down before anything reads the staging directory:
  every file outside `checkpoints/`, and the checkpoints whose commit marker (Orbax's
  `_CHECKPOINT_METADATA`) is in the bucket; a local file the bucket does not have is deleted,
  one it has is downloaded unless the local manifest (`.jaxllm.mirror.json`) says it is the
  same object. Each step's marker comes down last, so an interrupted pull leaves no local
  checkpoint that the bucket does not hold.
- `Remote.saved(step)`: once the (asynchronous) save of `step` is finalized, a worker thread
  uploads the run files that go with it (metrics.jsonl, config.yaml, trackers.json), then the
  step directory with its marker last, after deleting (marker first) whatever the bucket held
  under that step. A step without its marker in the bucket is never a checkpoint: `pull` skips
  it, and the next upload of that step replaces it. `removed(steps)`: retention's deletions,
  marker first. `finish()`: everything else of the run directory (loss.png, summary.json,
  tensorboard/, ...), once training ended or stopped on a signal.
- `Remote.lock()`: one writer per bucket run, the object `<url>/.jaxllm.lock.json` created only
  if absent and renewed by the worker (`jaxllm.checkpoint.bucket_lock`). A holder that finds
  its lock taken over stops uploading and fails the run with a RunError.

Errors of the bucket (missing, credentials refused, endpoint unreachable) are one RunError
naming the URL.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path

from jaxllm import storage
from jaxllm.checkpoint.bucket_lock import BucketLock
from jaxllm.checkpoint.files import FINALIZED
from jaxllm.config import ConfigError, RunError
from jaxllm.config.urls import split_url

LOCK_OBJECT = ".jaxllm.lock.json"
MANIFEST = ".jaxllm.mirror.json"
LOCAL_ONLY_PREFIX = ".jaxllm."  # the local lock, its holder file, the manifest: never mirrored
CHECKPOINTS = "checkpoints"
RUN_FILES = ("metrics.jsonl", "config.yaml", "trackers.json")  # uploaded with each checkpoint


def staging_dir(url: str) -> Path:
    """`<cache>/runs/<scheme>/<bucket>/<key>` (`storage.cache_dir()`: `$JAXLLM_CACHE`, else
    `~/.cache/jaxllm`): where the run at `url` trains."""
    scheme, bucket, path = split_url(url)
    return storage.cache_dir() / "runs" / scheme / bucket / path


def _identity(info: dict) -> list:
    """What tells one stored object from another: its size and the store's tag."""
    tag = next(
        (info[k] for k in ("ETag", "etag", "md5Hash", "generation") if info.get(k)),
        info.get("LastModified") or info.get("updated") or info.get("mtime"),
    )
    return [int(info.get("size") or 0), str(tag)]


def _local_files(root: Path) -> dict[str, Path]:
    """{relative posix path: file} under `root`, the local-only files left out."""
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(LOCAL_ONLY_PREFIX)
    }


def _step_of(rel: str) -> int | None:
    """The step of a path under `checkpoints/<step>/`, else None (strays: `4.damaged/...`)."""
    parts = rel.split("/")
    if len(parts) >= 3 and parts[0] == CHECKPOINTS and parts[1].isdigit():
        return int(parts[1])
    return None


class Remote:
    """The mirror of one run directory: `local` (the staging directory) and `url`."""

    def __init__(self, url: str, local: Path, key: str = "run.dir"):
        self.url, self.local, self.key = url.rstrip("/"), Path(local), key
        self.fs = storage.filesystem(self.url, key)
        _, bucket, path = split_url(self.url)
        self.bucket, self.root = bucket, f"{bucket}/{path}" if path else bucket
        self._manifest: dict[str, list] = {}
        self._tasks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._stop = threading.Event()  # set by `close`: no more waiting for markers
        self._worker: threading.Thread | None = None
        self._lock_tag: str | None = None  # our lock object's ETag / token
        self._lock = BucketLock(self.fs, self.url, key, self._remote(LOCK_OBJECT))
        self.pending: set[int] = set()  # steps queued for upload and not uploaded yet

    # -- the bucket's side -------------------------------------------------------------------

    def _remote(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def listing(self) -> dict[str, dict]:
        """{relative path: info} of every object of the run in the bucket, the lock left out."""
        with storage.errors(self.url, self.key, self.fs):
            self.fs.info(self.bucket)  # a missing bucket, refused credentials, no endpoint
            found = self.fs.find(self.root, detail=True)
        out = {}
        for path, info in found.items():
            rel = path[len(self.root) + 1 :]
            if rel and not rel.split("/")[-1].startswith(LOCAL_ONLY_PREFIX):
                out[rel] = info
        return out

    def complete_steps(self, listing: dict[str, dict]) -> list[int]:
        """The steps whose commit marker is in the bucket: its checkpoints."""
        return sorted(
            s
            for rel in listing
            if (s := _step_of(rel)) is not None and rel == f"{CHECKPOINTS}/{s}/{FINALIZED}"
        )

    # -- pull ----------------------------------------------------------------------------------

    def _load_manifest(self) -> None:
        try:
            value = json.loads((self.local / MANIFEST).read_text())
        except (OSError, ValueError):
            value = {}
        self._manifest = value if isinstance(value, dict) else {}

    def _save_manifest(self) -> None:
        tmp = self.local / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self._manifest, sort_keys=True))
        tmp.replace(self.local / MANIFEST)

    def _record(self, rel: str, info: dict) -> None:
        local = self.local / rel
        st = local.stat()
        self._manifest[rel] = [*_identity(info), st.st_size, st.st_mtime_ns]

    def _known(self, rel: str, info: dict | None) -> bool:
        """Whether the local file `rel` is the bucket's object `info` (by the manifest)."""
        seen, local = self._manifest.get(rel), self.local / rel
        if not seen or not local.is_file():
            return False
        st = local.stat()
        same_local = seen[2:] == [st.st_size, st.st_mtime_ns]
        return same_local and (info is None or seen[:2] == _identity(info))

    def pull(self) -> list[int]:
        """Makes the staging directory the bucket's run; returns the bucket's checkpoint steps."""
        self.local.mkdir(parents=True, exist_ok=True)
        self._load_manifest()
        listing = self.listing()
        complete = self.complete_steps(listing)
        wanted = {
            rel: info
            for rel, info in listing.items()
            if _step_of(rel) in complete or rel.split("/")[0] != CHECKPOINTS
        }
        for rel, path in _local_files(self.local).items():
            if rel not in wanted:
                path.unlink()
                self._manifest.pop(rel, None)
        for d in sorted(
            (p for p in self.local.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
        ):
            if not any(d.iterdir()):
                d.rmdir()
        fetch = [rel for rel, info in wanted.items() if not self._known(rel, info)]
        markers = [rel for rel in fetch if rel.endswith("/" + FINALIZED)]
        for rel in fetch:  # a step that changed: its local marker goes first, comes back last
            if (step := _step_of(rel)) is not None:
                (self.local / CHECKPOINTS / str(step) / FINALIZED).unlink(missing_ok=True)
        self._download([r for r in fetch if r not in markers], wanted)
        self._download(markers, wanted)
        self._manifest = {k: v for k, v in self._manifest.items() if k in wanted}
        self._save_manifest()
        return complete

    def _download(self, rels: list[str], infos: dict[str, dict]) -> None:
        if not rels:
            return
        for rel in rels:
            (self.local / rel).parent.mkdir(parents=True, exist_ok=True)
        with storage.errors(self.url, self.key, self.fs):
            tmps = [str(self.local / rel) + ".jaxllm-part" for rel in rels]
            self.fs.get([self._remote(r) for r in rels], tmps)
        for rel, tmp in zip(rels, tmps):
            os.replace(tmp, self.local / rel)
            self._record(rel, infos[rel])

    # -- push (the worker) ----------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="jaxllm-mirror", daemon=True)
            self._worker.start()

    def check(self) -> None:
        """Raises the worker's failure (again at every call: after one, nothing more goes up,
        so the bucket keeps its newest complete checkpoint)."""
        e = self._error
        if e is not None:
            raise e if isinstance(e, RunError) else RunError(f"uploading to {self.url}: {e}")

    def saved(self, step: int) -> None:
        """Queues the upload of checkpoint `step` (written asynchronously: the worker waits for
        its marker) with the run files as they are now."""
        self.check()
        files = {}
        for name in RUN_FILES:
            with contextlib.suppress(OSError):
                files[name] = (self.local / name).read_bytes()
        self._start_worker()
        self.pending.add(step)
        self._tasks.put(("step", step, files))

    def removed(self, steps: list[int]) -> None:
        """Queues the deletion of checkpoints retention deleted locally."""
        self.check()
        self._start_worker()
        self._tasks.put(("remove", steps, None))

    def wait(self) -> None:
        """Blocks until every queued upload is done; RunError when one failed."""
        if self._worker is not None:
            self._tasks.join()
        self.check()

    def finish(self) -> None:
        """Uploads every file of the run not uploaded yet (after the queued checkpoints)."""
        self.wait()
        self._start_worker()
        self._tasks.put(("rest", None, None))
        self.wait()

    def _work(self) -> None:
        """Runs the queued uploads in order, and renews the lock; ends once `close` was called
        and the queue is empty."""
        while not (self._stop.is_set() and self._tasks.empty()):
            try:
                kind, arg, files = self._tasks.get(timeout=0.2)
            except queue.Empty:
                self._maybe_renew()
                continue
            try:
                if self._error is None:
                    if kind == "step":
                        self._push_step(arg, files)
                        self.pending.discard(arg)
                    elif kind == "remove":
                        self._remove_steps(arg)
                    elif kind == "rest":
                        self._push_rest()
                    self._maybe_renew(force=True)
            except BaseException as e:  # reported to the main thread by `check`
                self._error = e
            finally:
                self._tasks.task_done()

    def _push_step(self, step: int, files: dict[str, bytes]) -> None:
        step_dir = self.local / CHECKPOINTS / str(step)
        while not (step_dir / FINALIZED).is_file():  # Orbax finalizes in the background
            if self._stop.is_set():
                return  # the save never finished: nothing of it goes up
            time.sleep(0.05)
        with storage.errors(self.url, self.key, self.fs):
            for name, data in files.items():
                self.fs.pipe_file(self._remote(name), data)
            prefix = self._remote(f"{CHECKPOINTS}/{step}")
            self._delete_step(prefix)  # an older upload of this step (a damaged or torn one)
            rels = [
                f"{CHECKPOINTS}/{step}/{p.relative_to(step_dir).as_posix()}"
                for p in sorted(step_dir.rglob("*"))
                if p.is_file() and p.name != FINALIZED
            ]
            self.fs.put([str(self.local / r) for r in rels], [self._remote(r) for r in rels])
            marker = f"{CHECKPOINTS}/{step}/{FINALIZED}"
            self.fs.put_file(str(self.local / marker), self._remote(marker))
            self.fs.invalidate_cache(prefix)
            infos = self.fs.find(prefix, detail=True)
        for path, info in infos.items():
            rel = path[len(self.root) + 1 :]
            if (self.local / rel).is_file():
                self._record(rel, info)
        self._save_manifest()

    def _remove_steps(self, steps: list[int]) -> None:
        with storage.errors(self.url, self.key, self.fs):
            for step in steps:
                self._delete_step(self._remote(f"{CHECKPOINTS}/{step}"))
        for rel in [r for r in self._manifest if _step_of(r) in steps]:
            self._manifest.pop(rel)
        self._save_manifest()

    def _delete_step(self, prefix: str) -> None:
        """Deletes a step in the bucket, its marker first: never a marker without its files."""
        found = self.fs.find(prefix)
        marker = f"{prefix}/{FINALIZED}"
        if marker in found:
            self.fs.rm_file(marker)
        rest = [p for p in found if p != marker]
        if rest:
            self.fs.rm(rest)
        self.fs.invalidate_cache(prefix)

    def _push_rest(self) -> None:
        """Every local file outside checkpoints/ that the bucket does not hold as it is."""
        rels = [
            rel
            for rel in _local_files(self.local)
            if rel.split("/")[0] != CHECKPOINTS and not self._known(rel, None)
        ]
        if not rels:
            return
        with storage.errors(self.url, self.key, self.fs):
            self.fs.put([str(self.local / r) for r in rels], [self._remote(r) for r in rels])
            self.fs.invalidate_cache(self.root)
            for rel in rels:
                self._record(rel, self.fs.info(self._remote(rel)))
        self._save_manifest()

    def close(self) -> None:
        """Stops the worker: queued steps whose save never finished are not uploaded."""
        self._stop.set()
        if self._worker is not None:
            self._worker.join()

    # -- the lock (`bucket_lock.BucketLock`) --------------------------------------------------

    def lock(self) -> None:
        """Takes the run's lock object (after checking the bucket can be listed); from then on
        the worker renews it."""
        self.listing()  # the bucket exists and these credentials may list it
        self._lock.acquire()
        self._start_worker()

    def _maybe_renew(self, force: bool = False) -> None:
        try:
            self._lock.renew(force)
        except BaseException as e:
            self._error = self._error or e

    def unlock(self) -> None:
        """Deletes the lock object if it is still ours."""
        self._lock.release()


def check_run_config(cfg, url: str) -> None:
    """ConfigError for what a run on object storage cannot do."""
    if cfg.checkpoint.dir:
        raise ConfigError(
            f"checkpoint.dir={cfg.checkpoint.dir} with run.dir={url}: a run on object storage "
            "keeps its checkpoints in <run.dir>/checkpoints; leave checkpoint.dir unset."
        )
    if cfg.checkpoint.start_fresh:
        raise ConfigError(
            f"checkpoint.start_fresh=true with run.dir={url}: a bucket cannot move the old run "
            "aside (it has no rename); give a new run.dir instead."
        )
