"""`run.dir` on object storage: a run trains into `s3://BUCKET/run` (moto's S3 server, the `s3`
fixture), is stopped or killed, and resumes bit-identically from the bucket, also on a clean
cache ("another machine"); the run-safety refusals hold there and leave the bucket unchanged.
Real subprocesses and real signals, as in test_checkpoint.py."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL_RUN, cpu_env
from flax import nnx

import jaxllm
from jaxllm.checkpoint import mirror
from jaxllm.cli import main

REPO = Path(__file__).resolve().parent.parent
# A constant learning rate: the updates do not depend on train.steps, so a run stopped at any
# step and resumed to step T is compared with a straight run of T steps.
ARGS = [
    *SMALL_RUN,
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "train.eval_every=0",
    "run.trackers=[jsonl]",
]


def _env(s3, cache: Path) -> dict:
    """A subprocess on the 8 simulated devices of this process's in-process runs (one mesh, one
    compilation cache and the same XLA flags: its runs are compared bit for bit with them)."""
    return cpu_env(8, as_this_process=True, **s3.env, JAXLLM_CACHE=str(cache))


def _start(args, env):
    return subprocess.Popen(
        [sys.executable, "-m", "jaxllm", "train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(args, env):
    p = _start(args, env)
    out = p.communicate(timeout=600)[0]
    return p.returncode, out


def _params(run_dir):
    return jax.device_get(nnx.to_pure_dict(nnx.state(jaxllm.load_model(run_dir), nnx.Param)))


def _losses(run_dir) -> dict:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _steps(s3, url: str) -> list[int]:
    """The checkpoints in the bucket: steps whose commit marker is there."""
    run_key = url.split("/", 3)[3]
    return sorted(
        int(k.split("/")[-2])
        for k in s3.keys(url)
        if k.startswith(f"{run_key}/checkpoints/") and k.endswith("/_CHECKPOINT_METADATA")
    )


def _straight(tmp_path: Path, steps: int, monkeypatch) -> Path:
    """The uninterrupted local run of `steps` steps (in this process)."""
    run = tmp_path / "straight"
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "unused-cache"))
    assert main(["train", *ARGS, f"train.steps={steps}", f"run.dir={run}"]) == 0
    return run


def _same_run(a: Path, b: Path) -> None:
    for x, y in zip(jax.tree.leaves(_params(a)), jax.tree.leaves(_params(b)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert _losses(a) == _losses(b)  # every step once, with the same loss


@pytest.mark.slow
def test_sigterm_then_resume_on_another_machine_is_bit_identical(s3, tmp_path, monkeypatch):
    """Train into the bucket, stop on SIGTERM, delete the local staging
    directory, resume from the bucket: the parameters and every step's loss equal a straight
    run's."""
    url = s3.bucket() + "/run"
    cache = tmp_path / "cache"
    staging = mirror.staging_dir(url).relative_to(mirror.storage.cache_dir())
    proc = _start([*ARGS, "train.steps=400", f"run.dir={url}"], _env(s3, cache))
    metrics = cache / staging / "metrics.jsonl"
    t0 = time.monotonic()
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    (stopped,) = _steps(s3, url)
    keys = s3.keys(url)
    assert not any(k.endswith(mirror.LOCK_OBJECT) for k in keys)  # released
    assert {"run/loss.png", "run/metrics.jsonl", "run/config.yaml"} <= set(keys)

    shutil.rmtree(cache)  # another machine: nothing local, the bucket alone
    rc, out = _run([url, f"train.steps={stopped + 2}"], _env(s3, cache))  # its config.yaml
    assert rc == 0 and f"resumed from step {stopped}" in out, out
    assert _steps(s3, url)[-1] == stopped + 2

    straight = _straight(tmp_path, stopped + 2, monkeypatch)
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "reader-cache"))
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    _same_run(straight, Path(_copy(url)))


def _copy(url: str) -> str:
    """The bucket's run as a reader sees it (`jaxllm.load.fetched`: storage.fetch)."""
    from jaxllm import storage

    return str(storage.fetch(url, "path"))


@pytest.mark.slow
def test_sigkill_then_resume_from_the_bucket_is_bit_identical(s3, tmp_path, monkeypatch):
    """A second writer is refused while the run trains; then kill -9 once a checkpoint is in
    the bucket: what the killed run left (a lock, maybe a
    step uploaded without its marker, local steps the bucket lacks) does not count; the same
    machine takes its own dead lock over and resumes from the bucket's newest checkpoint."""
    url = s3.bucket() + "/run"
    cache = tmp_path / "cache"
    env = _env(s3, cache)
    proc = _start([*ARGS, "train.steps=400", "checkpoint.every=2", f"run.dir={url}"], env)
    t0 = time.monotonic()
    while not _steps(s3, url) or _steps(s3, url)[-1] < 6:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)
    # A second writer on "another machine" (its own cache, so no local lock stops it) is
    # refused by the bucket's lock object, which names the first one.
    rc, second = _run([*ARGS, "train.steps=400", f"run.dir={url}"], _env(s3, tmp_path / "other"))
    assert rc == 1, second
    assert f"is being written by another jaxllm train (pid {proc.pid} on" in second, second
    assert proc.poll() is None  # the first one trains on
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert any(k.endswith(mirror.LOCK_OBJECT) for k in s3.keys(url))  # left by the dead run
    last = _steps(s3, url)[-1]
    target = last + 3
    rc, out = _run([*ARGS, f"train.steps={target}", "checkpoint.every=2", f"run.dir={url}"], env)
    assert rc == 0, out
    assert "no longer running" in out and f"resumed from step {last}" in out, out
    straight = _straight(tmp_path, target, monkeypatch)
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("JAXLLM_CACHE", str(tmp_path / "reader-cache"))
    _same_run(straight, Path(_copy(url)))


def test_retention_deletes_in_the_bucket_too(s3_env, tmp_path):
    url = s3_env.bucket() + "/run"
    argv = ["train", *SMALL_RUN, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=1"]
    assert main([*argv, f"run.dir={url}"]) == 0
    assert _steps(s3_env, url) == [6]
    run_key = url.split("/", 3)[3]
    assert not [k for k in s3_env.keys(url) if k.startswith(f"{run_key}/checkpoints/2/")]


def test_a_failed_upload_stops_the_run_and_the_bucket_keeps_its_checkpoint(
    s3_env, monkeypatch, capsys
):
    """An upload that fails (here the one of step 4) ends the run with one line, exit 1, and
    nothing more goes up: the bucket's newest checkpoint is still the complete step 2."""
    url = s3_env.bucket() + "/run"
    push = mirror.Remote._push_step

    def failing(self, step, files):
        if step == 4:
            raise OSError("the connection was reset")
        return push(self, step, files)

    monkeypatch.setattr(mirror.Remote, "_push_step", failing)
    argv = ["train", *ARGS, "train.steps=8", "checkpoint.every=2", f"run.dir={url}"]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert code == 1 and len(lines) == 1, err
    assert f"uploading to {url}: the connection was reset" in lines[0]
    assert _steps(s3_env, url) == [2]
    assert not [k for k in s3_env.keys(url) if "/checkpoints/4/" in k or "/checkpoints/6/" in k]
    assert not any(k.endswith(mirror.LOCK_OBJECT) for k in s3_env.keys(url))  # let go
