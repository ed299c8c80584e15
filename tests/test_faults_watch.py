"""Bad input of what a run watches: `train.early_stopping` and `checkpoint.keep_best` without
periodic evaluation or a held-out split, their values out of range, and `--checkpoint` naming
a best that was never recorded or is gone, a step that does not exist, or something else.

Like test_faults.py, every row runs one command on a copy of the shared small run (checkpoints
at steps 2 and 4, trained without evaluation) and asserts the exit code, exactly one
`jaxllm:` line naming the problem, no traceback and an unchanged run directory."""

from __future__ import annotations

import json
import shutil

import pytest
from test_faults import Case, assert_one_line, fault_output, tree_hash

from jaxllm import checkpoint


def _best_pruned(run, tmp) -> None:
    """Step 4 records step 1 as the best, which retention (without keep_best) deleted."""
    item = run / "checkpoints" / "4" / checkpoint.BEST_ITEM
    item.mkdir()
    (item / "metadata").write_text(json.dumps({"metric": "eval_loss", "step": 1}))


def _train(*overrides):
    return lambda r, t: ["train", str(r), "train.steps=6", *overrides]


CASES = [
    Case(
        "early-stopping-without-periodic-eval",
        _train("train.early_stopping.patience=2", "train.eval_every=0"),
        2,
        "train.early_stopping.patience needs periodic evaluation, but train.eval_every=0",
    ),
    Case(
        "keep-best-without-periodic-eval",
        _train("checkpoint.keep_best=true"),
        2,
        "checkpoint.keep_best needs periodic evaluation",
    ),
    Case(
        "early-stopping-without-held-out-split",
        _train("train.early_stopping.patience=2", "train.eval_every=2", "data.eval_fraction=0"),
        2,
        "needs a held-out split, but data.eval_sources is empty and data.eval_fraction=0",
    ),
    Case(
        "early-stopping-negative-patience",
        _train("train.early_stopping.patience=-1", "train.eval_every=2"),
        2,
        "train.early_stopping.patience must be >= 0",
    ),
    Case(
        "early-stopping-negative-min-delta",
        _train("train.early_stopping.patience=2", "train.early_stopping.min_delta=-0.1"),
        2,
        "train.early_stopping.min_delta must be >= 0",
    ),
    Case(
        "early-stopping-metric-not-an-eval-metric",
        _train("train.early_stopping.patience=2", "train.early_stopping.metric=loss"),
        2,
        "train.early_stopping.metric=loss is not an eval metric",
    ),
    Case(
        "early-stopping-unknown-mode",
        _train("train.early_stopping.mode=up"),
        2,
        "train.early_stopping.mode",
    ),
    Case(
        "checkpoint-best-never-recorded",
        lambda r, t: ["eval", str(r), "--checkpoint", "best"],
        2,
        "--checkpoint best: no checkpoint in",
    ),
    Case(
        "checkpoint-best-pruned",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--checkpoint", "best"],
        2,
        "the best step, 1, is no longer in",
        setup=_best_pruned,
    ),
    Case(
        "checkpoint-step-missing",
        lambda r, t: ["eval", str(r), "--checkpoint", "3"],
        2,
        "--checkpoint 3: no checkpoint of that step in",
    ),
    Case(
        "checkpoint-not-a-choice",
        lambda r, t: ["generate", str(r), "--prompt", "x", "--checkpoint", "newest"],
        2,
        "--checkpoint must be best, last or a step number, not 'newest'",
    ),
    Case(
        "checkpoint-and-a-step-directory",
        lambda r, t: [
            "convert",
            "export",
            str(r / "checkpoints" / "2"),
            str(t / "hf"),
            "--checkpoint",
            "4",
        ],
        2,
        "both name a checkpoint",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, small_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case.setup:
        case.setup(run, scratch)
    before = tree_hash(run), tree_hash(scratch)
    assert_one_line(case, *fault_output(case.argv(run, scratch), capsys))
    assert (tree_hash(run), tree_hash(scratch)) == before, "the command changed a directory"
