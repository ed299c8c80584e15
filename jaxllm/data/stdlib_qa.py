"""stdlib-qa: an instruction set made from the running Python's standard library, no download.

`write_stdlib_qa(out_dir)` (`jaxllm data stdlib-qa OUT_DIR`) reads the public functions and
classes of the standard library's public modules, and the public methods of those classes, with
`ast` (nothing is imported), and writes `train.jsonl` and `test.jsonl` in the `chat` format, one
question and its short answer per line, the same questions as preference pairs in
`preference.jsonl` and `preference_test.jsonl` (`format: preference`: the question as a chat
prompt, the right answer chosen, a wrong one rejected), and `info.json` (counts by split and
kind, the Python version, the arguments):

    module  "Which module defines `json.decoder.JSONDecoder.decode`?"          -> "json.decoder"
    args    "What are the arguments of `heapq.merge(*iterables, key=None)`?"   -> "*iterables, key"

Each line also carries its `kind` and `subject` (`json.decoder.JSONDecoder.decode`). Arguments
are asked of functions and methods whose signature (annotations left out) has one to four
parameters and fits 60 characters; the answer names them in order, `*args` and `**kwargs`
spelled so, defaults and the `/` and `*` markers left out. Each question takes one of a few
phrasings, drawn by `seed`.

A rejected answer is a near miss, drawn by `seed`: the module cut one dotted part too short or
too long (`json` or `json.decoder.JSONDecoder` for `json.decoder`), the arguments with one left
out, two swapped, or (of a one-argument function) the function's own name. What a preference
loss then teaches is exactly the reading the questions test.

The split is by a hash of the top-level object (salted by `seed`): every question about a test
function, or a test class and its methods, is in test.jsonl, so test questions are about
objects the fine-tuned model never saw. A ~3M-parameter model cannot know the library, so each
question holds what its answer needs, and what is learned is reading it as the library is
written: where a dotted name's module ends (its class is CamelCase, its functions and methods
snake_case, packages nest: `xml.etree.ElementTree.Element.get` -> `xml.etree.ElementTree`), and
which words of a signature are parameter names. A base model that never saw the format scores
zero; a fine-tuned one scores by what it learned, which separates fine-tuning methods on a small
model in a few hundred CPU steps (`scripts/compare_finetuning.py`). `max_modules` (picked by a
salted hash of their names, among modules with at least four public objects) and
`MAX_PER_MODULE` keep the set small and its modules varied.

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
# codec tables: a hundred modules of one generated pattern
_SKIP |= {"encodings"}
_PHRASINGS = {
    "module": (
        "Which module defines `{subject}`?",
        "In which module is `{subject}` defined?",
        "`{subject}` is defined in which module?",
        "Name the module that defines `{subject}`.",
    ),
    "args": (
        "What are the arguments of `{subject}({signature})`?",
        "Which parameters does `{subject}({signature})` take?",
        "List the parameters of `{subject}({signature})`.",
    ),
}
KINDS = tuple(_PHRASINGS)
MIN_OBJECTS = 4  # public top-level objects a module needs to be asked about
MAX_PER_MODULE = 40  # questions' subjects per module at most (classes have many methods)
MAX_SIGNATURE = 60  # characters of an asked signature at most


@dataclasses.dataclass(frozen=True)
class Definition:
    """A public function, class or method of a standard-library module."""

    module: str
    qualname: str  # `name`, or `Class.method`
    signature: str | None  # the parameters as written, annotations left out; None for a class
    params: tuple[str, ...] | None  # their names, `*`/`**` spelled

    @property
    def subject(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def top(self) -> str:
        """The top-level object: what the split hashes (a class goes with its methods)."""
        return f"{self.module}.{self.qualname.split('.')[0]}"


def _module_name(path: Path, root: Path) -> str | None:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or p in _SKIP for p in parts):
        return None
    return ".".join(parts)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, tuple[str, ...]]:
    """(the signature without annotations, the parameter names)."""
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    bare = ast.arguments(
        posonlyargs=[ast.arg(x.arg) for x in a.posonlyargs],
        args=[ast.arg(x.arg) for x in a.args],
        vararg=a.vararg and ast.arg(a.vararg.arg),
        kwonlyargs=[ast.arg(x.arg) for x in a.kwonlyargs],
        kw_defaults=a.kw_defaults,
        kwarg=a.kwarg and ast.arg(a.kwarg.arg),
        defaults=a.defaults,
    )
    return ast.unparse(bare), tuple(names)


def _public(nodes, types) -> list:
    return [n for n in nodes if isinstance(n, types) and not n.name.startswith("_")]


def definitions(root: Path | None = None) -> list[Definition]:
    """The public top-level functions and classes, and the classes' public methods, of every
    public module under `root` (the standard library); files that do not parse are skipped."""
    root = root or stdlib_root()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
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
            seen = set()  # a name defined twice (by platform) counts once, as first written
            for node in _public(tree.body, (*functions, ast.ClassDef)):
                members = [(node.name, node)]
                if isinstance(node, ast.ClassDef):
                    members += [(f"{node.name}.{m.name}", m) for m in _public(node.body, functions)]
                for qualname, n in members:
                    if qualname in seen:
                        continue
                    seen.add(qualname)
                    sig, params = _params(n) if isinstance(n, functions) else (None, None)
                    out.append(Definition(module, qualname, sig, params))
    return sorted(out, key=lambda d: d.module)


def _hash(seed: int, text: str) -> float:
    """A number in [0, 1) fixed by `seed` and `text` (the same on every machine)."""
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def questions(defs: list[Definition], max_modules: int | None = 40, seed: int = 0) -> list[dict]:
    """The question records (`messages`, `kind`, `subject`, `top`) about `defs`: of
    `max_modules` modules with at least MIN_OBJECTS public top-level objects, at most
    MAX_PER_MODULE subjects each (by hash)."""
    tops = collections.Counter(d.module for d in defs if "." not in d.qualname)
    modules = sorted((m for m, n in tops.items() if n >= MIN_OBJECTS), key=lambda m: _hash(seed, m))
    chosen = set(modules[:max_modules] if max_modules else modules)
    by_module = collections.defaultdict(list)
    for d in defs:
        if d.module in chosen:
            by_module[d.module].append(d)
    rng = random.Random(seed)
    out = []
    for module in sorted(by_module):
        kept = sorted(by_module[module], key=lambda d: _hash(seed, d.subject))[:MAX_PER_MODULE]
        for d in sorted(kept, key=by_module[module].index):
            answers = {"module": d.module}
            if d.params and len(d.params) <= 4 and len(d.signature) <= MAX_SIGNATURE:
                answers["args"] = ", ".join(d.params)
            for kind, answer in answers.items():
                question = rng.choice(_PHRASINGS[kind]).format(
                    subject=d.subject, signature=d.signature
                )
                out.append(
                    {
                        "messages": [
                            {"role": "user", "content": question},
                            {"role": "assistant", "content": answer},
                        ],
                        "kind": kind,
                        "subject": d.subject,
                        "top": d.top,
                    }
                )
    return out


def wrong_answer(record: dict, rng: random.Random) -> str:
    """A near-miss answer to a question record (see the module docstring), never the right one."""
    right = record["messages"][1]["content"]
    if record["kind"] == "module":
        parts, m = record["subject"].split("."), right.count(".") + 1
        cuts = [n for n in (m - 1, m + 1) if 1 <= n <= len(parts)]  # m + 1: at most all
        return ".".join(parts[: rng.choice(cuts)])
    params = right.split(", ")
    if len(params) == 1:
        name = record["subject"].rsplit(".", 1)[-1]
        return name if name != right else f"{right}, self"
    i = rng.randrange(len(params))
    if rng.random() < 0.5:
        return ", ".join(params[:i] + params[i + 1 :])
    j = (i + 1) % len(params)
    params[i], params[j] = params[j], params[i]
    return ", ".join(params)


def preference_pairs(records: list[dict], seed: int = 0) -> list[dict]:
    """The question records as `format: preference` records: the question as a chat prompt,
    chosen the right answer, rejected a near miss (`wrong_answer`)."""
    rng = random.Random(seed)
    return [
        {
            "prompt": r["messages"][:1],
            "chosen": r["messages"][1]["content"],
            "rejected": wrong_answer(r, rng),
            "kind": r["kind"],
            "subject": r["subject"],
        }
        for r in records
    ]


def write_stdlib_qa(
    out_dir: str | Path,
    max_modules: int | None = 40,
    seed: int = 0,
    test_fraction: float = 0.2,
    root: Path | None = None,
) -> dict:
    """Writes OUT_DIR/train.jsonl, test.jsonl, preference.jsonl, preference_test.jsonl and
    info.json (see the module docstring); returns the info."""
    if max_modules is not None and max_modules < 1:
        raise ConfigError(f"--max-modules must be at least 1, not {max_modules}.")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"--test-fraction must be in (0, 1), not {test_fraction}.")
    records = questions(definitions(root), max_modules, seed)
    split = {"train": [], "test": []}
    for r in records:
        split["test" if _hash(seed, r["top"]) < test_fraction else "train"].append(r)
    if not split["train"] or not split["test"]:
        raise ConfigError(
            f"the standard library at {root or stdlib_root()} gave {len(records)} questions, "
            "too few for a train and a test split; raise --max-modules or --test-fraction."
        )
    random.Random(seed).shuffle(split["train"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {**split, "preference": preference_pairs(split["train"], seed)}
    files["preference_test"] = preference_pairs(split["test"], seed)
    for name, rows in files.items():
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    info = {
        "python": sys.version.split()[0],
        "max_modules": max_modules,
        "seed": seed,
        "test_fraction": test_fraction,
        "modules": len({r["messages"][1]["content"] for r in records if r["kind"] == "module"}),
        "questions": {
            name: dict(sorted(collections.Counter(r["kind"] for r in rows).items()))
            for name, rows in split.items()
        },
    }
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
