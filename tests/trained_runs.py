"""Runs shared by the whole test session: each made once, by whichever process (an xdist worker)
asks for it first while a file lock keeps the others waiting, under one directory the session's
controller makes (`SHARED_RUNS`, set in conftest's `pytest_configure`) and removes at its end.

A shared run is read-only: a test that changes one (resumes it, edits a checkpoint, overwrites
it) copies it first (`shutil.copytree` into its tmp_path). The controller checks at the end of
the session that no file of a shared run changed, and fails the session if one did."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from filelock import FileLock

SHARED_RUNS = "JAXLLM_TEST_SHARED_RUNS"
OUT = "{out}"  # in `made_by`'s arguments: the directory being made


def base_dir() -> Path:
    root = os.environ.get(SHARED_RUNS)
    assert root, f"{SHARED_RUNS} is unset: conftest's pytest_configure sets it for the session"
    return Path(root)


def _files(root: Path) -> dict[str, list[int]]:
    """{relative path: [size, mtime in ns]} of every file under `root`."""
    return {
        str(p.relative_to(root)): [p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def shared(name: str, recipe: Sequence[str], make: Callable[[Path], object]) -> Path:
    """The directory `make(path)` writes, made once per session under `name` by `recipe` (one
    name, one recipe: asking for a name with another recipe fails). Read it, never change it."""
    root = base_dir()
    out, done = root / name, root / f"{name}.done"
    recipe = [str(a) for a in recipe]
    with FileLock(str(root / f"{name}.lock")):
        if done.exists():
            made = json.loads(done.read_text())["recipe"]
            assert made == recipe, f"shared run {name!r} is {made}, not {recipe}"
            return out
        shutil.rmtree(out, ignore_errors=True)  # a process that failed half way
        make(out)
        done.write_text(json.dumps({"recipe": recipe, "files": _files(out)}))
    return out


def made_by(name: str, *argv: str | Path) -> Path:
    """The directory `jaxllm <argv>` writes, `{out}` in `argv` standing for it, made once per
    session (see `shared`)."""
    from jaxllm.cli import main

    def make(out: Path) -> None:
        assert main([str(a).replace(OUT, str(out)) for a in argv]) == 0, argv

    return shared(name, ["jaxllm", *argv], make)


def trained_run(name: str, overrides: Sequence[str]) -> Path:
    """The run `jaxllm train <overrides>` trains, made once per session (see `made_by`)."""
    return made_by(name, "train", *overrides, f"run.dir={OUT}")


def shared_quantized(name: str, run: Path, *opts: str) -> tuple[Path, Path]:
    """(`jaxllm quantize <run> <opts>`'s run, its `convert export`), made once per session as
    `name` and `name`-hf (see `made_by`)."""
    q = made_by(name, "quantize", run, OUT, *opts)
    return q, made_by(f"{name}-hf", "convert", "export", q, OUT)


class OnFirstUse(dict):
    """{name: value} whose missing values are made by `make(name)` when first asked for: a
    module's runs that only some of its tests use (the others may run with -m slow) are made
    only where a test uses them."""

    def __init__(self, make: Callable[[str], object], **made):
        super().__init__(**made)
        self._make = make

    def __missing__(self, name: str):
        self[name] = value = self._make(name)
        return value


def changed() -> list[str]:
    """The shared runs whose files are not those they were made with."""
    root = Path(os.environ.get(SHARED_RUNS, "/nonexistent"))
    return [
        done.name.removesuffix(".done")
        for done in sorted(root.glob("*.done"))
        if _files(root / done.name.removesuffix(".done")) != json.loads(done.read_text())["files"]
    ]
