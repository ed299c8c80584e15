"""The fault table of `run.dir` on object storage, driven through `jaxllm.cli.main` against
moto's S3 server (the `s3` fixture), with test_faults' runner and one-line contract: exit 2 for
what the user can fix, 1 for the environment, one `jaxllm:` line naming the problem, no
traceback, and a bucket whose every object (key and ETag) is unchanged.

The refusals of a run directory hold in the bucket: a config of another model shape, a failed
command, and a second writer (the bucket's lock object) change nothing there."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from conftest import SMALL_RUN
from test_faults import Case, assert_one_line, fault_output

from jaxllm.checkpoint import bucket_lock, mirror
from jaxllm.cli import main

TINY = [*SMALL_RUN, "train.steps=4", "checkpoint.every=2"]


def _objects(s3, url: str) -> list[tuple[str, str]]:
    """(key, ETag) of every object under `url`."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted((o["Key"], o["ETag"]) for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="module")
def bucket_run(s3, tmp_path_factory):
    """A run of TINY trained into the bucket (checkpoints 2 and 4). Shared: nothing may change
    it, which every test here asserts."""
    url = s3.bucket() + "/run"
    saved = {k: os.environ.get(k) for k in [*s3.env, "JAXLLM_CACHE"]}
    os.environ.update(s3.env, JAXLLM_CACHE=str(tmp_path_factory.mktemp("cache")))
    try:
        assert main(["train", *TINY, f"run.dir={url}"]) == 0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return url


def _live_lock(s3, url: str, host: str = "elsewhere", age: float = 0.0) -> None:
    """A lock object of a writer on another machine, renewed `age` seconds ago."""
    body = {"pid": 4242, "host": host, "since": "2026-11-26T10:00:00+00:00"}
    body.update(renewed=time.time() - age, token="theirs")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3.client().put_object(
        Bucket=bucket, Key=f"{prefix}/{mirror.LOCK_OBJECT}", Body=json.dumps(body).encode()
    )


CASES = [
    Case(
        "another-shape",
        lambda u, t: ["train", *TINY, "model.num_layers=3", f"run.dir={u}"],
        2,
        "/checkpoints holds checkpoints of another model or tokenizer: model.num_layers (2 there, 3",
    ),
    Case("unknown-key", lambda u, t: ["train", *TINY, "train.stepz=3", f"run.dir={u}"], 2, "stepz"),
    Case(
        "second-writer",
        lambda u, t: ["train", *TINY, "train.steps=6", f"run.dir={u}"],
        1,
        "is being written by another jaxllm train (pid 4242 on elsewhere",
    ),
    Case(
        "start-fresh",
        lambda u, t: ["train", *TINY, "checkpoint.start_fresh=true", f"run.dir={u}"],
        2,
        "checkpoint.start_fresh=true with run.dir=s3://",
    ),
    Case(
        "checkpoint-dir-with-url",
        lambda u, t: ["train", *TINY, f"checkpoint.dir={t}/ck", f"run.dir={u}"],
        2,
        "leave checkpoint.dir unset",
    ),
    Case(
        "checkpoint-dir-url",
        lambda u, t: ["train", *TINY, f"checkpoint.dir={u}/ck", f"run.dir={t}/local"],
        2,
        "set run.dir to the URL",
    ),
    Case(
        "missing-bucket",
        lambda u, t: ["train", *TINY, "run.dir=s3://no-such-bucket-here/run"],
        1,
        "s3://no-such-bucket-here/run: the bucket does not exist.",
    ),
    Case(
        "unreachable-endpoint",
        lambda u, t: ["train", *TINY, f"run.dir={u}"],
        1,
        ": cannot reach the endpoint http://127.0.0.1:1",
    ),
    Case(
        "credentials-refused",
        lambda u, t: ["train", *TINY, f"run.dir={u}"],
        1,
        ": access denied",
    ),
    Case(
        "run-without-config",
        lambda u, t: ["train", u.rsplit("/", 1)[0] + "/no-run"],
        2,
        "/no-run/config.yaml does not exist",
    ),
    Case("malformed-url", lambda u, t: ["train", *TINY, "run.dir=s3:/bkt/run"], 2, "run.dir=s3:/"),
    Case(
        "other-scheme",
        lambda u, t: ["train", *TINY, "run.dir=gcs://bkt/run"],
        2,
        "gcs:// is not storage jaxllm reads",
    ),
    Case(
        "eval-missing-step",
        lambda u, t: ["eval", u, "--checkpoint", "7"],
        2,
        "7",
    ),
]

# what each case changes in the environment: (variables), or a lock object in the bucket
ENV = {
    "unreachable-endpoint": {"AWS_ENDPOINT_URL": "http://127.0.0.1:1", "AWS_MAX_ATTEMPTS": "1"},
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault(case: Case, bucket_run, s3_env, tmp_path, monkeypatch, capsys):
    for k, v in ENV.get(case.id, {}).items():
        monkeypatch.setenv(k, v)
    if case.id == "credentials-refused":
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.denying_env()["AWS_ENDPOINT_URL"])
    if case.id == "second-writer":
        _live_lock(s3_env, bucket_run)
    before = _objects(s3_env, bucket_run)
    try:
        code, out, err = fault_output(case.argv(bucket_run, tmp_path), capsys)
        after = _objects(s3_env, bucket_run)
    finally:
        if case.id == "second-writer":
            s3_env.client().delete_object(
                Bucket=bucket_run[5:].split("/")[0], Key=f"run/{mirror.LOCK_OBJECT}"
            )
    assert_one_line(case, code, out, err)
    assert after == before, "the command changed the bucket"


def test_the_refusal_names_the_url_not_the_staging_directory(bucket_run, s3_env, capsys):
    code, _, err = fault_output(
        ["train", *TINY, "model.d_model=32", f"run.dir={bucket_run}"], capsys
    )
    (line,) = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert code == 2 and f"{bucket_run}/checkpoints holds checkpoints" in line, err
    assert str(mirror.storage.cache_dir()) not in line


def test_nothing_to_do_and_a_stale_lock_taken_over(bucket_run, s3_env, capsys):
    """A lock not renewed for longer than bucket_lock.STALE_S (its holder on another machine died)
    is taken over with a warning; "nothing to do" then changes nothing but that lock."""
    before = _objects(s3_env, bucket_run)
    _live_lock(s3_env, bucket_run, age=bucket_lock.STALE_S + 60)
    code, _, err = fault_output(["train", *TINY, f"run.dir={bucket_run}"], capsys)
    assert code == 0, err
    assert "no longer running" in err and "nothing to do" in err, err
    assert _objects(s3_env, bucket_run) == before  # the stale lock gone, nothing else changed


def test_a_dead_writer_on_this_host_is_taken_over_at_once(bucket_run, s3_env, capsys):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    bucket, _, prefix = bucket_run.removeprefix("s3://").partition("/")
    body = {
        "pid": int(dead.stdout),
        "host": socket.gethostname(),
        "since": "x",
        "renewed": time.time(),
    }
    s3_env.client().put_object(
        Bucket=bucket, Key=f"{prefix}/{mirror.LOCK_OBJECT}", Body=json.dumps(body).encode()
    )
    code, _, err = fault_output(["train", *TINY, f"run.dir={bucket_run}"], capsys)
    assert code == 0 and "no longer running" in err, err
    assert not any(k.endswith(mirror.LOCK_OBJECT) for k, _ in _objects(s3_env, bucket_run))


def test_eval_reads_the_bucket_run(bucket_run, s3_env, capsys):
    for which, step in (("last", 4), ("2", 2)):
        code, out, err = fault_output(["eval", bucket_run, "--checkpoint", which], capsys)
        assert code == 0, err
        assert out.startswith(f"step {step}: eval loss"), out


def test_a_step_without_its_marker_in_the_bucket_is_never_a_checkpoint(bucket_run, s3_env, capsys):
    """What a killed upload leaves (a step's files, no `_CHECKPOINT_METADATA`) is not pulled
    and not resumed from: the run's newest checkpoint is still 4, so there is nothing to do."""
    bucket, _, prefix = bucket_run.removeprefix("s3://").partition("/")
    key = f"{prefix}/checkpoints/6/params/_METADATA"
    s3_env.client().put_object(Bucket=bucket, Key=key, Body=b"torn")
    try:
        code, _, err = fault_output(
            ["train", *TINY, "train.steps=6", "model.d_model=32", f"run.dir={bucket_run}"], capsys
        )
        staged = mirror.staging_dir(bucket_run) / "checkpoints"
        assert code == 2 and "model.d_model (64 there, 32 here)" in err, err
        assert sorted(p.name for p in staged.iterdir()) == ["2", "4"]
        code, _, err = fault_output(["train", *TINY, f"run.dir={bucket_run}"], capsys)
        assert code == 0 and "nothing to do" in err, err
    finally:
        s3_env.client().delete_object(Bucket=bucket, Key=key)


def test_an_interrupted_start_up_leaves_the_bucket_as_it_was(bucket_run, s3_env, tmp_path):
    """SIGINT once the run is synced down and restored, while the step compiles: exit 130, and
    the lock it took is gone again with everything else in the bucket unchanged."""
    import subprocess
    import sys

    from conftest import cpu_env

    before = _objects(s3_env, bucket_run)
    env = cpu_env(8, **s3_env.env, JAXLLM_CACHE=str(tmp_path / "cache"))
    argv = [sys.executable, "-m", "jaxllm", "train", *TINY, "train.steps=6"]
    proc = subprocess.Popen(
        [*argv, f"run.dir={bucket_run}"], env=env, stderr=subprocess.PIPE, text=True
    )
    said = []
    for line in proc.stderr:
        said.append(line)
        if line.startswith("resumed from step 4"):
            proc.send_signal(signal.SIGINT)
            break
    said += proc.stderr.readlines()
    assert proc.wait(timeout=120) == 130, "".join(said)
    assert _objects(s3_env, bucket_run) == before
