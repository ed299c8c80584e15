"""The checkpoint directory on disk: which steps are finalized, their small JSON items, moving
a damaged one aside, weights-only checkpoints (`save_params`) and what inference reads of one
(`restore_weights`). The training run's manager is `jaxllm.checkpoint.trainer.Checkpointer`."""

from __future__ import annotations

import base64
import json
import typing
import warnings
from pathlib import Path

import jax

from jaxllm.checkpoint.orbax_import import ocp
from jaxllm.config import CheckpointConfig, ConfigError, JaxllmWarning, from_dict

FINALIZED = "_CHECKPOINT_METADATA"  # Orbax writes it last, inside the renamed step directory


def checkpoint_dir(run_dir: str | Path, configured: str | None = None) -> Path:
    """Where a run's checkpoints live: `checkpoint.dir` when set, else `<run.dir>/checkpoints`."""
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


# The JSON item with the state of the watched eval metric (`jaxllm.train.watch.Best`): its
# best value, the step of it, the evaluations since; `--checkpoint best` reads the step.
BEST_ITEM = "best"


def best_step(directory: str | Path) -> int | None:
    """The best step the newest checkpoint with a `best` item records (None: none records
    one, the run had neither train.early_stopping nor checkpoint.keep_best)."""
    for s in reversed(steps(directory)):
        saved = read_json_item(directory, s, BEST_ITEM)
        if saved and saved.get("step") is not None:
            return int(saved["step"])
    return None


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


def aside_name(path: Path, why: str) -> Path:
    """A free sibling name for `path` set aside: `<name>.<why>`, numbered (`.<why>2`, ...)
    when that exists."""
    dst, n = path.with_name(f"{path.name}.{why}"), 1
    while dst.exists():
        n += 1
        dst = path.with_name(f"{path.name}.{why}{n}")
    return dst


def set_aside(directory: str | Path, step: int, why: str = "damaged") -> Path:
    """Renames `<step>` to `<step>.<why>` (numbered if that exists) so the step can be written
    again; nothing is deleted. Returns the new path."""
    src = Path(directory) / str(step)
    dst = aside_name(src, why)
    src.rename(dst)
    return dst


def _first_line(e: Exception) -> str:
    """The error's type and first line, without TensorStore's spec dump."""
    text = str(e).strip().splitlines()
    first = text[0].split(" See full TensorStore details")[0] if text else ""
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


def _warn_unreadable(directory, step: int, e: Exception, nxt: str, stacklevel=3) -> None:
    warnings.warn(
        f"checkpoint at step {step} in {directory} is unreadable ({_first_line(e)}); {nxt}.",
        JaxllmWarning,
        stacklevel=stacklevel,
    )


def sync(name: str) -> None:
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
    `params` are (`jaxllm convert import --peft`). A `config` that `load_model` would refuse
    is a ConfigError here, and nothing is written."""
    with warnings.catch_warnings():  # a warning is the run's to give, when it validates
        warnings.simplefilter("ignore")
        from_dict(config).validate()
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
