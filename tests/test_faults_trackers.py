"""Bad input of the experiment trackers (`run.trackers`, `run.wandb.*`, `run.mlflow.*`): an
unknown tracker, a tracker's package that is not installed, W&B without a project, a malformed
MLflow tracking URI, a tracker's keys without the tracker, metrics.jsonl left out.

Like test_faults.py, every row runs one command on a copy of the shared small run, or trains
a new run in the scratch directory, and asserts the exit code, exactly one `jaxllm:` line
naming the problem, no traceback and unchanged directories (no new run directory either)."""

from __future__ import annotations

import shutil
import sys

import pytest
from test_faults import Case, assert_one_line, fault_output, tree_hash

WANDB = ["run.trackers=[jsonl, wandb]", "run.wandb.project=jaxllm-tests"]
MLFLOW = ["run.trackers=[jsonl, mlflow]"]


def _train(*overrides):
    return lambda r, t: ["train", str(r), "train.steps=6", *overrides]


def _new_run(*overrides):
    return lambda r, t: ["train", *_train(*overrides)(r, t)[2:], f"run.dir={t / 'new'}"]


def _hide(module: str):
    """Makes `import module` fail as it does where the package is not installed."""

    def setup(run, tmp):
        saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == module}
        sys.modules[module] = None  # `import module` raises ImportError while this is set

        def cleanup():
            del sys.modules[module]
            sys.modules.update(saved)

        return cleanup

    return setup


CASES = [
    Case(
        "unknown-tracker",
        _train("run.trackers=[jsonl, comet]"),
        2,
        "run.trackers[1] must be one of jsonl, tensorboard, wandb, mlflow, not 'comet'",
    ),
    Case(
        "trackers-not-a-list",
        _train("run.trackers=wandb"),
        2,
        "run.trackers must be a list",
    ),
    Case(
        "tracker-twice",
        _train("run.trackers=[jsonl, tensorboard, jsonl]"),
        2,
        "run.trackers names jsonl twice",
    ),
    Case(
        "jsonl-left-out",
        _train("run.trackers=[tensorboard]"),
        2,
        "run.trackers must keep jsonl",
    ),
    Case(
        "wandb-without-project",
        _new_run("run.trackers=[jsonl, wandb]"),
        2,
        "run.trackers lists wandb but run.wandb.project is not set",
    ),
    Case(
        "wandb-project-without-wandb",
        _train("run.wandb.project=p"),
        2,
        "run.wandb.project does nothing without wandb in run.trackers",
    ),
    Case(
        "mlflow-experiment-without-mlflow",
        _train("run.mlflow.experiment=e"),
        2,
        "run.mlflow.experiment does nothing without mlflow in run.trackers",
    ),
    Case(
        "mlflow-uri-unknown-scheme",
        _new_run(*MLFLOW, "run.mlflow.tracking_uri=localhost:5000"),
        2,
        "MLflow knows no scheme 'localhost'",
    ),
    Case(
        "mlflow-uri-without-host",
        _train(*MLFLOW, "run.mlflow.tracking_uri=http:/127.0.0.1:5000"),
        2,
        "http:// needs a host",
    ),
    Case(
        "mlflow-uri-bad-port",
        _train(*MLFLOW, "run.mlflow.tracking_uri=http://127.0.0.1:99999"),
        2,
        "is not a tracking URI",
    ),
    Case(
        "mlflow-uri-empty",
        _train(*MLFLOW, "run.mlflow.tracking_uri=' '"),
        2,
        "is not a tracking URI",
    ),
    Case(
        "wandb-not-installed",
        _new_run(*WANDB),
        2,
        "run.trackers lists wandb, but wandb cannot be imported",
        _hide("wandb"),
    ),
    Case(
        "mlflow-not-installed",
        _train(*MLFLOW),
        2,
        "run.trackers lists mlflow, but mlflow cannot be imported",
        _hide("mlflow"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, small_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cleanup = case.setup(run, scratch) if case.setup else None
    before = tree_hash(run), tree_hash(scratch)
    try:
        code, out, err = fault_output(case.argv(run, scratch), capsys)
    finally:
        if cleanup:
            cleanup()
    assert_one_line(case, code, out, err)
    assert (tree_hash(run), tree_hash(scratch)) == before, "the command changed a directory"
