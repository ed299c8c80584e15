"""What `jaxllm train` may do to a run directory, decided before it writes anything.

- `check_paths`: `run.dir` and `checkpoint.dir` must be (or become) writable directories;
  a file in their place or a read-only file system is a RunError (exit 1).
- `check_resume`: a run directory whose checkpoints were written for another model shape,
  tokenizer or optimizer state is refused with a ConfigError naming the keys that differ
  (exit 2), instead of taking its checkpoints for damaged ones and training over them. So is
  `checkpoint.resume=false` in a directory that holds training checkpoints. Resuming on other
  `data.sources` / `data.eval_sources` is allowed (training on new data) with a warning naming
  them: it is also what reusing a run.dir for a new run by mistake looks like.
- `move_aside` / `move_back`: `checkpoint.start_fresh` puts the old run in a sibling
  `<run.dir>.old` (never deletes it), and back when the start-up fails.
- `recorded`: the config as config.yaml and the checkpoints record it, one-shot keys off.
- `RunLock`: one writer per run directory, an OS file lock (`filelock`) plus a small JSON file
  naming the holder's pid and host for the refusal message. The kernel releases the lock of a
  process that dies; a holder file left behind by one is taken over with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import socket
import warnings
from pathlib import Path

import jax

from jaxllm import checkpoint, config, optim, storage
from jaxllm.checkpoint import mirror
from jaxllm.config import ConfigError, JaxllmWarning, RunError
from jaxllm.config.grad_compression import step_optim
from jaxllm.model import abstract_model, abstract_model_state
from jaxllm.model.groups import freeze_mask
from jaxllm.train.state import sparse_weights

LOCK_NAME = ".jaxllm.lock"
HOLDER_NAME = ".jaxllm.lock.json"


def check_paths(run_dir: Path, ckpt_dir: Path) -> None:
    """RunError when the run's directories cannot be written: a file where a directory must
    be, or a directory (or the nearest existing parent of one still to be made) that this
    process may not write."""
    for key, path in (("run.dir", run_dir), ("checkpoint.dir", ckpt_dir)):
        if path.exists() and not path.is_dir():
            raise RunError(f"{key}={path} is a file, not a directory; point {key} elsewhere.")
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise RunError(f"{key}={path} cannot be made: {existing} is a file.")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise RunError(
                f"{key}={path} is not writable ({existing} is read-only for this user); "
                "make it writable or point the run elsewhere."
            )


def _flat(tree: dict, prefix: str) -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _shapes(tree):
    return jax.tree.map(lambda a: tuple(a.shape), tree)


def check_resume(cfg: config.Config, ckpt_dir: Path) -> None:
    """ConfigError when this config cannot continue the checkpoints in `ckpt_dir`: their model
    has other parameter shapes (layers, widths, vocabulary, ...), or they were trained with
    another tokenizer, or `checkpoint.resume=false` would train over them. Reads only the
    newest checkpoint's small `config` and `tokenizer` items; changes nothing."""

    if cfg.checkpoint.start_fresh:
        return  # the old run is moved aside, not continued
    found = checkpoint.steps(ckpt_dir)
    trained = [s for s in found if checkpoint.has_train_state(ckpt_dir, s)]
    if trained and not cfg.checkpoint.resume:
        raise ConfigError(
            f"checkpoint.resume=false, but {ckpt_dir} holds checkpoints up to step {trained[-1]} "
            "that training would overwrite; give a new run.dir (or checkpoint.dir) for a fresh "
            "run, or add checkpoint.start_fresh=true to move this one aside first."
        )
    saved = next(
        (c for s in reversed(found) if (c := checkpoint.read_json_item(ckpt_dir, s, "config"))),
        None,
    )
    if saved is None:
        return  # nothing written yet, or nothing readable: restoring decides
    try:
        theirs = config.from_dict(saved)
    except ConfigError:
        return  # written by another version of jaxllm: restoring decides
    differ = []
    if _shapes(abstract_model(theirs.model, theirs.peft)[1]) != _shapes(
        abstract_model(cfg.model, cfg.peft)[1]
    ) or (
        _shapes(abstract_model_state(theirs.model)[0])
        != _shapes(abstract_model_state(cfg.model)[0])
    ):
        ours = {**_flat(config.to_dict(cfg)["model"], "model.")}
        old = {**_flat(saved["model"], "model.")}
        ours.update(_flat(config.to_dict(cfg)["peft"], "peft."))
        old.update(_flat(saved.get("peft", {}), "peft."))
        differ = [
            f"{k} ({old.get(k)!r} there, {ours.get(k)!r} here)"
            for k in sorted(set(ours) | set(old))
            if ours.get(k) != old.get(k)
        ]
        differ = differ or ["the model's parameter shapes"]
    elif trained and not cfg.checkpoint.reset_optimizer:
        differ = _optimizer_differs(theirs, cfg)
    saved_tok = checkpoint.read_json_item(ckpt_dir, found[-1], "tokenizer")
    if saved_tok is not None and saved_tok != checkpoint.tokenizer_record(cfg.data.tokenizer):
        differ.append(
            f"data.tokenizer ({saved_tok.get('name')!r} there, {cfg.data.tokenizer!r} here)"
        )
    if differ and any(d.startswith(("optim.", "train.freeze")) for d in differ):
        raise ConfigError(
            f"{ckpt_dir} holds checkpoints whose optimizer state is another optimizer's: "
            f"{'; '.join(differ)}; resume with the same optim.* (and train.freeze), add "
            "checkpoint.reset_optimizer=true to keep the parameters and start a fresh optimizer "
            "state, or start a new run with run.dir=NEW_DIR."
        )
    if differ:
        raise ConfigError(
            f"{ckpt_dir} holds checkpoints of another model or tokenizer: {'; '.join(differ)}; "
            "to train this config, start a new run with run.dir=NEW_DIR."
        )
    _warn_new_data(saved.get("data", {}), config.to_dict(cfg)["data"], ckpt_dir, found[-1])


def _warn_new_data(old: dict, new: dict, ckpt_dir: Path, step: int) -> None:
    """A warning naming the data keys whose sources differ from the checkpoints' config."""
    changed = []
    for key in ("sources", "eval_sources"):
        before, now = old.get(key, []), new[key]
        if before != now:
            paths = [[s.get("path") for s in x] for x in (before, now)]
            before, now = paths if paths[0] != paths[1] else (before, now)
            changed.append(f"data.{key} ({before} there, {now} here)")
    if changed:
        warnings.warn(
            f"resuming {ckpt_dir} from step {step} on other data: {'; '.join(changed)}; the "
            "data stream goes on from the checkpoint's position. For a new run give a new "
            "run.dir (or checkpoint.start_fresh=true to move this one aside).",
            JaxllmWarning,
            stacklevel=2,
        )


def _opt_shapes(cfg: config.Config) -> dict:
    """{path: (shape, dtype)} of the optimizer state this config's optimizer keeps."""
    _, params, axes = abstract_model(cfg.model, cfg.peft)
    frozen = freeze_mask(params, cfg.train.freeze, cfg.peft.method)
    frozen = optim.groups.frozen_mask(params, cfg.optim.param_groups, frozen)
    tx = optim.build(step_optim(cfg), cfg.train.steps, axes, sparse_weights(cfg, axes), 0, frozen)
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, params))[0]
    return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves}


def _optimizer_differs(theirs: config.Config, ours: config.Config) -> list[str]:
    """The `optim.*` keys (old and new values) when the two configs' optimizers keep state of
    another structure, shapes or dtypes (a checkpoint of one cannot resume the other); []
    when they keep the same (a new learning rate, say, resumes fine)."""
    if _opt_shapes(theirs) == _opt_shapes(ours):
        return []
    old, new = config.to_dict(theirs)["optim"], config.to_dict(ours)["optim"]
    differ = [
        f"optim.{k} ({old.get(k)!r} there, {new.get(k)!r} here)"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]
    if theirs.train.freeze != ours.train.freeze:
        differ.append(
            f"train.freeze ({list(theirs.train.freeze)} there, {list(ours.train.freeze)} here)"
        )
    return differ or ["optim.* (the optimizer state's structure)"]


def optimizer_change(cfg: config.Config, ckpt_dir: Path, step: int) -> str:
    """'optim.name adamw -> sgd, ...': how this config's optimizer differs from the one of the
    checkpoint at `step` (what `checkpoint.reset_optimizer` records in metrics.jsonl)."""
    saved = checkpoint.read_json_item(ckpt_dir, step, "config") or {}
    old, new = saved.get("optim", {}), config.to_dict(cfg)["optim"]
    changed = [f"optim.{k} {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
    return ", ".join(changed) or "same optim.* settings, fresh state"


# what a run may read from object storage through a local copy, recorded as the URL it named
_READ_FROM_URLS = (
    ("run", "dir"),
    ("checkpoint", "init_from"),
    ("train", "teacher"),
    ("train", "reference"),
    ("train", "reward"),
    ("data", "tokenizer"),
)


def recorded(cfg: config.Config, asked: config.Config | None = None) -> config.Config:
    """`cfg` as config.yaml and the checkpoints record it: the one-shot keys
    (`checkpoint.reset_optimizer`, `checkpoint.start_fresh`) false, so that resuming the run
    from its own config.yaml does not act on them again; and with `asked` (the config as the
    user gave it) every key that named a URL (`run.dir` of a staged run, a model or tokenizer
    read through its local copy) the URL again, so the run resumes anywhere."""
    for section, field in _READ_FROM_URLS if asked is not None else ():
        value = getattr(getattr(asked, section), field)
        if storage.is_url(value):
            part = dataclasses.replace(getattr(cfg, section), **{field: value})
            cfg = dataclasses.replace(cfg, **{section: part})
    once = dataclasses.replace(cfg.checkpoint, reset_optimizer=False, start_fresh=False)
    return dataclasses.replace(cfg, checkpoint=once)


def staged(cfg: config.Config) -> tuple[str | None, config.Config]:
    """(url, cfg): for `run.dir` on object storage the URL and the config with `run.dir` its
    local staging directory (`jaxllm.checkpoint.mirror`); (None, cfg) for a local run.dir.
    ConfigError for a malformed URL and for what a staged run cannot do."""
    storage.check_url(cfg.run.dir, "run.dir")
    if cfg.checkpoint.dir:
        storage.check_url(cfg.checkpoint.dir, "checkpoint.dir")
    if not storage.is_url(cfg.run.dir):
        if cfg.checkpoint.dir and storage.is_url(cfg.checkpoint.dir):
            raise ConfigError(
                f"checkpoint.dir={cfg.checkpoint.dir}: checkpoints go to object storage with "
                "the run: set run.dir to the URL and leave checkpoint.dir unset."
            )
        return None, cfg
    url = cfg.run.dir.rstrip("/")
    mirror.check_run_config(cfg, url)
    if jax.process_count() > 1:
        raise ConfigError(
            f"run.dir={url} with {jax.process_count()} processes: a run on object storage "
            "trains in one machine's staging directory; train multi-process runs on a shared "
            "file system."
        )
    local = mirror.staging_dir(url)
    return url, dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(local)))


def pull_remote(url: str, run_dir: Path, lock: RunLock, signals) -> mirror.Remote:
    """Locks the staging directory and the bucket's run, then makes the staging directory the
    bucket's run (`Remote.pull`); on any failure both locks are let go again."""
    remote = mirror.Remote(url, run_dir)
    signals.on_startup_exit(lambda: let_go(remote, lock))
    try:
        with signals.writing:
            lock.acquire()
            remote.lock()
        remote.pull()
    except BaseException:
        let_go(remote, lock)
        raise
    return remote


def let_go(remote: mirror.Remote | None, lock: RunLock | None) -> None:
    """Uploads what was finalized and queued, then releases the bucket's lock and the local
    one (each a no-op when not held). Never raises: it runs on the way out of a failure."""
    if remote is not None:
        with contextlib.suppress(Exception):
            remote.close()
        remote.unlock()
    if lock is not None:
        lock.release()


def move_aside(
    run_dir: Path, ckpt_dir: Path, local_dir: str | None = None
) -> list[tuple[Path, Path]]:
    """Moves the run in `run_dir` (every entry but the lock files) into a new sibling
    `<run_dir>.old` (`.old2`, ...), and `ckpt_dir` (and the fast tier `local_dir`) when it lies
    outside `run_dir` and holds something to its own `.old` sibling; returns the (old place, new place) pairs, [] when
    there was nothing to move. Renames only: nothing is copied or deleted."""
    keep = {LOCK_NAME, HOLDER_NAME}
    moved = []
    entries = sorted(p for p in run_dir.iterdir() if p.name not in keep) if run_dir.is_dir() else []
    if entries:
        aside = checkpoint.aside_name(run_dir, "old")
        aside.mkdir()
        for p in entries:
            p.rename(aside / p.name)
            moved.append((p, aside / p.name))
    for other in (ckpt_dir, *([Path(local_dir)] if local_dir else [])):
        outside = other.resolve() != run_dir.resolve() and not other.resolve().is_relative_to(
            run_dir.resolve()
        )
        if outside and other.is_dir() and any(other.iterdir()):
            aside = checkpoint.aside_name(other, "old")
            other.rename(aside)
            moved.append((other, aside))
    return moved


def move_back(moved: list[tuple[Path, Path]]) -> None:
    """Undoes `move_aside` (a start-up that failed after it): what the failed start made in
    the old places is removed, the old entries renamed back, the emptied sibling removed."""
    for old, aside in reversed(moved):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
        aside.rename(old)
    for parent in {aside.parent for old, aside in moved if aside.parent != old.parent}:
        with contextlib.suppress(OSError):
            parent.rmdir()


class RunLock:
    """Held by the process that writes a run directory (process 0 of a multi-process run)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._lock = None

    @property
    def holder_path(self) -> Path:
        return self.run_dir / HOLDER_NAME

    def holder(self) -> dict | None:
        try:
            value = json.loads(self.holder_path.read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def acquire(self) -> None:
        """Takes the lock (creating the run directory) or raises RunError naming the holder."""
        from filelock import FileLock, Timeout

        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.run_dir / LOCK_NAME, timeout=0, thread_local=False)
        try:
            lock.acquire()
        except Timeout:
            h = self.holder() or {}
            raise RunError(
                f"{self.run_dir} is being written by another jaxllm train (pid "
                f"{h.get('pid', '?')} on {h.get('host', '?')}, since {h.get('since', '?')}); "
                "wait for it to finish or stop it."
            ) from None
        self._lock = lock
        stale = self.holder()
        if stale:
            warnings.warn(
                f"{self.run_dir} was locked by pid {stale.get('pid', '?')} on "
                f"{stale.get('host', '?')}, which is no longer running; taking the run over.",
                JaxllmWarning,
                stacklevel=2,
            )
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": since}
        self.holder_path.write_text(json.dumps(holder) + "\n")

    def release(self) -> None:
        """Removes the holder file and lets go of the lock (a no-op when not held)."""
        if self._lock is None:
            return
        self.holder_path.unlink(missing_ok=True)
        self._lock.release()  # the empty lock file stays: unlinking it would race a new holder
        self._lock = None
