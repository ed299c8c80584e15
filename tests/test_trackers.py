"""The experiment trackers (`run.trackers`) on tiny runs, read back through the trackers' own
formats: W&B in offline mode (the run's .wandb file, records of wandb's own protobuf), MLflow
through `MlflowClient` against a tracking server started here on 127.0.0.1.

Each checks: the resolved config as the run's parameters (`optim.lr`), every metrics.jsonl row
at its step under the same names, loss.png and summary.json as artifacts, and a resumed run
going on in the same tracker run (RUN/trackers.json). A tracking server that goes away mid-run
costs one warning; the run ends normally with a complete metrics.jsonl."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
from conftest import SMALL_RUN

from jaxllm import trackers
from jaxllm.cli import main
from jaxllm.metrics import read_jsonl


def _train(run: Path, steps: int, *overrides: str) -> None:
    assert main(["train", *SMALL_RUN, f"train.steps={steps}", f"run.dir={run}", *overrides]) == 0


def _expected(run: Path) -> dict[int, dict[str, float]]:
    """{step: the numbers of metrics.jsonl at that step}."""
    out: dict[int, dict[str, float]] = {}
    for row in read_jsonl(run / "metrics.jsonl"):
        out.setdefault(row["step"], {}).update(trackers.numbers(row))
    return out


# -- W&B ---------------------------------------------------------------------------------------


def wandb_records(path: Path):
    """The records of an offline .wandb file: a 7-byte header (`:W&B`, magic, version), then
    LevelDB-log chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB
    blocks, each record one `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def test_wandb_offline_logs_config_metrics_artifacts_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # nothing in ~
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    run = tmp_path / "run"
    flags = ["run.trackers=[jsonl, wandb]", "run.wandb.project=jaxllm-tests"]
    _train(run, 2, *flags, "optim.lr=0.002")
    run_id = json.loads((run / trackers.STORE).read_text())["wandb"]["id"]
    _train(run, 4, *flags, "optim.lr=0.002")  # resumes from the checkpoint at step 2
    assert json.loads((run / trackers.STORE).read_text())["wandb"]["id"] == run_id
    assert not (run / "tensorboard").exists()  # not listed: not written

    files = sorted((tmp_path / "wandb_dir" / "wandb").glob(f"offline-run-*-{run_id}/*.wandb"))
    assert len(files) == 2, files  # two attempts, one W&B run
    history, config, artifacts, summary = {}, {}, [], {}
    for path in files:
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                assert r.run.run_id == run_id and r.run.project == "jaxllm-tests"
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in r.history.item}
                history[items.pop("_step")] = {
                    k: v for k, v in items.items() if not k.startswith("_")
                }
            elif kind == "summary":
                summary.update({_key(u): json.loads(u.value_json) for u in r.summary.update})
            elif kind == "artifact":
                artifacts.append(sorted(c.path for c in r.artifact.manifest.contents))
    assert config["optim.lr"] == 0.002 and config["train.steps"] == 4
    expected = _expected(run)
    assert sorted(history) == sorted(expected) == [1, 2, 3, 4]
    for step, values in expected.items():
        assert history[step] == pytest.approx(values), step
    assert artifacts == [["loss.png", "summary.json"]] * 2
    assert summary["step"] == 4 and summary["loss"] == pytest.approx(expected[4]["loss"])


# -- MLflow ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1 with a SQLite store (Flask under gunicorn: the server of
    mlflow-skinny plus flask, sqlalchemy, alembic, gunicorn); yields (uri, process)."""
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        *("server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
        *("--backend-store-uri", f"sqlite:///{root}/mlflow.db"),
        *("--default-artifact-root", str(root / "artifacts"), "--gunicorn-opts", ""),
    ]
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()}")
            time.sleep(0.3)
    yield uri, proc
    proc.terminate()
    proc.wait(30)
    log.close()


def _mlflow_flags(uri: str) -> list[str]:
    return [
        "run.trackers=[jsonl, tensorboard, mlflow]",
        f"run.mlflow.tracking_uri={uri}",
        "run.mlflow.experiment=jaxllm-tests",
    ]


def test_mlflow_logs_config_metrics_artifacts_and_resumes(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    uri, _ = mlflow_server
    run = tmp_path / "run"
    _train(run, 2, *_mlflow_flags(uri), "optim.lr=0.002")
    run_id = json.loads((run / trackers.STORE).read_text())["mlflow"]["run_id"]
    _train(run, 4, *_mlflow_flags(uri), "optim.lr=0.002")
    assert json.loads((run / trackers.STORE).read_text())["mlflow"]["run_id"] == run_id

    client = MlflowClient(uri)
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    exp = client.get_experiment(found.info.experiment_id)
    assert exp.name == "jaxllm-tests"
    assert len(client.search_runs([exp.experiment_id])) == 1  # the resume made no new run
    assert found.data.params["optim.lr"] == "0.002"
    assert found.data.params["run.trackers"] == '["jsonl", "tensorboard", "mlflow"]'
    expected = _expected(run)
    assert sorted(expected) == [1, 2, 3, 4]
    for key in expected[1]:
        logged = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        want = {s: v[key] for s, v in expected.items() if key in v}
        assert logged == pytest.approx(want), key
    names = sorted(f.path for f in client.list_artifacts(run_id))
    assert names == ["loss.png", "summary.json"]
    summary = json.loads(Path(client.download_artifacts(run_id, "summary.json")).read_text())
    assert summary["step"] == 4 and summary["loss"] == pytest.approx(expected[4]["loss"])


def test_a_sweep_logs_one_mlflow_run_per_combination(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    uri, _ = mlflow_server
    flags = [*_mlflow_flags(uri)[:2], "run.mlflow.experiment=jaxllm-sweep"]
    grid = ["--grid", "optim.lr=0.001,0.002", "--out", str(tmp_path / "sweep")]
    assert main(["sweep", *SMALL_RUN, "train.steps=2", *flags, *grid]) == 0
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("jaxllm-sweep")
    runs = client.search_runs([exp.experiment_id])
    assert sorted((r.info.run_name, r.data.params["optim.lr"]) for r in runs) == [
        ("lr=0.001", "0.001"),
        ("lr=0.002", "0.002"),
    ]
    assert all(r.data.metrics["loss"] > 0 and r.info.status == "FINISHED" for r in runs)


def test_a_run_that_fails_ends_its_mlflow_run_as_failed(mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from jaxllm.config import RunError
    from jaxllm.train import watch

    uri, _ = mlflow_server
    metrics = watch.Speed.metrics

    def fail_at_step_2(self, elapsed, steps):
        if self.steps_seen >= 1:
            raise RunError("the disk went away")
        self.steps_seen = 1
        return metrics(self, elapsed, steps)

    monkeypatch.setattr(watch.Speed, "steps_seen", 0, raising=False)
    monkeypatch.setattr(watch.Speed, "metrics", fail_at_step_2)
    run = tmp_path / "run"
    argv = ["train", *SMALL_RUN, "train.steps=4", f"run.dir={run}", *_mlflow_flags(uri)]
    assert main(argv) == 1
    run_id = json.loads((run / trackers.STORE).read_text())["mlflow"]["run_id"]
    found = MlflowClient(uri).get_run(run_id)
    assert found.info.status == "FAILED"  # not left RUNNING
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]


def test_mlflow_server_gone_mid_run_warns_once(mlflow_server, tmp_path, monkeypatch, capsys):
    """Runs last: it stops the module's server after the first row reached it."""
    uri, proc = mlflow_server
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    write = trackers._Mlflow.write

    def write_then_stop(self, step, row):
        write(self, step, row)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)

    monkeypatch.setattr(trackers._Mlflow, "write", write_then_stop)
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # printed as `jaxllm: warning:` lines
        _train(run, 4, *_mlflow_flags(uri))
    err = capsys.readouterr().err
    ours = [ln for ln in err.splitlines() if ln.startswith("jaxllm: warning: run.trackers")]
    assert len(ours) == 1, err
    assert "mlflow failed to write" in ours[0] and "Traceback" not in err
    assert sorted(_expected(run)) == [1, 2, 3, 4]  # metrics.jsonl has every step
    assert (run / "loss.png").is_file()
