"""Experiment trackers: the run's metrics also to Weights & Biases and MLflow (`run.trackers`).

Each tracker is a sink of `jaxllm.metrics.MetricsWriter`: it logs the resolved config as the
run's parameters (flat keys, `optim.lr`), every metrics.jsonl row's numbers at their step under
the same names, and at the end loss.png and the closing summary (the last metrics, the sample)
as artifacts. The tracker's run id is kept in RUN/trackers.json, so a resumed run goes on in
the same W&B / MLflow run. A run that ends in an error ends its tracker run as failed (MLflow
FAILED, or KILLED for an interrupt; W&B's exit code 1).

metrics.jsonl stays the run's record: a tracker that fails (its server gone) warns once and is
dropped, and training goes on. The packages (`pip install 'jaxllm[trackers]'`: wandb and
mlflow-skinny) are imported by `check` at start-up, before anything is written.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

from jaxllm.config import ConfigError, JaxllmWarning, RunConfig

STORE = "trackers.json"  # in the run directory: {tracker: what resumes its run}
_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


def check(run: RunConfig) -> None:
    """Imports the packages of the listed trackers; a missing one is a ConfigError."""
    for name in run.trackers:
        if name in _PACKAGES:
            module, package = _PACKAGES[name]
            try:
                __import__(module)
            except ImportError as e:
                raise ConfigError(
                    f"run.trackers lists {name}, but {module} cannot be imported ({e}); "
                    f"pip install 'jaxllm[trackers]' (or {package}), or drop {name}."
                ) from None


def open_trackers(run: RunConfig, params: dict) -> list:
    """The sinks of the listed trackers, each started (or resumed) in `run.dir` with `params`
    (the resolved config, nested). A tracker that cannot start warns and is left out."""
    run_dir = Path(run.dir)
    store = run_dir / STORE
    ids = json.loads(store.read_text()) if store.is_file() else {}
    flat = flatten(params)
    sinks = []
    for name, cls in (("wandb", _Wandb), ("mlflow", _Mlflow)):
        if name not in run.trackers:
            continue
        try:
            sink = cls(run, flat, ids.get(name))
        except Exception as e:
            _warn(name, "could not start", e)
            continue
        ids[name] = sink.resume_record
        sinks.append(_Guarded(name, sink))
    if sinks:
        tmp = store.with_name(STORE + ".tmp")
        tmp.write_text(json.dumps(ids, indent=1) + "\n")
        os.replace(tmp, store)
    return sinks


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 0.1}} -> {"optim.lr": 0.1}; lists become their JSON text."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return out


def numbers(row: dict) -> dict:
    """The numeric metrics of a metrics.jsonl row (`step` and text entries left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _warn(name: str, what: str, e: BaseException) -> None:
    warnings.warn(
        f"run.trackers: {name} {what} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
        "it is left out for the rest of the run, metrics.jsonl has every metric.",
        JaxllmWarning,
        stacklevel=3,
    )


class _Guarded:
    """A tracker whose first failure warns once and turns it off."""

    def __init__(self, name: str, sink):
        self.name, self._sink = name, sink

    def _call(self, what: str, *args) -> None:
        if self._sink is None:
            return
        try:
            getattr(self._sink, what)(*args)
        except Exception as e:
            self._sink = None
            _warn(self.name, f"failed to {what}", e)

    def write(self, step: int, row: dict) -> None:
        self._call("write", step, row)

    def finish(self, summary: dict, files: list[Path]) -> None:
        self._call("finish", summary, files)

    def fail(self, error: BaseException) -> None:
        self._call("fail", error)


class _Wandb:
    """A W&B run named after the run directory; its files go to RUN/wandb (or WANDB_DIR)."""

    def __init__(self, run: RunConfig, params: dict, resume: dict | None):
        import wandb

        run_dir = Path(run.dir)
        same = resume and resume.get("project") == run.wandb.project
        self.run = wandb.init(
            project=run.wandb.project,
            name=run_dir.resolve().name,
            id=resume["id"] if same else None,
            resume="allow" if same else None,
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            config=params,
            settings=wandb.Settings(console="off", silent=True),
        )
        if same:
            self.run.config.update(params, allow_val_change=True)
        self.resume_record = {"id": self.run.id, "project": run.wandb.project}

    def write(self, step: int, row: dict) -> None:
        if values := numbers(row):
            self.run.log(values, step=step)

    def finish(self, summary: dict, files: list[Path]) -> None:
        import wandb

        self.run.summary.update(summary)
        artifact = wandb.Artifact(f"run-{self.run.id}-outputs", type="run_outputs")
        with artifact.new_file("summary.json") as f:
            json.dump(summary, f, indent=1)
        for path in files:
            if path.is_file():
                artifact.add_file(str(path))
        self.run.log_artifact(artifact)
        self.run.finish()

    def fail(self, error: BaseException) -> None:
        self.run.finish(exit_code=130 if isinstance(error, KeyboardInterrupt) else 1)


class _Mlflow:
    """An MLflow run named after the run directory, through `MlflowClient` (no global state)."""

    def __init__(self, run: RunConfig, params: dict, resume: dict | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient(run.mlflow.tracking_uri)
        where = {"tracking_uri": client.tracking_uri, "experiment": run.mlflow.experiment}
        known = {}
        if resume and all(resume.get(k) == v for k, v in where.items()):
            self.run_id = resume["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            known = client.get_run(self.run_id).data.params  # parameters cannot change
        else:
            name = run.mlflow.experiment or "Default"
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else client.create_experiment(name)
            self.run_id = client.create_run(
                exp_id, run_name=Path(run.dir).resolve().name
            ).info.run_id
        new = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in known]
        for i in range(0, len(new), 100):  # MLflow takes 100 parameters per request
            client.log_batch(self.run_id, params=new[i : i + 100])
        self.resume_record = {**where, "run_id": self.run_id}

    def write(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(k, v, ms, step) for k, v in numbers(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: dict, files: list[Path]) -> None:
        for path in files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id)

    def fail(self, error: BaseException) -> None:
        interrupted = isinstance(error, KeyboardInterrupt)
        self.client.set_terminated(self.run_id, status="KILLED" if interrupted else "FAILED")
