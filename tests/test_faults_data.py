"""A battery of bad inputs and faults around the data writers and readers, driven through
`jaxllm.cli.main` (or, for a full disk, a `jaxllm` process under `ulimit -f`).

Every case builds its inputs in a scratch directory, runs one command and asserts: the exit code
(2 for what the user can fix, 1 for the machine, 0 where the input is repaired with a warning),
exactly one `jaxllm:` line naming the problem, no traceback, and a tree whose every file and
folder is unchanged: the whole scratch directory (sources and the place of the output) when the
command fails, the sources when it succeeds. So a failed or interrupted `data prepare` / `data
tokenizer` leaves nothing behind, not even its hidden temporary directory. (The run directory's
table is test_faults.py.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMALL_RUN, cpu_env
from test_faults import tree_hash

from jaxllm.cli import main
from jaxllm.config import SourceConfig
from jaxllm.data.prepare import prepare

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon naïve 日本 x".split()


@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]]  # scratch dir -> command line
    code: int
    says: str  # a fragment of the one `jaxllm:` line
    setup: Callable[[Path], None] | None = None
    ulimit_kb: int | None = None  # run as a process whose files may grow to this many KiB
    kept: str = ""  # the tree that must stay unchanged, under scratch ("": all of it)


def _corpus(t: Path, docs: int = 30) -> Path:
    src = t / "src" / "corpus"
    src.mkdir(parents=True)
    for i in range(docs):
        (src / f"doc{i:02d}.txt").write_text(" ".join(WORDS[(i + j) % 8] for j in range(5 + i)))
    return src


def _prepared_without_manifest(t: Path) -> None:
    """A `data prepare` directory whose manifest.json is missing (an older interrupted run)."""
    corpus = _corpus(t)
    prepare([SourceConfig(path=str(corpus))], t / "src" / "prep", shard_docs=8)
    shutil.rmtree(corpus)
    (t / "src" / "prep" / "manifest.json").unlink()


def _shard_renamed(t: Path) -> None:
    """The shards of a prepared directory copied away under other names, without manifest."""
    _prepared_without_manifest(t)
    for i, shard in enumerate(sorted((t / "src" / "prep").iterdir())):
        shard.rename(t / "src" / f"part{i}.arrayrecord")
    (t / "src" / "prep").rmdir()


def _big_text(t: Path) -> None:
    (t / "src").mkdir()
    (t / "src" / "big.txt").write_text(" ".join(WORDS[i % 8] for i in range(40_000)))


def _bad_line_later(t: Path) -> None:
    """600 good lines (so the first chunk is written to a shard), then a file with a bad one."""
    (t / "src").mkdir()
    good = "".join(json.dumps({"text": f"{WORDS[i % 8]} {i}"}) + "\n" for i in range(600))
    (t / "src" / "a.jsonl").write_text(good)
    (t / "src" / "b.jsonl").write_text('{"text": "fine"}\n{"text": \n')


def _occupied(name: str, text: str = "kept\n") -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        _corpus(t)
        (t / "out").mkdir()
        (t / "out" / name).write_text(text)

    return setup


def _latin1(fmt: str) -> Callable[[Path], None]:
    record = {
        "jsonl": {"text": "café au lait"},
        "chat": {
            "messages": [
                {"role": "user", "content": "¿qué?"},
                {"role": "assistant", "content": "sí, señor"},
            ]
        },
        "prompt_completion": {"prompt": "Grüße ", "completion": "aus Köln"},
    }[fmt]

    def setup(t: Path) -> None:
        (t / "src").mkdir()
        line = json.dumps(record, ensure_ascii=False) + "\n"
        (t / "src" / "latin.jsonl").write_bytes((line * 20).encode("latin-1"))

    return setup


def _lone_surrogate(t: Path) -> None:
    (t / "src").mkdir()
    lines = [r'{"text": "a\ud800b and more text"}'] + ['{"text": "plain text here"}'] * 30
    (t / "src" / "s.jsonl").write_text("\n".join(lines) + "\n")


def _utf16(t: Path) -> None:
    (t / "src").mkdir()
    (t / "src" / "w.txt").write_text("text saved by a Windows editor\n" * 20, encoding="utf-16")


def _json_array(t: Path) -> None:
    """A .json file as Alpaca ships it (one array of records, pretty-printed), cut short."""
    (t / "src").mkdir()
    records = [{"prompt": f"Add {i} and {i}.", "completion": str(2 * i)} for i in range(5)]
    (t / "src" / "alpaca.json").write_text(json.dumps(records, indent=2)[:-30])


def _two_records(t: Path) -> None:
    """One JSONL file of two records: too few for data.eval_fraction to hold one out."""
    (t / "src").mkdir()
    (t / "src" / "two.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')


def _train_on(path: str) -> Callable[[Path], list[str]]:
    return lambda t: [
        "train",
        *SMALL_RUN,
        "train.steps=2",
        f"run.dir={t / 'run'}",
        f"data.sources=[{{path: '{t / path}'}}]",
        f"data.eval_sources=[{{path: '{t / path}'}}]",
    ]


def _prepare(*args: str, out: str = "out") -> Callable[[Path], list[str]]:
    return lambda t: ["data", "prepare", *(str(t / a) for a in args), "--out", str(t / out)]


def _tokenizer(*args: str, out: str = "out", more: tuple = ()) -> Callable[[Path], list[str]]:
    return lambda t: [
        "data",
        "tokenizer",
        *(str(t / a) for a in args),
        "--vocab-size",
        "300",
        "--out",
        str(t / out),
        *more,
    ]


CASES = [
    Case("prepare-missing-source", _prepare("nope.jsonl"), 2, "SOURCE: ", None),
    # a file too small for its held-out split (records, not files, are held out from one file)
    Case(
        "one-file-too-few-records",
        lambda t: [
            "train",
            *SMALL_RUN,
            f"run.dir={t / 'run'}",
            f"data.sources=[{{path: '{t}/src/two.jsonl'}}]",
        ],
        2,
        "data.eval_fraction=0.05 leaves 2 train and 0 eval records of the 1 file(s) in data.sources[0]",
        _two_records,
    ),
    # prepared shards are never read as text, with or without their manifest (exit 2)
    Case(
        "prepared-without-manifest-train",
        _train_on("src/prep"),
        2,
        "no manifest.json",
        _prepared_without_manifest,
    ),
    Case(
        "prepared-without-manifest-glob",
        _train_on("src/prep/*.arrayrecord"),
        2,
        "no manifest.json",
        _prepared_without_manifest,
    ),
    Case(
        "prepared-without-manifest-prepare",
        _prepare("src/prep"),
        2,
        "no manifest.json",
        _prepared_without_manifest,
    ),
    Case(
        "prepared-shards-renamed",
        _tokenizer("src"),
        2,
        "holds NUL bytes",
        _shard_renamed,
    ),
    # writes are whole or nothing (exit 1 for the machine, 2 for a bad record met midway)
    Case(
        "prepare-disk-full",
        _prepare("src"),
        1,
        "File too large",
        _big_text,
        ulimit_kb=100,
    ),
    Case(
        "tokenizer-disk-full",
        _tokenizer("src"),
        1,
        "File too large",
        _big_text,
        ulimit_kb=4,
    ),
    Case(
        "prepare-bad-record-midway",
        lambda t: [*_prepare("src")(t), "--on-bad-record", "fail"],
        2,
        "b.jsonl line 2 is not valid JSON",
        _bad_line_later,
    ),
    # what an output directory already holds is kept unless --overwrite (exit 2)
    Case(
        "prepare-out-occupied",
        _prepare("src/corpus"),
        2,
        "pass --overwrite",
        _occupied("notes.txt"),
    ),
    Case(
        "tokenizer-out-occupied",
        _tokenizer("src/corpus"),
        2,
        "pass --overwrite",
        _occupied("notes.txt"),
    ),
    Case(
        "tokenizer-over-a-tokenizer",
        _tokenizer("src/corpus"),
        2,
        "pass --overwrite",
        _occupied("tokenizer.json", "{}"),
    ),
    Case(
        "stdlib-qa-out-occupied",
        lambda t: ["data", "stdlib-qa", str(t / "out"), "--max-modules", "2"],
        2,
        "pass --overwrite",
        _occupied("train.jsonl"),
    ),
    Case(
        "prepare-overwrite-its-source",
        lambda t: [*_prepare("src/corpus", out="src")(t), "--overwrite"],
        2,
        "would replace SOURCE",
        _corpus,
    ),
    # text that is not UTF-8: repaired and counted in JSON lines as in text files (exit 0)
    *(
        Case(
            f"latin1-{fmt}",
            lambda t, fmt=fmt: [*_prepare("src/latin.jsonl")(t), "--format", fmt],
            0,
            "undecodable byte sequence(s) with U+FFFD in 1 file(s) (first: ",
            _latin1(fmt),
            kept="src",
        )
        for fmt in ("jsonl", "chat", "prompt_completion")
    ),
    Case(
        "jsonl-lone-surrogate",
        _tokenizer("src/s.jsonl"),
        0,
        "1 JSON escape(s) of a lone surrogate (half a UTF-16 pair, not text) with U+FFFD (first: ",
        _lone_surrogate,
        kept="src",
    ),
    Case("utf16-text", _prepare("src"), 2, "w.txt is UTF-16", _utf16),
    # other formats taken for JSON lines, and a source left with nothing, say why (exit 2)
    Case(
        "json-array-file-cut-short",
        lambda t: [*_prepare("src/alpaca.json")(t), "--format", "prompt_completion"],
        2,
        "alpaca.json starts a JSON array but is not valid JSON",
        _json_array,
    ),
    Case(
        "prepare-every-record-bad",
        _prepare("src/a.jsonl"),
        2,
        "hold nothing to prepare (skipped 2 record(s) that are not JSON objects with a string "
        "field 'text' (first: ",
        lambda t: (t / "src").mkdir() or (t / "src" / "a.jsonl").write_text('{"txt": 1}\n[]\n'),
    ),
]


def _run_process(argv: list[str], ulimit_kb: int) -> tuple[int, str]:
    """`jaxllm argv` in a process whose files may not grow past `ulimit_kb` KiB."""
    script = f'ulimit -f {ulimit_kb}; exec "$@"'
    cmd = ["bash", "-c", script, "bash", sys.executable, "-m", "jaxllm", *argv]
    p = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, tmp_path, capsys):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case.setup:
        case.setup(scratch)
    kept = scratch / case.kept
    before = tree_hash(kept)
    if case.ulimit_kb:
        code, out = _run_process(case.argv(scratch), case.ulimit_kb)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # warnings print as lines; they do not fail here
            code = main(case.argv(scratch))
        out = "".join(capsys.readouterr())
    lines = [ln for ln in out.splitlines() if ln.startswith("jaxllm:")]
    assert code == case.code, out
    assert len(lines) == 1, out
    assert case.says in lines[0], lines[0]
    assert "Traceback" not in out
    assert tree_hash(kept) == before, f"the command changed {kept}"


def test_interrupted_prepare_leaves_nothing_and_a_killed_one_nothing_readable(
    tmp_path, capsys, monkeypatch
):
    """Ctrl-C after the first shard: exit 130 and no trace. A process killed outright leaves
    only its hidden sibling, which a source naming the parent skips and one naming it refuses."""
    from jaxllm.data import prepare as prepare_module

    _bad_line_later(tmp_path)
    before = tree_hash(tmp_path)
    write = prepare_module._ShardWriter.write

    def interrupted(self, docs):
        write(self, docs)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module._ShardWriter, "write", interrupted)
    assert main(["data", "prepare", str(tmp_path / "src"), "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == "jaxllm: interrupted"
    assert tree_hash(tmp_path) == before
    killed = tmp_path / "src" / ".out.partial-4242"  # as `written` names it, manifest not yet
    killed.mkdir()
    (tmp_path / "src" / "b.jsonl").rename(killed / "train-00000.arrayrecord")
    tokenizer = ["data", "tokenizer", str(tmp_path / "src"), "--vocab-size", "270"]
    assert main([*tokenizer, "--out", str(tmp_path / "tok")]) == 0  # reads a.jsonl alone
    assert main(["data", "prepare", str(killed), "--out", str(tmp_path / "again")]) == 2
    assert "has no manifest.json" in capsys.readouterr().err
