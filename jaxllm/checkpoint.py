"""Orbax checkpoints under `<run.dir>/checkpoints/<step>/`, written so a run survives crashes,
preemption and a change of mesh.

Each checkpoint holds five items: `params` and `train` (step, optimizer state, rng) as sharded
arrays, `data` (the input iterator's state), `config` (the resolved config) and `tokenizer`
(what is needed to rebuild it); models with non-trained variables (MoE router balancing
biases) add a sixth, `model_state`, which inference restores with the parameters. Orbax writes into a temporary directory and renames it when
complete, so a process killed mid-save leaves the previous checkpoint as the newest one.

Restoring takes target shardings: every host reads only its own shards, and a state saved on one
mesh restores onto any other. A newest checkpoint that cannot be read (truncated or deleted
files) is reported and the next older one is used.
"""

from __future__ import annotations

import base64
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxllm import JaxllmWarning
from jaxllm.config import CheckpointConfig


def checkpoint_dir(run_dir: str | Path, configured: str | None = None) -> Path:
    return Path(configured) if configured else Path(run_dir) / "checkpoints"


def manager(directory: str | Path, cfg: CheckpointConfig | None = None) -> ocp.CheckpointManager:
    cfg = cfg or CheckpointConfig()
    options = ocp.CheckpointManagerOptions(
        create=True,
        max_to_keep=cfg.keep,
        keep_period=cfg.keep_every,
        enable_async_checkpointing=cfg.async_save,
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def tokenizer_record(path_or_name: str) -> dict:
    """What rebuilds the tokenizer: its name, or the bytes of its file."""
    p = Path(path_or_name)
    if not p.is_file():
        return {"name": path_or_name}
    return {"name": p.name, "content_b64": base64.b64encode(p.read_bytes()).decode()}


def _state_items(state) -> dict:
    return {
        "params": state.params,
        "train": {"step": state.step, "opt": state.opt_state, "rng": state.rng},
    }


class Checkpointer:
    """One Orbax manager for the life of a run: periodic async saves, final save, resume."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.directory = Path(directory)
        self.cfg = cfg
        self._mgr = manager(self.directory, cfg)

    def save(self, state, *, data_state: dict, config: dict, tokenizer: dict) -> int:
        """Starts writing `state` at its step (returns at once when async); returns the step."""
        step = int(jax.device_get(state.step))
        if step in self._mgr.all_steps():
            return step
        items = _state_items(state)
        extra = {}
        if state.model_state:
            extra["model_state"] = ocp.args.StandardSave(state.model_state)
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
        return step

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    def restore_latest(self, abstract_state):
        """(state, data_state, step) from the newest readable checkpoint, or None if there is
        none. `abstract_state` is a TrainState of ShapeDtypeStruct whose shardings say where
        every leaf goes on the current mesh."""
        steps = [
            s
            for s in sorted(self._mgr.all_steps(), reverse=True)
            if has_train_state(self.directory, s)
        ]  # weights-only ones are no resume point
        target = _state_items(abstract_state)
        extra = {}
        if abstract_state.model_state:
            extra["model_state"] = ocp.args.StandardRestore(abstract_state.model_state)
        for i, step in enumerate(steps):
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
            except Exception as e:  # a damaged checkpoint: fall back to the one before
                nxt = (
                    f"falling back to step {steps[i + 1]}"
                    if i + 1 < len(steps)
                    else "starting fresh"
                )
                warnings.warn(
                    f"checkpoint at step {step} in {self.directory} is unreadable "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); {nxt}.",
                    JaxllmWarning,
                    stacklevel=2,
                )
                continue
            train = out["train"]
            state = abstract_state.replace(
                step=train["step"], params=out["params"], opt_state=train["opt"], rng=train["rng"],
                model_state=out["model_state"] if extra else {},
            )  # fmt: skip
            return state, out["data"], step
        return None


def latest_step(directory: str | Path) -> int | None:
    if not Path(directory).is_dir():
        return None
    with manager(directory) as mgr:
        return mgr.latest_step()


def save_params(directory: str | Path, params, *, step: int, config: dict, tokenizer: dict,
                model_state=None):  # fmt: skip
    """A weights-only checkpoint (items params, config, tokenizer, and model_state when there
    is one; no optimizer state), as `jaxllm convert import` writes: `jaxllm generate / eval`
    read it, and a training run in its directory starts from it (`has_train_state` is False:
    it is not a resume point)."""
    extra = {"model_state": ocp.args.StandardSave(model_state)} if model_state else {}
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


def restore_params(directory: str | Path, target, step: int | None = None,
                   model_state_target=None):  # fmt: skip
    """Parameters only, into `target`: a pytree of jax.ShapeDtypeStruct whose `.sharding` says
    where each leaf goes (each host reads only its shards). With a non-empty
    `model_state_target`, returns (params, model_state): what inference needs of the model."""
    with manager(directory) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {directory}")
        items = {"params": ocp.args.StandardRestore(target)}
        if model_state_target:
            items["model_state"] = ocp.args.StandardRestore(model_state_target)
        out = mgr.restore(step, args=ocp.args.Composite(**items))
        if model_state_target is None:
            return out["params"]
        return out["params"], out["model_state"] if model_state_target else {}
