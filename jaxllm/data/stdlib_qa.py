"""stdlib-qa: an instruction set made from the running Python's standard library, no download.

`write_stdlib_qa(out_dir)` (`jaxllm data stdlib-qa OUT_DIR`) reads the public top-level
functions and classes of the standard library's public modules with `ast` (nothing is imported)
and writes `train.jsonl` and `test.jsonl` in the `chat` format, one question and its short answer
per line, and `info.json` (counts by split and kind, the Python version, the arguments):

    module  "Which module defines `heappushpop`?"                    -> "heapq"
    args    "What are the arguments of `heapq.heappushpop`?"         -> "heap, item"
    kind    "Is `heapq.heappushpop` a class or a function?"          -> "function"

Each line also carries its `kind` and `subject` (`heapq.heappushpop`). Only names defined in
one module of the whole library are asked about (else "which module" has several answers), and
arguments only of functions with one to four (`*args` and `**kwargs` spelled so). Each question
takes one of a few phrasings, drawn by `seed`.

The split is by a hash of the subject (salted by `seed`): every question about a test subject
is in test.jsonl, so test questions are about objects the fine-tuned model never saw. Nothing
in a question names its answer; what can be learned is the library's conventions: the naming of
a module's objects (`heappush`, `heappop` -> `heapq`; `*Error` classes -> their module),
argument names shared within a module (`operator`'s `a, b`), CamelCase classes and snake_case
functions. A small model that learned the answer format and some of those conventions scores
above zero, and a base model that never saw the format scores zero: the signal
`scripts/compare_finetuning.py` measures. `max_modules` keeps the modules (picked by a salted
hash of their names, among those with at least four such objects) few enough for a ~3M
parameter model to learn their names in a few hundred steps.

This module does not import jax.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import json
import os
import random
import sys
from pathlib import Path

from jaxllm.config import ConfigError
from jaxllm.data.sources import stdlib_root

# packages of tests, demos and tools, not the library's API
_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages"}
_PHRASINGS = {
    "module": (
        "Which module defines `{name}`?",
        "In which module is `{name}` defined?",
        "`{name}` is defined in which standard-library module?",
        "Name the module that defines `{name}`.",
    ),
    "args": (
        "What are the arguments of `{subject}`?",
        "Which parameters does `{subject}` take?",
        "List the parameters of `{subject}`.",
    ),
    "kind": (
        "Is `{subject}` a class or a function?",
        "Is `{subject}` a function or a class?",
        "What kind of object is `{subject}`: class or function?",
    ),
}
KINDS = tuple(_PHRASINGS)
MIN_OBJECTS = 4  # a module with fewer public objects has no conventions to learn


@dataclasses.dataclass(frozen=True)
class Definition:
    """A public top-level function or class of a standard-library module."""

    module: str
    name: str
    is_class: bool
    params: tuple[str, ...] | None  # a function's, `*`/`**` spelled; None for a class

    @property
    def subject(self) -> str:
        return f"{self.module}.{self.name}"


def _module_name(path: Path, root: Path) -> str | None:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or p in _SKIP for p in parts):
        return None
    return ".".join(parts)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return tuple(names)


def definitions(root: Path | None = None) -> list[Definition]:
    """The public top-level functions and classes of every public module under `root` (the
    standard library), sorted by module and position; files that do not parse are skipped."""
    root = root or stdlib_root()
    out = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP and d != "__pycache__")
        for file in sorted(n for n in names if n.endswith(".py")):
            path = Path(parent, file)
            module = _module_name(path, root)
            if module is None:
                continue
            try:
                tree = ast.parse(path.read_bytes())
            except (SyntaxError, ValueError):  # a few test inputs are broken on purpose
                continue
            for node in tree.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if node.name.startswith("_"):
                    continue
                is_class = isinstance(node, ast.ClassDef)
                params = None if is_class else _params(node)
                out.append(Definition(module, node.name, is_class, params))
    return sorted(out, key=lambda d: d.module)


def _hash(seed: int, text: str) -> float:
    """A number in [0, 1) fixed by `seed` and `text` (the same on every machine)."""
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def questions(defs: list[Definition], max_modules: int | None = 40, seed: int = 0) -> list[dict]:
    """The question records (`messages`, `kind`, `subject`, `split`) about `defs`: names defined
    once in all of `defs`, in `max_modules` modules with at least MIN_OBJECTS of them."""
    counts = collections.Counter(d.name for d in defs)
    unique = [d for d in defs if counts[d.name] == 1]
    per_module = collections.Counter(d.module for d in unique)
    modules = sorted(
        (m for m, n in per_module.items() if n >= MIN_OBJECTS), key=lambda m: _hash(seed, m)
    )
    chosen = set(modules[:max_modules] if max_modules else modules)
    rng = random.Random(seed)
    out = []
    for d in unique:
        if d.module not in chosen:
            continue
        answers = {"module": d.module, "kind": "class" if d.is_class else "function"}
        if d.params is not None and 1 <= len(d.params) <= 4:
            answers["args"] = ", ".join(d.params)
        for kind in KINDS:
            if kind not in answers:
                continue
            question = rng.choice(_PHRASINGS[kind]).format(name=d.name, subject=d.subject)
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answers[kind]},
                    ],
                    "kind": kind,
                    "subject": d.subject,
                }
            )
    return out


def write_stdlib_qa(
    out_dir: str | Path,
    max_modules: int | None = 40,
    seed: int = 0,
    test_fraction: float = 0.2,
    root: Path | None = None,
) -> dict:
    """Writes OUT_DIR/train.jsonl, test.jsonl and info.json (see the module docstring);
    returns the info."""
    if max_modules is not None and max_modules < 1:
        raise ConfigError(f"--max-modules must be at least 1, not {max_modules}.")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"--test-fraction must be in (0, 1), not {test_fraction}.")
    records = questions(definitions(root), max_modules, seed)
    split = {"train": [], "test": []}
    for r in records:
        split["test" if _hash(seed, r["subject"]) < test_fraction else "train"].append(r)
    if not split["train"] or not split["test"]:
        raise ConfigError(
            f"the standard library at {root or stdlib_root()} gave {len(records)} questions, "
            "too few for a train and a test split; raise --max-modules or --test-fraction."
        )
    random.Random(seed).shuffle(split["train"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in split.items():
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    info = {
        "python": sys.version.split()[0],
        "max_modules": max_modules,
        "seed": seed,
        "test_fraction": test_fraction,
        "modules": len({r["subject"].rsplit(".", 1)[0] for r in records}),
        "questions": {
            name: dict(sorted(collections.Counter(r["kind"] for r in rows).items()))
            for name, rows in split.items()
        },
    }
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
