"""Bad command-line input, config files and environment, driven through `jaxllm.cli.main`.

Like test_faults.py, every row runs one command and asserts the exit code (2 for what the user
can fix, 1 for the environment), exactly one `jaxllm:` line naming the problem, no traceback,
and an unchanged tree: a run directory (its config.yaml only: every row fails before anything is
read from a checkpoint) and the scratch directory beside it. The rows: integer and float options
out of their range; YAML files with a key given twice, binary, empty or not a mapping; the
multi-process flags and variables (checked before `jax.distributed` is called, which takes a
bad value with a traceback and an unreachable or busy coordinator with an abort); and
JAX_PLATFORMS naming a platform this machine cannot start. Rows marked `process` (JAX reads
JAX_PLATFORMS once, when it starts its backends) or with a `script` (a shorter wait for the
coordinator, a port already taken) run in a process of their own; the other rows' variables,
which jaxllm reads itself, are set in this one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMALL_RUN, cpu_env
from test_faults import tree_hash

from jaxllm import config
from jaxllm.cli import main

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[Path, Path], list[str]]  # (run dir, scratch dir) -> command line
    code: int
    says: str  # a fragment of the one `jaxllm:` line
    setup: Callable[[Path, Path], None] | None = None
    env: dict[str, str] | None = None  # environment variables (in-process unless `process`)
    process: bool = False  # run `python -m jaxllm` (or `script`) in a process of its own
    script: str = ""  # Python run in that process instead (it calls `jaxllm.cli.main`)
    skip: str = ""  # why the row cannot run here


def _yaml(t: Path, text: str | bytes, name: str = "c.yaml") -> str:
    f = t / name
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(f)


def _duplicate_in_run(run: Path, t: Path) -> None:
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(
        text.replace("  d_model: 64\n", "  d_model: 64\n  d_model: 96\n")
    )


def _corpus(run: Path, t: Path) -> None:
    (t / "src").mkdir()
    for i in range(3):
        (t / "src" / f"{i}.txt").write_text(f"text number {i}\n" * 20)


def _train(run: Path, *flags: str) -> list[str]:
    return ["train", str(run), "train.steps=0", *flags]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a coordinator nobody serves, waited for 2 s instead of JAX's 300
UNSERVED = (
    "import jaxllm.distributed as d; d.CONNECT_TIMEOUT_S = 2\n"
    "import sys; from jaxllm.cli import main; sys.exit(main(sys.argv[1:]))"
)
# a coordinator port already taken (by a socket the same process holds)
BUSY = (
    "import socket, sys; from jaxllm.cli import main\n"
    "port = int(sys.argv[sys.argv.index('--coordinator') + 1].rsplit(':', 1)[1])\n"
    "server = socket.create_server(('', port))\n"
    "sys.exit(main(sys.argv[1:]))"
)


CASES = [
    # integer and float options: argparse checks only the type (exit 2)
    Case("plan-devices-0", lambda r, t: ["plan", str(r), "--devices", "0"], 2, "--devices must"),
    Case("plan-devices-negative", lambda r, t: ["plan", str(r), "--devices", "-8"], 2, "not -8"),
    Case(
        "generate-max-new-tokens-0",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--max-new-tokens", "0"],
        2,
        "--max-new-tokens must be at least 1, not 0",
    ),
    Case(
        "generate-top-k-negative",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--top-k", "-1"],
        2,
        "--top-k must be at least 0 (0: off), not -1",
    ),
    Case(
        "generate-kv-page-size-negative",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--kv-page-size", "-16"],
        2,
        "--kv-page-size must be at least 0",
    ),
    Case(
        "generate-temperature-nan",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--temperature", "nan"],
        2,
        "--temperature must be a finite number >= 0",
    ),
    Case(
        "bench-data-batches-0",
        lambda r, t: ["bench", "data", str(r), "--batches", "0"],
        2,
        "--batches must be at least 1",
    ),
    Case(
        "bench-data-seconds-0",
        lambda r, t: ["bench", "data", str(r), "--seconds", "0"],
        2,
        "--seconds must be a finite number > 0",
    ),
    Case(
        "prepare-workers-negative",
        lambda r, t: ["data", "prepare", str(t / "src"), "--out", str(t / "o"), "--workers", "-2"],
        2,
        "--workers must be at least 0 (0: in this process), not -2",
        setup=_corpus,
    ),
    Case(
        "tokenizer-max-files-0",
        lambda r, t: [
            *("data", "tokenizer", str(t / "src"), "--vocab-size", "300"),
            *("--out", str(t / "tok"), "--max-files", "0"),
        ],
        2,
        "--max-files must be at least 1",
        setup=_corpus,
    ),
    Case(
        "tokenizer-empty-corpus",
        lambda r, t: [
            *("data", "tokenizer", str(t / "empty.txt"), "--vocab-size", "300"),
            *("--out", str(t / "tok")),
        ],
        2,
        "empty.txt hold no text to train a tokenizer on; nothing was written",
        setup=lambda r, t: (t / "empty.txt").write_text("") and None,
    ),
    Case(
        "sweep-grid-no-values",
        lambda r, t: ["sweep", str(r), "--grid", "train.steps=,", "--out", str(t / "sweep")],
        2,
        "--grid 'train.steps=,' gives no values",
    ),
    # YAML files: keys given twice, text that is not YAML or not a mapping (exit 2)
    Case(
        "yaml-key-twice",
        lambda r, t: ["train", _yaml(t, "train:\n  steps: 5\n  steps: 7\n")],
        2,
        "c.yaml: train.steps is given twice (lines 2 and 3)",
    ),
    Case(
        "yaml-section-twice",
        lambda r, t: ["train", _yaml(t, "train:\n  steps: 5\nmodel: tiny\ntrain:\n  seed: 1\n")],
        2,
        "c.yaml: train is given twice (lines 1 and 4)",
    ),
    Case(
        "yaml-key-twice-in-include",
        lambda r, t: ["plan", _yaml(t, "include: base.yaml\n")],
        2,
        "base.yaml: optim.lr is given twice (lines 2 and 4)",
        setup=lambda r, t: (
            _yaml(t, "optim:\n  lr: 1.0e-3\n  b1: 0.9\n  lr: 3.0e-4\n", "base.yaml") and None
        ),
    ),
    Case(
        "run-config-key-twice",
        lambda r, t: ["train", str(r), "train.steps=9"],
        2,
        "config.yaml: model.d_model is given twice",
        setup=_duplicate_in_run,
    ),
    Case(
        "override-key-twice",
        lambda r, t: ["train", str(r), "data.sources=[{path: a, path: b}]"],
        2,
        "data.sources[0].path is given twice",
    ),
    Case(
        "yaml-binary",
        lambda r, t: ["train", _yaml(t, bytes(range(256)) * 4, "some.bin")],
        2,
        "some.bin is not a text YAML file",
    ),
    Case("yaml-empty", lambda r, t: ["train", _yaml(t, "")], 2, "c.yaml is empty"),
    Case("yaml-comments-only", lambda r, t: ["plan", _yaml(t, "# x\n")], 2, "c.yaml is empty"),
    Case(
        "yaml-scalar",
        lambda r, t: ["train", _yaml(t, "3\n")],
        2,
        "must hold a mapping of sections (train:, model:, ...), not the number 3",
    ),
    Case(
        "yaml-list",
        lambda r, t: ["bench", "train", _yaml(t, "- train\n")],
        2,
        "must hold a mapping of sections (train:, model:, ...), not a list",
    ),
    Case("config-plain-dir", lambda r, t: ["train", str(t)], 2, "is a directory without"),
    # multi-process flags and variables, checked before the config (train.steps=0 is a mistake
    # too) and before jax.distributed (exit 2)
    Case(
        "num-processes-0",
        lambda r, t: _train(r, "--num-processes", "0", "--process-id", "0", "--coordinator", "h:1"),
        2,
        "--num-processes must be at least 1, not 0",
    ),
    Case(
        "process-id-out-of-range",
        lambda r, t: _train(r, "--num-processes", "2", "--process-id", "2", "--coordinator", "h:1"),
        2,
        "--process-id must be in 0..1 (--num-processes 2), not 2",
    ),
    Case(
        "process-id-alone",
        lambda r, t: _train(r, "--process-id", "1"),
        2,
        "--process-id goes with --num-processes",
    ),
    Case(
        "coordinator-without-port",
        lambda r, t: _train(r, "--coordinator", "localhost", "--num-processes", "2"),
        2,
        "--coordinator must be HOST:PORT with a port in 1..65535, not 'localhost'",
    ),
    Case(
        "coordinator-port-too-big",
        lambda r, t: _train(r, "--coordinator", "h:70000", "--num-processes=2", "--process-id=1"),
        2,
        "not 'h:70000'",
    ),
    Case(
        "env-num-processes-text",
        lambda r, t: _train(r),
        2,
        "JAX_NUM_PROCESSES must be an integer, not 'two'",
        env={"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "two"},
    ),
    Case(
        "env-process-id-out-of-range",
        lambda r, t: _train(r),
        2,
        "JAX_PROCESS_ID must be in 0..1 (JAX_NUM_PROCESSES 2), not 5",
        env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"},
    ),
    # the environment (exit 1)
    Case(
        "coordinator-unreachable",
        lambda r, t: [
            *("train", str(r), "--num-processes", "2", "--process-id", "1"),
            *("--coordinator", f"127.0.0.1:{_free_port()}"),
        ],
        1,
        "no coordinator answered at 127.0.0.1:",
        script=UNSERVED,
    ),
    Case(
        "coordinator-port-busy",
        lambda r, t: [
            *("train", str(r), "--num-processes", "2", "--process-id", "0"),
            *("--coordinator", f"localhost:{_free_port()}"),
        ],
        1,
        "cannot serve as the coordinator",
        script=BUSY,
    ),
    Case(
        "platform-nonsense",
        lambda r, t: ["train", str(r), "train.steps=3"],
        1,
        "JAX_PLATFORMS=nonsense: JAX cannot start platform 'nonsense'",
        env={"JAX_PLATFORMS": "nonsense"},
        process=True,
    ),
    Case(
        "platform-tpu-absent",
        lambda r, t: ["plan", str(r)],
        1,
        "unset JAX_PLATFORMS to use what this machine has, or set JAX_PLATFORMS=cpu",
        env={"JAX_PLATFORMS": "tpu"},
        process=True,
        skip="" if importlib.util.find_spec("libtpu") is None else "libtpu is installed",
    ),
]


def _run(case: Case, argv: list[str]) -> tuple[int, str]:
    """`argv` in a `python -m jaxllm` process (or one running `case.script`)."""
    how = ("-c", case.script) if case.script else ("-m", "jaxllm")
    env = cpu_env(**(case.env or {}))
    try:
        p = subprocess.run(
            [sys.executable, *how, *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        return -1, f"timed out: {e.stderr}"
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, tmp_path, capsys, monkeypatch):
    if case.skip:
        pytest.skip(case.skip)
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    run.mkdir()
    scratch.mkdir()
    config.dump(config.load(None, [*SMALL_RUN, f"run.dir={run}"]), run / "config.yaml")
    if case.setup:
        case.setup(run, scratch)
    argv = case.argv(run, scratch)
    before = tree_hash(tmp_path)
    if case.process or case.script:
        code, out = _run(case, argv)
    else:
        for name, value in (case.env or {}).items():
            monkeypatch.setenv(name, value)
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # warnings print as lines; they do not fail here
            code = main(argv)
        out = "".join(capsys.readouterr())
    lines = [ln for ln in out.splitlines() if ln.startswith("jaxllm:") and "warning:" not in ln]
    assert code == case.code, out
    assert len(lines) == 1, out
    assert case.says in lines[0], lines[0]
    assert "Traceback" not in out
    assert tree_hash(tmp_path) == before, "the command changed the run or scratch directory"
