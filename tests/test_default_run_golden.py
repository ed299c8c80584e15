"""The default run's first steps, pinned: `jaxllm train` with no config computes these losses.

`tests/golden/default_run_steps.json` holds the train loss and grad norm of steps 1-20 of the
default run (`make train`: default config, one CPU device, XLA's default flags), read from
metrics.jsonl of `jaxllm train train.log_every=1` (log_every only chooses which rows are
written; the steps are the same) stopped by SIGTERM once the rows are there. train.steps stays
at its default: steps 1-15 are the lr warmup, whose length depends on train.steps when it is
short.

A change that moves these losses must update the golden file in the same commit and say why in
its `changes` list (regenerate with `python tests/test_default_run_golden.py`).

Tolerance: on one machine the run is bit for bit repeatable, but XLA's CPU reductions are split
by the number of cores the process may use, so the last bits move with the core count (1 core
against 2: 3.4213643 against 3.4213433 at step 10; other machines logged 3.4212699 and
3.4212148; docs/benchmarks.md). The tolerance, 2e-5 times the step number (6e-5 at step 3, 2e-4
at step 10), covers that spread; real changes move these losses by far more (optim.warmup_steps
16 instead of 15 moves step 3 by 1.6e-2 and step 10 by 2.3e-2). Where this machine is the
file's (core count, CPU model and flags, jaxlib), losses and grad norms must match exactly:
only that catches a change in the last bits, as a5ec4f4's, whose first trace in this run is
step 17's grad norm. The default run trains on the running Python's standard library, so each
Python version the suite runs under has its own golden file (`golden/default_run_steps*.json`,
its `python` naming the version); under a version without one these tests fail and say how to
record it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOLDENS = Path(__file__).resolve().parent / "golden"


def golden_file(python: str | None = None) -> Path:
    """The golden file of this Python version (the default run's corpus is its standard
    library): `default_run_steps.json`, or `default_run_steps-py<version>.json` beside it."""
    python = python or platform.python_version()
    for path in sorted(GOLDENS.glob("default_run_steps*.json")):
        if json.loads(path.read_text())["python"] == python:
            return path
    return GOLDENS / f"default_run_steps-py{python}.json"


GOLDEN = golden_file()
TOLERANCE_PER_STEP = 2e-5


def machine() -> dict:
    """What the last bits of the losses depend on: the cores XLA may use, the CPU, jaxlib."""
    import jaxlib

    info = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = " ".join(sorted(info.get("flags", "").split()))
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu": info.get("model name", ""),
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "arch": platform.machine(),
        "jaxlib": jaxlib.__version__,
    }


def default_run_losses(run_dir: Path, steps: int, env: dict) -> dict[int, tuple[float, float]]:
    """(train loss, grad norm) of the default run's steps 1..`steps`, from a `jaxllm train`
    process stopped by SIGTERM once metrics.jsonl holds them."""
    cmd = [sys.executable, "-m", "jaxllm", "train", "train.log_every=1", f"run.dir={run_dir}"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    metrics, rows = run_dir / "metrics.jsonl", {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists():
                for line in metrics.read_text().splitlines():
                    row = json.loads(line) if line.endswith("}") else {}
                    if "loss" in row and "step" in row:
                        rows[row["step"]] = (row["loss"], row["grad_norm"])
                if all(s in rows for s in range(1, steps + 1)):
                    break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # finishes the step in flight, checkpoints, exits 0
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    missing = [s for s in range(1, steps + 1) if s not in rows]
    assert not missing, f"no loss logged for steps {missing}: {err[-2000:]}"
    return {s: rows[s] for s in range(1, steps + 1)}


def check(rows: dict[int, tuple[float, float]]) -> None:
    """Exact (loss and grad norm) on the golden file's machine, else the loss within tolerance."""
    golden = json.loads(GOLDEN.read_text())
    exact = golden["machine"] == machine()
    report = []
    for step, (loss, grad_norm) in rows.items():
        want, want_norm = golden["loss"][str(step)], golden["grad_norm"][str(step)]
        tol = 0.0 if exact else TOLERANCE_PER_STEP * step
        if abs(loss - want) > tol:
            report.append(f"step {step}: loss {loss!r}, golden {want!r} (tolerance {tol:g})")
        if exact and grad_norm != want_norm:
            report.append(f"step {step}: grad norm {grad_norm!r}, golden {want_norm!r}")
    assert not report, (
        "the default run's first steps moved"
        + (" (golden measured on this machine: bit for bit)" if exact else "")
        + ":\n  "
        + "\n  ".join(report)
        + f"\nIf deliberate, update {GOLDEN.relative_to(REPO)} in the same commit and say why."
    )


def _env() -> dict:
    from conftest import cpu_env

    return cpu_env(1, optimize=True)  # the default run's: one device, XLA's default flags


def _require_this_pythons_golden():
    assert GOLDEN.exists(), (
        f"no golden default run for Python {platform.python_version()} (its standard library is "
        f"the default run's corpus): record {GOLDEN.relative_to(REPO)} with "
        "`python tests/test_default_run_golden.py`"
    )


def test_check_is_exact_on_the_golden_machine_and_within_tolerance_elsewhere(monkeypatch):
    _require_this_pythons_golden()
    golden = json.loads(GOLDEN.read_text())
    rows = {int(s): (v, golden["grad_norm"][s]) for s, v in golden["loss"].items()}
    nudged = {s: (v + TOLERANCE_PER_STEP * s / 2, g) for s, (v, g) in rows.items()}
    moved = {**rows, 3: (rows[3][0] + TOLERANCE_PER_STEP * 3 * 2, rows[3][1])}
    other_grad = {**rows, 17: (rows[17][0], rows[17][1] * (1 + 1e-6))}
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "machine", lambda: golden["machine"])
    check(rows)
    for changed in (nudged, other_grad):
        with pytest.raises(AssertionError, match="bit for bit"):
            check(changed)
    monkeypatch.setattr(module, "machine", lambda: {**golden["machine"], "cores": 1})
    check(nudged)
    check(other_grad)
    with pytest.raises(AssertionError, match="step 3: loss"):
        check(moved)


def test_default_run_first_3_steps_match_golden(tmp_path):
    _require_this_pythons_golden()
    check(default_run_losses(tmp_path / "run", 3, _env()))


@pytest.mark.slow
def test_default_run_first_20_steps_match_golden(tmp_path):
    _require_this_pythons_golden()
    check(default_run_losses(tmp_path / "run", 20, _env()))


if __name__ == "__main__":
    # Regenerate the golden file on this machine: python tests/test_default_run_golden.py
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    git = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        rows = default_run_losses(Path(tmp) / "run", 20, env)
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    golden = {
        "command": "jaxllm train train.log_every=1, stopped after step 20",
        "measured": f"{time.strftime('%Y-%m-%d')}, commit {commit}",
        "python": platform.python_version(),
        "machine": machine(),
        "loss": {str(s): v for s, (v, _) in rows.items()},
        "grad_norm": {str(s): g for s, (_, g) in rows.items()},
        "changes": old.get("changes", []),
    }
    GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
    print(json.dumps(golden, indent=1))
