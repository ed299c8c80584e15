"""Orbax checkpoints under `<run.dir>/checkpoints/<step>/`, written so a run survives crashes,
preemption and a change of mesh.

Each checkpoint holds five items: `params` and `train` (step, optimizer state, rng) as sharded
arrays, `data` (the input iterator's state), `config` (the resolved config) and `tokenizer`
(what is needed to rebuild it); models with non-trained variables (MoE router balancing
biases) add a sixth, `model_state`, which inference restores with the parameters, and runs with
dynamic loss scaling one more, `loss_scale` (the scale and its clean-step count; a checkpoint
without it resumes with the configured initial scale). Orbax writes
into a temporary directory and renames it when complete, so a process killed mid-save leaves the
previous checkpoint as the newest one.

Only *finalized* checkpoints count: a directory named by its step that holds Orbax's
`_CHECKPOINT_METADATA`. Anything else under the directory (a file, an empty or half-written
directory, a leftover temporary one, a checkpoint set aside as `<step>.damaged`) is ignored for
restoring and never counts toward `checkpoint.keep`; retention is done here rather than by Orbax,
which would count such strays as steps.

Restoring takes target shardings: every host reads only its own shards, and a state saved on one
mesh restores onto any other. A newest checkpoint that cannot be read (truncated or deleted
files) is reported and the next older one is used, by training and by every reader (`eval`,
`generate`, `load_model`, export); training also moves the damaged one aside, so the redone step
can be saved under its number.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import typing
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxllm.config import CheckpointConfig, ConfigError, JaxllmWarning, RunError

FINALIZED = "_CHECKPOINT_METADATA"  # Orbax writes it last, inside the renamed step directory


def checkpoint_dir(run_dir: str | Path, configured: str | None = None) -> Path:
    return Path(configured) if configured else Path(run_dir) / "checkpoints"


def steps(directory: str | Path) -> list[int]:
    """The finalized checkpoints' steps under `directory`, ascending (strays ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in directory.iterdir()
        if p.name.isdigit() and p.is_dir() and (p / FINALIZED).is_file()
    )


def latest_step(directory: str | Path) -> int | None:
    """The newest finalized checkpoint's step, or None."""
    found = steps(directory)
    return found[-1] if found else None


def read_json_item(directory: str | Path, step: int, item: str) -> dict | None:
    """A JSON item (`config`, `tokenizer`, `data`) of one checkpoint, or None when it is missing
    or unreadable. Reads one small file; no Orbax manager, nothing created."""
    path = Path(directory) / str(step) / item / "metadata"
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def manager(
    directory: str | Path, cfg: CheckpointConfig | None = None, *, create: bool = True
) -> ocp.CheckpointManager:
    """An Orbax manager without retention of its own (see `Checkpointer.prune`)."""
    cfg = cfg or CheckpointConfig()
    options = ocp.CheckpointManagerOptions(create=create, enable_async_checkpointing=cfg.async_save)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def tokenizer_record(path_or_name: str) -> dict:
    """What rebuilds the tokenizer: its name, or the bytes of its file."""
    p = Path(path_or_name)
    if not p.is_file():
        return {"name": path_or_name}
    return {"name": p.name, "content_b64": base64.b64encode(p.read_bytes()).decode()}


def set_aside(directory: str | Path, step: int, why: str = "damaged") -> Path:
    """Renames `<step>` to `<step>.<why>` (numbered if that exists) so the step can be written
    again; nothing is deleted. Returns the new path."""
    src = Path(directory) / str(step)
    dst = src.with_name(f"{step}.{why}")
    n = 1
    while dst.exists():
        n += 1
        dst = src.with_name(f"{step}.{why}{n}")
    src.rename(dst)
    return dst


def _state_items(state) -> dict:
    return {
        "params": state.params,
        "train": {"step": state.step, "opt": state.opt_state, "rng": state.rng},
    }


def _fields(struct) -> dict:
    """A flax struct dataclass's fields as a dict: Orbax saves and restores plain dicts."""
    return {f.name: getattr(struct, f.name) for f in dataclasses.fields(struct)}


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _warn_unreadable(directory, step: int, e: Exception, nxt: str, stacklevel=3) -> None:
    warnings.warn(
        f"checkpoint at step {step} in {directory} is unreadable ({_first_line(e)}); {nxt}.",
        JaxllmWarning,
        stacklevel=stacklevel,
    )


class Checkpointer:
    """One Orbax manager for the life of a run: periodic async saves, final save, retention,
    resume. Create it only once the run directory is ready to be written."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.directory = Path(directory)
        self.cfg = cfg
        self._lead = jax.process_index() == 0
        self._mgr = manager(self.directory, cfg)

    def save(
        self,
        state,
        *,
        data_state: dict,
        config: dict,
        tokenizer: dict,
        base: dict | None = None,
        others: dict | None = None,
    ) -> int:
        """Starts writing `state` at its step (returns at once when async); returns the step.
        `base`: a fine-tuning run's base record (`jaxllm.adapters.base_record`), saved as the
        JSON item `base`; `others`: where the objective's frozen models came from
        (`jaxllm.train.others.records`), the JSON item `others`.
        RunError when the directory is gone or the write fails (disk full, read-only)."""
        step = int(jax.device_get(state.step))
        self._finish("the previous checkpoint")
        if not self.directory.is_dir():
            raise RunError(
                f"the checkpoint directory {self.directory} disappeared while training; step "
                f"{step} was not saved."
            )
        self.prune()
        path = self.directory / str(step)
        if path.exists():
            if step in steps(self.directory):
                raise RunError(f"cannot save step {step}: {path} already holds a checkpoint.")
            if self._lead:  # a stray directory with the step's name: keep it, out of the way
                moved = set_aside(self.directory, step, "stray")
                warnings.warn(
                    f"{path} was not a finished checkpoint; moved it to {moved.name}.",
                    JaxllmWarning,
                    stacklevel=2,
                )
            _sync("jaxllm_checkpoint_stray")
            self._mgr.reload()
        items = _state_items(state)
        extra = {}
        if state.model_state:
            extra["model_state"] = ocp.args.StandardSave(state.model_state)
        if state.loss_scale is not None:
            extra["loss_scale"] = ocp.args.StandardSave(_fields(state.loss_scale))
        if base is not None:
            extra["base"] = ocp.args.JsonSave(base)
        if others is not None:
            extra["others"] = ocp.args.JsonSave(others)
        try:
            self._mgr.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(items["params"]),
                    train=ocp.args.StandardSave(items["train"]),
                    data=ocp.args.JsonSave(data_state),
                    config=ocp.args.JsonSave(config),
                    tokenizer=ocp.args.JsonSave(tokenizer),
                    **extra,
                ),
                force=True,
            )
        except Exception as e:
            raise RunError(f"writing checkpoint {path} failed ({_first_line(e)}).") from e
        return step

    def _finish(self, what: str) -> None:
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            newest = latest_step(self.directory)
            kept = f"step {newest} is the newest finished one" if newest is not None else "none is"
            raise RunError(
                f"writing {what} to {self.directory} failed ({_first_line(e)}); {kept}."
            ) from e

    def prune(self) -> None:
        """Deletes finalized checkpoints beyond the newest `keep` (sparing multiples of
        `keep_every`); strays are never counted or touched."""
        found = steps(self.directory)
        keep = set(found[-self.cfg.keep :])
        if self.cfg.keep_every:
            keep |= {s for s in found if s % self.cfg.keep_every == 0}
        doomed = [s for s in found if s not in keep]
        if doomed:
            self._mgr.reload()
            for s in doomed:
                self._mgr.delete(s)

    def wait(self) -> None:
        self._finish("a checkpoint")

    def close(self) -> None:
        self._finish("the last checkpoint")
        self.prune()
        self._mgr.close()

    def restore_latest(self, abstract_state):
        """(state, data_state, step) from the newest readable checkpoint, or None if there is
        none. `abstract_state` is a TrainState of ShapeDtypeStruct whose shardings say where
        every leaf goes on the current mesh. An unreadable checkpoint is moved aside as
        `<step>.damaged` (after a warning) and the next older one is tried."""
        candidates = [
            s for s in reversed(steps(self.directory)) if has_train_state(self.directory, s)
        ]
        target = _state_items(abstract_state)
        extra = {}
        if abstract_state.model_state:
            extra["model_state"] = ocp.args.StandardRestore(abstract_state.model_state)
        for i, step in enumerate(candidates):
            # Restored when this run scales dynamically and the checkpoint has one; otherwise
            # the returned state's `loss_scale` is None.
            with_scale = (
                abstract_state.loss_scale is not None
                and (self.directory / str(step) / "loss_scale").is_dir()
            )
            if with_scale:
                extra["loss_scale"] = ocp.args.StandardRestore(_fields(abstract_state.loss_scale))
            else:
                extra.pop("loss_scale", None)
            try:
                out = self._mgr.restore(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(target["params"]),
                        train=ocp.args.StandardRestore(target["train"]),
                        data=ocp.args.JsonRestore(),
                        **extra,
                    ),
                )
            except Exception as e:  # a damaged checkpoint: set it aside, fall back
                nxt = (
                    f"falling back to step {candidates[i + 1]}"
                    if i + 1 < len(candidates)
                    else "starting fresh"
                )
                name = f"{step}.damaged"
                if self._lead:
                    name = set_aside(self.directory, step).name
                _sync("jaxllm_checkpoint_damaged")
                _warn_unreadable(self.directory, step, e, f"moved it to {name}, {nxt}")
                self._mgr.reload()
                continue
            train = out["train"]
            state = abstract_state.replace(
                step=train["step"],
                params=out["params"],
                opt_state=train["opt"],
                rng=train["rng"],
                model_state=out["model_state"] if "model_state" in extra else {},
                loss_scale=abstract_state.loss_scale.replace(**out["loss_scale"])
                if with_scale
                else None,
                frozen=None,  # not saved: loaded again from the run's base
                others=None,  # nor are the objective's frozen models
            )
            return state, out["data"], step
        return None


def _sync(name: str) -> None:
    """All processes meet here after the lead one changed the checkpoint directory."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_params(
    directory: str | Path,
    params,
    *,
    step: int,
    config: dict,
    tokenizer: dict,
    model_state=None,
    base: dict | None = None,
):
    """A weights-only checkpoint (items params, config, tokenizer, and model_state when there
    is one; no optimizer state), as `jaxllm convert import` writes: `jaxllm generate / eval`
    read it, and a training run in its directory starts from it (`has_train_state` is False:
    it is not a resume point). `base`: a fine-tuning run's base record, whose adapters
    `params` are (`jaxllm convert import --peft`)."""
    extra = {"model_state": ocp.args.StandardSave(model_state)} if model_state else {}
    if base is not None:
        extra["base"] = ocp.args.JsonSave(base)
    with manager(directory, CheckpointConfig(async_save=False)) as mgr:
        mgr.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                config=ocp.args.JsonSave(config),
                tokenizer=ocp.args.JsonSave(tokenizer),
                **extra,
            ),
            force=True,
        )
        mgr.wait_until_finished()


def has_train_state(directory: str | Path, step: int) -> bool:
    """Whether the checkpoint at `step` is a resume point rather than weights-only. A training
    checkpoint always has the `data` item besides `train`, so one that lost its optimizer state
    still counts (and its restore fails loudly) instead of being skipped as weights-only."""
    path = Path(directory) / str(step)
    return (path / "train").exists() or (path / "data").exists()


class Weights(typing.NamedTuple):
    """What inference needs of a checkpoint."""

    params: dict
    model_state: dict  # {} for models without non-trained variables
    step: int


def restore_weights(
    directory: str | Path, target, model_state_target=None, step: int | None = None
) -> Weights:
    """Parameters (and the model state when `model_state_target` is non-empty) into `target`:
    pytrees of jax.ShapeDtypeStruct whose `.sharding` says where each leaf goes (each host
    reads only its shards). Without `step`, the newest readable checkpoint: an unreadable one is
    reported with a JaxllmWarning and the next older one is used (nothing is moved: readers
    leave the run directory as it is). ConfigError when there is nothing to read."""
    directory = Path(directory)
    candidates = [step] if step is not None else list(reversed(steps(directory)))
    if not candidates:
        raise ConfigError(f"no checkpoint in {directory}; train first.")
    items = {"params": ocp.args.StandardRestore(target)}
    if model_state_target:
        items["model_state"] = ocp.args.StandardRestore(model_state_target)
    with manager(directory, create=False) as mgr:
        for i, at in enumerate(candidates):
            try:
                out = mgr.restore(at, args=ocp.args.Composite(**items))
            except Exception as e:
                if i + 1 == len(candidates):
                    what = (
                        f"checkpoint {directory / str(at)}"
                        if step is not None
                        else (f"no checkpoint in {directory} is readable; the oldest, step {at},")
                    )
                    raise ConfigError(f"{what} cannot be read ({_first_line(e)}).") from e
                _warn_unreadable(directory, at, e, f"falling back to step {candidates[i + 1]}")
                continue
            return Weights(out["params"], out["model_state"] if model_state_target else {}, at)
    raise AssertionError("unreachable")
