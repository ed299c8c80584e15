"""The `run.trackers` keys: where metrics go besides the run directory (Weights & Biases,
MLflow), and the checks of their values. The trackers themselves are `jaxllm.trackers`."""

from __future__ import annotations

import dataclasses
import typing
import urllib.parse
from typing import Literal

from jaxllm.config.errors import fail as _fail

Tracker = Literal["jsonl", "tensorboard", "wandb", "mlflow"]

# The URI schemes MLflow's tracking client takes besides a local path: its REST server, local
# files, Databricks, and the databases of its SQLAlchemy store.
_MLFLOW_SCHEMES = ("http", "https", "file", "databricks", "databricks-uc", "uc")
_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    project: str | None = None
    """The W&B project the run is logged to; required with `wandb` in run.trackers (the run's
    W&B name is its directory's name, the entity that of the API key or WANDB_ENTITY)."""


@dataclasses.dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: str | None = None
    """Where MLflow's runs live: `http(s)://HOST:PORT` of a tracking server, a local path or
    `file:` URI, `databricks`, or a database URI (`sqlite:///mlflow.db`); null: MLflow's own
    default (MLFLOW_TRACKING_URI, else its local store)."""
    experiment: str | None = None
    """The MLflow experiment's name, created when missing; null: MLflow's `Default`."""


def validate_trackers(trackers: tuple[str, ...], wandb: WandbConfig, mlflow: MlflowConfig) -> None:
    """The `run.trackers` list and the keys of each tracker: none given twice, metrics.jsonl
    kept (the run's own record: resume and loss.png read it), and a tracker's keys set only
    when it is listed."""
    known = typing.get_args(Tracker)
    for name in trackers:
        if trackers.count(name) > 1:
            _fail(f"run.trackers names {name} twice; list each tracker once.")
    if "jsonl" not in trackers:
        _fail(
            "run.trackers must keep jsonl: metrics.jsonl is the run's own record, which resume "
            f"and loss.png read; e.g. run.trackers=[jsonl, {', '.join(trackers) or known[1]}]."
        )
    for name, section in (("wandb", wandb), ("mlflow", mlflow)):
        if name not in trackers and section != type(section)():
            key = next(f.name for f in dataclasses.fields(section) if getattr(section, f.name))
            _fail(
                f"run.{name}.{key} does nothing without {name} in run.trackers; add it "
                f"(run.trackers=[{', '.join((*trackers, name))}]) or drop the key."
            )
    if "wandb" in trackers and not (wandb.project or "").strip():
        _fail(
            "run.trackers lists wandb but run.wandb.project is not set; name the W&B project "
            "(run.wandb.project=NAME)."
        )
    if mlflow.experiment is not None and not mlflow.experiment.strip():
        _fail("run.mlflow.experiment is empty; name an experiment or null (MLflow's Default).")
    if mlflow.tracking_uri is not None:
        _check_tracking_uri(mlflow.tracking_uri)


def _check_tracking_uri(uri: str) -> None:
    """A URI MLflow can open: a local path, or a scheme it knows with what that scheme needs."""
    bad = f"run.mlflow.tracking_uri={uri!r} is not a tracking URI"
    if not uri.strip():
        _fail(f"{bad}; give http(s)://HOST:PORT, a local path, or null (MLflow's default).")
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    if len(scheme) <= 1:  # a local path (a Windows drive letter reads as a scheme of one letter)
        return
    if scheme not in _MLFLOW_SCHEMES and scheme.split("+")[0] not in _DB_SCHEMES:
        _fail(
            f"{bad}: MLflow knows no scheme {parts.scheme!r}; give http(s)://HOST:PORT, a local "
            "path, a file:, databricks or database (sqlite:///...) URI."
        )
    if scheme in ("http", "https"):
        try:
            port = parts.port
        except ValueError:
            port = -1
        if not parts.hostname or port == -1:
            _fail(f"{bad}: {scheme}:// needs a host and an optional port, as http://HOST:5000.")
