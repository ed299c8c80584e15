"""The fast checkpoint tier (`checkpoint.local_dir` / `local_every`): a run killed after a
local-only save resumes from it bit-identically; with the local tier gone it resumes from the
persistent one; bad tiers are refused in one line. Real subprocesses and real signals."""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_checkpoint import REPO, TINY, _losses, _params, _run, _start, _wait_for

from jaxllm import config
from jaxllm.checkpoint import steps


def _kill_after(args, marker, victim_dir):
    victim = _start([*args, f"run.dir={victim_dir}"])
    _wait_for(marker, victim)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert victim.returncode == -signal.SIGKILL


def _same_run(a, b):
    for x, y in zip(jax.tree.leaves(_params(a)), jax.tree.leaves(_params(b)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert _losses(a) == _losses(b)  # no duplicated or missing steps


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the killed ones must equal (no tiers: tiers change no numbers)."""
    run = tmp_path_factory.mktemp("straight")
    rc, out = _run([*TINY, "train.steps=10", "checkpoint.every=4", f"run.dir={run}"])
    assert rc == 0, out
    return run


def test_sigkill_after_a_local_only_save_resumes_from_it(tmp_path, straight):
    local = tmp_path / "fast"
    args = [*TINY, "train.steps=10", "checkpoint.every=4", "checkpoint.local_every=1"]
    args.append(f"checkpoint.local_dir={local}")
    _kill_after(args, local / "6" / "commit_success.txt", tmp_path / "killed")
    persistent = tmp_path / "killed" / "checkpoints"
    newest_local = max(steps(local))
    assert max(steps(persistent)) < newest_local  # the newest state was only in the fast tier
    rc, out = _run([str(tmp_path / "killed")])  # the run directory alone resumes it
    assert rc == 0, out
    assert f"resumed from step {newest_local}" in out, out
    assert "copied from checkpoint.local_dir" in out
    _same_run(straight, tmp_path / "killed")
    # the fast tier keeps only what is newer than the persistent one: nothing, after the end
    assert steps(local) == []
    assert 10 in steps(persistent)


def test_without_the_local_tier_the_run_resumes_from_the_persistent_one(tmp_path, straight):
    local = tmp_path / "fast"
    args = [*TINY, "train.steps=10", "checkpoint.every=4", "checkpoint.local_every=1"]
    args.append(f"checkpoint.local_dir={local}")
    _kill_after(args, local / "6" / "commit_success.txt", tmp_path / "killed")
    shutil.rmtree(local)  # the machine's local disk is lost with it
    rc, out = _run([str(tmp_path / "killed")])
    assert rc == 0, out
    assert "resumed from step 4 " in out, out
    assert "copied from" not in out
    _same_run(straight, tmp_path / "killed")


def test_local_saves_go_between_the_persistent_ones(tmp_path):
    local = tmp_path / "fast"
    cfg = config.load(
        None,
        [
            *TINY,
            "train.steps=6",
            "checkpoint.every=2",
            "checkpoint.local_every=1",
            f"checkpoint.local_dir={local}",
            "checkpoint.save_final=false",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    from jaxllm.train.loop import train

    train(cfg)
    assert steps(tmp_path / "run" / "checkpoints") == [2, 4]  # `every` only
    assert steps(local) == [5]  # 5 lives only here; 1 and 3 were dropped (older than 4)
    again = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=1))
    train(dataclasses.replace(again, checkpoint=dataclasses.replace(cfg.checkpoint, start_fresh=True)))  # fmt: skip
    assert steps(local.with_name("fast.old")) == [5]  # moved aside with the run, not resumed
    assert steps(tmp_path / "run.old" / "checkpoints") == [2, 4] and steps(local) == []


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["checkpoint.local_dir={run}", "checkpoint.local_every=2"], "is not a second place"),
        (
            ["checkpoint.local_dir={run}/checkpoints", "checkpoint.local_every=2"],
            "is not a second place",
        ),
        (["checkpoint.local_dir={run}.fast"], "go together"),
        (["checkpoint.local_every=3"], "go together"),
        (["checkpoint.local_dir={run}.fast", "checkpoint.local_every=0"], "must be >= 1"),
    ],
)
def test_bad_tiers_exit_2_with_one_line(tmp_path, extra, needle):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm", "train", f"run.dir={run}"]
        + [e.format(run=run) for e in extra],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxllm: "), proc.stderr
    assert needle in lines[0]
    assert not run.exists()  # refused before anything was written
