"""A battery of bad inputs and faults around a run directory, driven through `jaxllm.cli.main`.

Every case starts from a copy of one small trained run, breaks something (an override, a file,
a lock, a permission), runs one command in-process and asserts: the exit code (2 for what the
user can fix, 1 for the environment), exactly one `jaxllm:` message line naming the problem,
no traceback, and a run directory whose every file and folder is unchanged. Start-up errors
need no compile, so the whole table runs in seconds. (Hugging Face directories have their own
table in test_faults_hf.py.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMALL_RUN

from jaxllm.cli import main

TINY = SMALL_RUN


def tree_hash(root: Path) -> str:
    """A digest of every path (folders too) and file content under `root`."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[Path, Path], list[str]]  # (run dir, scratch dir) -> command line
    code: int
    says: str  # a fragment of the one message line
    setup: Callable[[Path, Path], Callable[[], None] | None] | None = None  # may return a cleanup


def _file(tmp: Path) -> Path:
    f = tmp / "a_file"
    f.write_text("not a directory\n")
    return f


def _yaml(tmp: Path, text: str) -> str:
    f = tmp / "config.yaml"
    f.write_text(text)
    return str(f)


def _edit_config(run: Path, tmp: Path) -> None:
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("d_model: 64", "d_model: 96"))


def _bpe(tmp: Path) -> str:
    from jaxllm.data import train_bpe

    return str(train_bpe(["def f(x):\n    return x + 1\n"] * 40, 300, tmp / "bpe"))


def _hold_lock(run: Path, tmp: Path):
    from filelock import FileLock

    lock = FileLock(run / ".jaxllm.lock", timeout=0, thread_local=False)
    lock.acquire()
    holder = {"pid": 4242, "host": "trainer-7", "since": "2026-11-23T08:00:00+00:00"}
    (run / ".jaxllm.lock.json").write_text(json.dumps(holder))
    return lock.release


def _read_only(run: Path, tmp: Path):
    """Read-only for this user: chmod for others, the immutable flag for root (root writes
    through mode bits, not through +i)."""
    if os.geteuid() != 0:
        run.chmod(0o555)
        return lambda: run.chmod(0o755)
    subprocess.run(["chattr", "+i", str(run)], check=True)
    return lambda: subprocess.run(["chattr", "-i", str(run)], check=True)


def _no_checkpoints(run: Path, tmp: Path) -> None:
    shutil.rmtree(run / "checkpoints")


def _unrecorded_config(run: Path, tmp: Path) -> None:
    """Checkpoints whose recorded config this version cannot read (as after an upgrade)."""
    for step in (run / "checkpoints").iterdir():
        (step / "config" / "metadata").write_text('{"model": {"size": "?"}}')


def _damage_all(run: Path, tmp: Path) -> None:
    for step in (run / "checkpoints").iterdir():
        for f in (step / "params").rglob("*"):
            if f.is_file():
                f.unlink()


CASES = [
    # config: keys, types and values that make no sense (exit 2)
    Case(
        "unknown-key",
        lambda r, t: ["train", str(r), "train.stepz=3"],
        2,
        "unknown config key train.stepz",
    ),
    Case(
        "wrong-type",
        lambda r, t: ["train", str(r), "train.steps=many"],
        2,
        "train.steps must be an integer",
    ),
    Case("run-dir-empty", lambda r, t: ["train", str(r), "run.dir=''"], 2, "run.dir is empty"),
    Case(
        "lr-nan",
        lambda r, t: ["train", str(r), "optim.lr=.nan"],
        2,
        "optim.lr must be a finite number",
    ),
    Case(
        "lr-inf",
        lambda r, t: ["train", str(r), "optim.lr=.inf"],
        2,
        "optim.lr must be a finite number",
    ),
    Case(
        "lr-negative",
        lambda r, t: ["train", str(r), "optim.lr=-0.001"],
        2,
        "optim.lr must be a finite number >= 0",
    ),
    Case(
        "checkpoint-every-0",
        lambda r, t: ["train", str(r), "checkpoint.every=0"],
        2,
        "checkpoint.every=null",
    ),
    Case(
        "checkpoint-every-negative",
        lambda r, t: ["train", str(r), "checkpoint.every=-2"],
        2,
        "checkpoint.every must be >= 1",
    ),
    Case(
        "checkpoint-keep-0",
        lambda r, t: ["train", str(r), "checkpoint.keep=0"],
        2,
        "checkpoint.keep",
    ),
    Case(
        "workers-negative",
        lambda r, t: ["train", str(r), "data.workers=-1"],
        2,
        "data.workers must be >= 0",
    ),
    Case(
        "adam-b2-above-1",
        lambda r, t: ["train", str(r), "optim.b2=1.5"],
        2,
        "optim.b2 must be in [0, 1)",
    ),
    Case("mesh-empty", lambda r, t: ["train", str(r), "mesh="], 2, "`mesh` is a section"),
    Case(
        "section-as-list",
        lambda r, t: ["train", _yaml(t, "train:\n  - steps: 3\n"), f"run.dir={r}", "train.steps=3"],
        2,
        "section `train:` must be a mapping",
    ),
    Case("yaml-invalid", lambda r, t: ["train", _yaml(t, "train: [\n")], 2, "is not valid YAML"),
    Case("config-file-missing", lambda r, t: ["train", str(t / "nope.yaml")], 2, "does not exist"),
    Case("preset-unknown", lambda r, t: ["train", str(r), "model=llama9000"], 2, "names no preset"),
    Case("mesh-product", lambda r, t: ["train", str(r), "mesh.fsdp=3"], 2, "multiply to"),
    Case(
        "batch-vs-mesh",
        lambda r, t: ["train", str(r), "train.global_batch_size=12"],
        2,
        "not divisible by the data-parallel size",
    ),
    Case(
        "seq-len-above-max",
        lambda r, t: ["train", str(r), "data.seq_len=100000"],
        2,
        "exceeds model.max_seq_len",
    ),
    # data (exit 2)
    Case(
        "source-missing",
        lambda r, t: ["train", str(r), "data.sources=[{path: /nonexistent}]"],
        2,
        "/nonexistent does not exist",
    ),
    Case(
        "source-empty-dir",
        lambda r, t: ["train", str(r), f"data.sources=[{{path: {t}}}]"],
        2,
        "holds no files",
    ),
    Case(
        "jsonl-bad-line",
        lambda r, t: [
            "train",
            str(r),
            f"data.sources=[{{path: {t / 'bad.jsonl'}}}]",
            "data.on_bad_record=fail",
        ],
        2,
        "line 2 is not valid JSON",
        setup=lambda r, t: (t / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n') and None,
    ),
    Case(
        "tokenizer-missing",
        lambda r, t: ["train", str(r), "data.tokenizer=/nonexistent/tokenizer.json"],
        2,
        "data.tokenizer",
    ),
    # an existing run is never trained over by an incompatible config (exit 2)
    Case(
        "resume-other-shape",
        lambda r, t: ["train", str(r), "model.num_layers=3"],
        2,
        "model.num_layers (2 there, 3 here)",
    ),
    Case(
        "resume-hand-edited",
        lambda r, t: ["train", str(r)],
        2,
        "model.d_model (64 there, 96 here)",
        setup=_edit_config,
    ),
    Case(
        "resume-other-tokenizer",
        lambda r, t: ["train", str(r), f"data.tokenizer={_bpe(t)}"],
        2,
        "data.tokenizer ('byte' there",
    ),
    Case(
        "resume-other-optimizer",
        lambda r, t: ["train", str(r), "optim.name=sgd"],
        2,
        "optim.name ('adamw' there, 'sgd' here)",
    ),
    Case(
        "resume-lion",
        lambda r, t: ["train", str(r), "optim.name=lion", "train.steps=6"],
        2,
        "checkpoint.reset_optimizer=true",
    ),
    Case(
        "resume-amsgrad",
        lambda r, t: ["train", str(r), "optim.amsgrad=true"],
        2,
        "optim.amsgrad (False there, True here)",
    ),
    Case(
        "resume-other-optimizer-unrecorded",
        lambda r, t: ["train", str(r), "optim.name=sgd", "train.steps=6"],
        2,
        "holds a training state of another structure",
        setup=_unrecorded_config,
    ),
    Case(
        "resume-every-checkpoint-unreadable",
        lambda r, t: ["train", str(r), "train.steps=6"],
        1,
        "no checkpoint in",
        setup=_damage_all,
    ),
    Case(
        "resume-false-over-checkpoints",
        lambda r, t: ["train", str(r), "checkpoint.resume=false"],
        2,
        "would overwrite",
    ),
    # the environment (exit 1)
    Case(
        "run-dir-is-file",
        lambda r, t: ["train", str(r), f"run.dir={_file(t)}"],
        1,
        "is a file, not a directory",
    ),
    Case(
        "checkpoint-dir-is-file",
        lambda r, t: ["train", str(r), f"checkpoint.dir={_file(t)}"],
        1,
        "checkpoint.dir=",
    ),
    Case(
        "run-dir-under-file",
        lambda r, t: ["train", str(r), f"run.dir={_file(t)}/sub"],
        1,
        "cannot be made",
    ),
    Case(
        "run-dir-locked",
        lambda r, t: ["train", str(r), "train.steps=8"],
        1,
        "pid 4242 on trainer-7",
        setup=_hold_lock,
    ),
    Case(
        "run-dir-read-only",
        lambda r, t: ["train", str(r), "train.steps=8"],
        1,
        "is not writable",
        setup=_read_only,
    ),
    # eval, generate, bench (exit 2)
    Case(
        "eval-batches-0",
        lambda r, t: ["eval", str(r), "--batches", "0"],
        2,
        "--batches must be at least 1",
    ),
    Case("eval-not-a-run", lambda r, t: ["eval", str(t)], 2, "is not a run directory"),
    Case(
        "eval-no-checkpoint",
        lambda r, t: ["eval", str(r)],
        2,
        "no checkpoint in",
        setup=_no_checkpoints,
    ),
    Case("eval-all-damaged", lambda r, t: ["eval", str(r)], 2, "cannot be read", setup=_damage_all),
    Case(
        "generate-step-missing",
        lambda r, t: ["generate", str(r / "checkpoints" / "77"), "--prompt", "x"],
        2,
        "cannot be read",
    ),
    Case(
        "generate-prompts-file-missing",
        lambda r, t: ["generate", str(r), "--prompts-file", str(t / "p.txt")],
        2,
        "does not exist",
    ),
    Case(
        "generate-top-p",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--top-p", "2"],
        2,
        "generate.top_p",
    ),
    Case(
        "bench-steps-0",
        lambda r, t: ["bench", "train", *TINY, "--steps", "0"],
        2,
        "--steps must be >= 1",
    ),
]


def fault_output(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `jaxllm ARGV` run in-process, its warnings printed as
    `jaxllm: warning:` lines (they do not fail here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(case, code: int, out: str, err: str) -> None:
    """The contract of a fault: `case.code`, exactly one `jaxllm:` message line (warnings aside)
    holding `case.says`, and no traceback."""
    messages = [
        ln for ln in err.splitlines() if ln.startswith("jaxllm:") and "warning:" not in ln[:16]
    ]
    assert code == case.code, err
    assert len(messages) == 1, err
    assert case.says in messages[0], messages[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, small_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cleanup = case.setup(run, scratch) if case.setup else None
    before = tree_hash(run)
    try:
        code, out, err = fault_output(case.argv(run, scratch), capsys)
    finally:
        if cleanup:
            cleanup()
    assert_one_line(case, code, out, err)
    assert tree_hash(run) == before, "the command changed the run directory"
