"""Object-storage faults, as test_faults.py runs its rows: each command runs in-process
(`fault_output`) against moto's S3 server (`tests/objectstore.py`) and must exit with its code
and exactly one `jaxllm:` line naming the problem, no traceback, the run directory and the
bucket unchanged and no new run directory. Malformed URLs and missing objects are the user's
(exit 2), a missing bucket, refused credentials and an unreachable endpoint the environment's
(exit 1); moto accepts any key, so refused credentials are a second moto server with
authentication on and no users, which refuses every key as S3 refuses a wrong one."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SMALL_RUN
from test_faults import assert_one_line, fault_output, tree_hash

NO_BUCKET = "s3://no-such-bucket-here"


@dataclasses.dataclass
class Case:
    id: str
    argv: Callable[[str, Path, Path], list[str]]  # (bucket URL, run dir, scratch) -> argv
    code: int
    says: str  # a fragment of the one message line
    env: str = "ok"  # ok | denied (credentials refused) | unreachable | no-package


def _train(*overrides: str) -> Callable[[str, Path, Path], list[str]]:
    return lambda b, r, t: [
        "train",
        *SMALL_RUN,
        "train.steps=1",
        f"run.dir={t / 'new'}",
        *(o.replace("BUCKET", b) for o in overrides),
    ]


def _data(path: str) -> str:
    return f"data.sources=[{{path: {path}, format: jsonl}}]"


CASES = [
    Case("url-http", _train(_data("http://host/d.jsonl")), 2, "http:// is not storage"),
    Case("url-gcs", _train("checkpoint.init_from=gcs://bkt/run"), 2, "gcs:// is not storage"),
    Case("url-one-slash", _train("checkpoint.init_from=s3:/bkt/run"), 2, "is not a URL"),
    Case("url-no-bucket", _train(_data("s3:///d.jsonl")), 2, "names no bucket"),
    Case(
        "url-bad-bucket",
        _train("data.eval_sources=[{path: s3://Bad_Bucket/x.jsonl}]"),
        2,
        "'Bad_Bucket' is not a valid bucket name",
    ),
    Case(
        "url-teacher",
        _train("train.objective=distill", "train.teacher=s3:/bkt/t"),
        2,
        "train.teacher=s3:/bkt/t is not a URL",
    ),
    Case(
        "data-missing-bucket",
        _train(_data(f"{NO_BUCKET}/d.jsonl")),
        1,
        f"{NO_BUCKET}/d.jsonl: the bucket does not exist.",
    ),
    Case(
        "data-missing-object",
        _train(_data("BUCKET/missing.jsonl")),
        2,
        "data.sources[0].path: s3://",
    ),
    Case(
        "init-from-missing-bucket",
        _train(f"checkpoint.init_from={NO_BUCKET}/run"),
        1,
        "the bucket does not exist",
    ),
    Case(
        "data-credentials-refused",
        _train(_data("BUCKET/data.jsonl")),
        1,
        "/data.jsonl: access denied (check the credentials).",
        env="denied",
    ),
    Case(
        "data-endpoint-unreachable",
        _train(_data("BUCKET/data.jsonl")),
        1,
        "cannot reach the endpoint http://127.0.0.1:1 (connection refused).",
        env="unreachable",
    ),
    Case(
        "storage-package-missing",
        _train(_data("BUCKET/data.jsonl")),
        2,
        "needs the package s3fs; install it with pip install 'jaxllm[storage]'.",
        env="no-package",
    ),
    Case(
        "import-missing-bucket",
        lambda b, r, t: ["convert", "import", f"{NO_BUCKET}/hf", str(t / "new")],
        1,
        "the bucket does not exist",
    ),
    Case(
        "import-missing-object",
        lambda b, r, t: ["convert", "import", f"{b}/no-hf", str(t / "new")],
        2,
        "HF_DIR: s3://",
    ),
    Case(
        "export-to-missing-bucket",
        lambda b, r, t: ["convert", "export", str(r), f"{NO_BUCKET}/hf"],
        1,
        "the bucket does not exist",
    ),
    Case(
        "export-over-a-finished-export",
        lambda b, r, t: ["convert", "export", str(r), f"{b}/done"],
        2,
        "already holds files; choose a new directory, or pass --overwrite",
    ),
    Case(
        "prepare-credentials-refused",
        lambda b, r, t: ["data", "prepare", str(t / "d.jsonl"), "--out", f"{b}/p"],
        1,
        "access denied (check the credentials)",
        env="denied",
    ),
    Case(
        "eval-missing-run",
        lambda b, r, t: ["eval", f"{b}/no-run"],
        2,
        "RUN_DIR: s3://",
    ),
    Case(
        "generate-endpoint-unreachable",
        lambda b, r, t: ["generate", f"{b}/run", "--prompt", "x"],
        1,
        "cannot reach the endpoint",
        env="unreachable",
    ),
]


@pytest.fixture(scope="module")
def filled(s3, tmp_path_factory):
    """A bucket holding data.jsonl and a finished export (`done/config.json`)."""
    bucket = s3.bucket()
    client = s3.client()
    text = "".join(json.dumps({"text": f"line {i} " * 10}) + "\n" for i in range(40))
    client.put_object(Bucket=bucket[5:], Key="data.jsonl", Body=text.encode())
    client.put_object(Bucket=bucket[5:], Key="done/model.safetensors", Body=b"x")
    client.put_object(Bucket=bucket[5:], Key="done/config.json", Body=b"{}")
    return bucket


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_storage_fault(case, s3_env, filled, small_run, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "d.jsonl").write_text(json.dumps({"text": "x " * 50}) + "\n")
    if case.env == "denied":
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.denying_env()["AWS_ENDPOINT_URL"])
    elif case.env == "unreachable":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    elif case.env == "no-package":
        monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError
    before, keys = tree_hash(run), s3_env.keys(filled)
    code, out, err = fault_output(case.argv(filled, run, scratch), capsys)
    assert_one_line(case, code, out, err)
    assert tree_hash(run) == before, "the command changed the run directory"
    assert not (scratch / "new").exists(), "the command left a new directory"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    assert s3_env.keys(filled) == keys, "the command changed the bucket"
