"""Output directories that a tool writes whole or not at all.

`jaxllm data prepare`, `data tokenizer`, `convert import / export` (and every later writer of a
directory) build their output in a hidden temporary sibling, `.<name>.partial-<pid>`, and rename
it into place only when it is complete. A write that fails or is interrupted removes its
sibling, and one killed outright leaves only that hidden sibling: never a directory that a later
command would take for valid output. An output directory that already holds something is
refused (ConfigError, exit 2) unless the writer was told to overwrite it; then the old
directory is replaced by the new one in one rename, after the new one is complete.

Here, at the bottom floor beside the errors, so that writers on every floor use one rule.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from jaxllm.config.errors import ConfigError, RunError

PARTIAL = ".partial-"  # in the temporary sibling's name: `.<name>.partial-<pid>`


def check_output(out: str | Path, *, flag: str, overwrite: bool = False) -> Path:
    """`out` as a Path when it may be written: absent, an empty directory, or (with
    `overwrite`) a directory with contents. ConfigError naming `flag` otherwise. Writes
    nothing, so a command can check its output before any long work."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file; give a directory to write into.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"{flag} {out} already holds files; choose a new directory, or pass --overwrite "
            "to replace it."
        )
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {out} cannot be made: {existing} is a file.")
    return out


@contextlib.contextmanager
def written(out: str | Path, *, flag: str, overwrite: bool = False) -> Iterator[Path]:
    """Yields a fresh temporary sibling of `out` to build the output in; when the block ends
    normally, renames it to `out` (replacing an existing `out` when `overwrite`). When the
    block raises (or is interrupted), the sibling is removed and `out` is left as it was. An
    OSError of the write (a full or read-only disk) becomes a RunError naming `out`."""
    out = check_output(out, flag=flag, overwrite=overwrite)
    tmp = out.with_name(f".{out.name}{PARTIAL}{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a killed writer that had this pid
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise RunError(f"cannot write {out} ({e.strerror or e}); nothing was written.") from e
    try:
        yield tmp
        _readable(tmp)
        _replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # named at its place in `out`: the temporary sibling is gone by the time this is read
        where = str(e.filename or tmp).replace(str(tmp), str(out), 1)
        raise RunError(
            f"writing {out} failed ({e.strerror or e}: {where}); nothing was "
            "written" + (" and the old one was kept." if out.exists() else ".")
        ) from e
    except BaseException:
        _remove(tmp)
        raise


def _readable(tmp: Path) -> None:
    """Gives the safetensors files under `tmp` the mode a new file gets from open() (0666 less
    the umask, as the output's other files have): safetensors 0.8 writes through a temporary
    file of mode 0600, which another user (a server, a container) could not read."""
    files = list(tmp.rglob("*.safetensors"))
    if files:
        probe = tmp / ".mode"
        probe.touch()
        mode = probe.stat().st_mode & 0o777
        probe.unlink()
        for f in files:
            f.chmod(mode)


def _remove(tmp: Path) -> None:
    """Removes `tmp`, and again while it reappears: a write interrupted inside a checkpoint save
    (SIGTERM, Ctrl-C) leaves the save's background threads creating files in it for a moment."""
    for _ in range(20):
        shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(0.05)
        if not tmp.exists():
            return


def _replace(tmp: Path, out: Path) -> None:
    """Puts the complete `tmp` at `out`: a rename; an existing `out` is first renamed aside
    and removed only after the new one is in place."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM in the `jaxllm` program (`interrupt_on_sigterm`): raised where the signal finds
    the main thread so that, as for Ctrl-C, an output being written is removed (`written`)
    rather than left half-made by the default, immediate exit. `train` and `serve` install
    their own handlers while they run."""


def interrupt_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` in this process (call it from the main thread)."""
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum, frame) -> None:
    if os.getpid() != _MAIN_PID:  # a forked worker (data loading) ends as it did before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Terminated


_MAIN_PID = os.getpid()
