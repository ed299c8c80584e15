"""`Checkpointer`: one Orbax manager for the life of a training run (periodic async saves,
retention, resume), and how a checkpoint's saved structure is told from a damaged one."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import jax

from jaxllm.checkpoint import increments, quantized, tiers
from jaxllm.checkpoint.files import (
    BEST_ITEM,
    _first_line,
    _warn_unreadable,
    has_train_state,
    latest_step,
    manager,
    read_json_item,
    set_aside,
    steps,
    sync,
)
from jaxllm.checkpoint.orbax_import import ocp
from jaxllm.config import CheckpointConfig, ConfigError, JaxllmWarning, RunError

# The JSON item with the metrics.jsonl row of the checkpoint's step (Orbax's manager keeps the
# name `metrics` for its own use).
METRICS_ITEM = "metrics_row"


def _state_items(state) -> dict:
    train = {"step": state.step, "opt": state.opt_state, "rng": state.rng}
    if state.grad_comp is not None:  # the replicas' residuals of a compressed exchange
        train["grad_comp"] = state.grad_comp
    return {"params": state.params, "train": train}


def _fields(struct) -> dict:
    """A flax struct dataclass's fields as a dict: Orbax saves and restores plain dicts."""
    return {f.name: getattr(struct, f.name) for f in dataclasses.fields(struct)}


class Checkpointer:
    """One Orbax manager for the life of a run: periodic async saves, final save, retention,
    resume. Create it only once the run directory is ready to be written. `mirror` (a run on
    object storage, `jaxllm.checkpoint.mirror.Remote`): every finalized checkpoint is uploaded
    to the bucket, and retention's deletions are done there too. `checkpoint.local_dir`: a
    second manager there (`jaxllm.checkpoint.tiers`), written by `save(..., local=True)`."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig, mirror=None, log=None):
        self.directory = Path(directory)
        self.cfg = cfg
        self._lead = jax.process_index() == 0
        self._increments = increments.Increments() if cfg.incremental else None
        self._log = log  # a line per incremental save: its bytes written, what it linked
        self._mgr = manager(self.directory, cfg)
        self.local = Path(cfg.local_dir) if cfg.local_dir else None
        self._local_mgr = manager(self.local, cfg) if self.local else None
        self.promoted: list[int] = []  # local steps a resume copied into `directory`
        self.mirror = mirror if self._lead else None
        for d in (self.directory, self.local) if self._lead else ():
            if d is not None:
                increments.repair(d)  # links a killed incremental run still owed
        sync("jaxllm_checkpoint_repair")

    def save(
        self,
        state,
        *,
        data_state: dict,
        config: dict,
        tokenizer: dict,
        base: dict | None = None,
        others: dict | None = None,
        metrics: dict | None = None,
        best: dict | None = None,
        local: bool = False,
    ) -> int:
        """Starts writing `state` at its step (returns at once when async); returns the step.
        `base`: a fine-tuning run's base record (`jaxllm.adapters.base_record`), saved as the
        JSON item `base`; `others`: where the objective's frozen models came from
        (`jaxllm.train.companions.records`), the JSON item `others`; `metrics`: the metrics.jsonl
        row of this step, the JSON item `metrics_row`, which a resume writes back when the file
        lost it (`MetricsWriter`'s `resume_row`); `best`: the watched eval metric's state
        (`jaxllm.train.watch.Best.record`), the JSON item `best`; `local`: to the fast tier
        (`checkpoint.local_dir`), neither mirrored nor counted by `checkpoint.keep`.
        RunError when the directory is gone or the write fails (disk full, read-only)."""
        step = int(jax.device_get(state.step))
        self._finish("the previous checkpoint")
        directory, mgr = (self.local, self._local_mgr) if local else (self.directory, self._mgr)
        if self.mirror is not None and not local:
            self.mirror.check()  # an upload failed: stop before writing more
        if not directory.is_dir():
            raise RunError(
                f"the checkpoint directory {directory} disappeared while training; step "
                f"{step} was not saved."
            )
        self.prune()
        path = directory / str(step)
        if path.exists():
            if step in steps(directory):
                raise RunError(f"cannot save step {step}: {path} already holds a checkpoint.")
            if self._lead:  # a stray directory with the step's name: keep it, out of the way
                moved = set_aside(directory, step, "stray")
                warnings.warn(
                    f"{path} was not a finished checkpoint; moved it to {moved.name}.",
                    JaxllmWarning,
                    stacklevel=2,
                )
            sync("jaxllm_checkpoint_stray")
            mgr.reload()
        items = _state_items(state)
        extra = {}
        if self.cfg.quantize_opt_state == "int8":
            items["train"]["opt"] = quantized.pack(state.opt_state)
            extra[quantized.CODEC_ITEM] = ocp.args.JsonSave(quantized.record())
        if state.model_state:
            extra["model_state"] = ocp.args.StandardSave(state.model_state)
        if state.loss_scale is not None:
            extra["loss_scale"] = ocp.args.StandardSave(_fields(state.loss_scale))
        if base is not None:
            extra["base"] = ocp.args.JsonSave(base)
        if others is not None:
            extra["others"] = ocp.args.JsonSave(others)
        if metrics is not None:
            extra[METRICS_ITEM] = ocp.args.JsonSave(metrics)
        if best is not None:
            extra[BEST_ITEM] = ocp.args.JsonSave(best)
        args = dict(
            params=ocp.args.StandardSave(items["params"]),
            train=ocp.args.StandardSave(items["train"]),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config),
            tokenizer=ocp.args.JsonSave(tokenizer),
            **extra,
        )
        refs = {}
        if self._increments is not None:  # unchanged items: linked from their last copy
            json_items = {k for k, a in args.items() if isinstance(a, ocp.args.JsonSave)}
            values = {k: a.item for k, a in args.items()}
            refs = self._increments.split(directory, step, values, json_items)
            args = {k: a for k, a in args.items() if k not in refs}
            if refs:
                args[increments.ITEM] = ocp.args.JsonSave(refs)
        try:
            mgr.save(step, args=ocp.args.Composite(**args), force=True)
        except Exception as e:
            raise RunError(f"writing checkpoint {path} failed ({_first_line(e)}).") from e
        if self._increments is not None and self._lead:  # the lead process links
            self._increments.owe(directory, step, refs)
        if self.mirror is not None and not local:  # uploaded once Orbax has finalized it
            self.mirror.saved(step)
        return step

    def _finish(self, what: str) -> None:
        for directory, mgr in ((self.directory, self._mgr), (self.local, self._local_mgr)):
            if mgr is None:
                continue
            try:
                mgr.wait_until_finished()
            except Exception as e:
                newest = latest_step(directory)
                kept = (
                    f"step {newest} is the newest finished one" if newest is not None else "none is"
                )
                raise RunError(
                    f"writing {what} to {directory} failed ({_first_line(e)}); {kept}."
                ) from e
        if self._increments is not None and self._lead:
            self._increments.settle(self._log)

    def prune(self) -> None:
        """Deletes finalized checkpoints beyond the newest `keep` (sparing multiples of
        `keep_every`, and with `keep_best` the best step each kept one records); strays are
        never counted or touched."""
        found = steps(self.directory)
        keep = set(found[-self.cfg.keep :])
        if self.cfg.keep_every:
            keep |= {s for s in found if s % self.cfg.keep_every == 0}
        if self.cfg.keep_best:
            records = (read_json_item(self.directory, s, BEST_ITEM) or {} for s in keep.copy())
            keep |= {r["step"] for r in records if r.get("step") is not None}
        doomed = [s for s in found if s not in keep]
        if doomed:
            if self.mirror is not None and self.mirror.pending & set(doomed):
                self.mirror.wait()  # no upload reads a step deleted under it
            self._mgr.reload()
            for s in doomed:
                self._mgr.delete(s)
            if self.mirror is not None:
                self.mirror.removed(doomed)
        if self.local is not None and (old := tiers.obsolete(self.local, self.directory)):
            self._local_mgr.reload()
            for s in old:
                self._local_mgr.delete(s)

    def wait(self) -> None:
        self._finish("a checkpoint")

    def close(self, *, prune: bool = True) -> None:
        """Waits for the last save, applies retention (unless `prune` is False: a command that
        trained nothing deletes nothing) and closes the manager."""
        self._finish("the last checkpoint")
        if prune:
            self.prune()
        self._mgr.close()
        if self._local_mgr is not None:
            self._local_mgr.close()

    def restore_latest(self, abstract_state, *, optimizer: bool = True):
        """(state, data_state, step) from the newest readable checkpoint, or None if there is
        none. `abstract_state` is a TrainState of ShapeDtypeStruct whose shardings say where
        every leaf goes on the current mesh.

        "Damaged" means damaged: a checkpoint whose bytes cannot be read is skipped for the
        next older one, and once an older one is read the newer unreadable ones are moved aside
        as `<step>.damaged` (after a warning), so the redone steps can be saved under their
        numbers. A checkpoint whose state has another structure than `abstract_state` (another
        optimizer, another model) is a ConfigError naming what differs, and when no checkpoint
        is readable the run is refused with a RunError naming them and the first read error;
        in both cases nothing is moved. `optimizer=False` (`checkpoint.reset_optimizer`) reads
        everything but the optimizer state, which may be another optimizer's; the returned
        state's `opt_state` is then None, for the caller to start afresh. With a local tier,
        its steps newer than the persistent ones are first copied in (`tiers.promote`)."""
        if self.local is not None:
            if self._lead:
                self.promoted = tiers.promote(self.local, self.directory)
                for s in self.promoted if self.mirror is not None else ():
                    self.mirror.saved(s)  # the bucket holds what the run directory holds
            sync("jaxllm_checkpoint_promote")
            self._mgr.reload()
        candidates = [
            s for s in reversed(steps(self.directory)) if has_train_state(self.directory, s)
        ]
        target = _state_items(abstract_state)
        train_target = target["train"]
        if not optimizer:
            train_target = {k: v for k, v in train_target.items() if k != "opt"}
        extra = {}
        if abstract_state.model_state:
            extra["model_state"] = ocp.args.StandardRestore(abstract_state.model_state)
        unreadable: list[tuple[int, Exception]] = []
        for step in candidates:
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
            codec = read_json_item(self.directory, step, quantized.CODEC_ITEM)
            if optimizer:
                train_target = dict(train_target, opt=target["train"]["opt"])
                if codec:
                    train_target["opt"] = quantized.packed_target(abstract_state.opt_state)
            train_args = (
                ocp.args.StandardRestore(train_target)
                if optimizer
                else ocp.args.PyTreeRestore(
                    item=train_target,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(train_target),
                    partial_restore=True,
                )
            )
            try:
                out = self._mgr.restore(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(target["params"]),
                        train=train_args,
                        data=ocp.args.JsonRestore(),
                        **extra,
                    ),
                )
            except Exception as e:
                items = {"params": target["params"], "train": train_target}
                if differ := _other_structure(self.directory / str(step), items, optimizer):
                    raise ConfigError(
                        f"the checkpoint at step {step} in {self.directory} holds a training "
                        f"state of another structure than this config's ({differ}); it was "
                        "left as it was. Resume with the config it was trained with, or add "
                        "checkpoint.reset_optimizer=true to keep its parameters and start a "
                        "fresh optimizer state."
                    ) from e
                unreadable.append((step, e))
                continue
            self._set_aside_damaged(unreadable, step)
            if not optimizer:  # the manager now knows `train` by the partial restore's handler
                self._mgr.close()
                self._mgr = manager(self.directory, self.cfg)
            train = out["train"]
            state = abstract_state.replace(
                step=train["step"],
                params=out["params"],
                opt_state=(
                    quantized.unpack(train["opt"], abstract_state.opt_state, codec["block"])
                    if optimizer and codec
                    else train["opt"]
                    if optimizer
                    else None
                ),
                rng=train["rng"],
                grad_comp=train.get("grad_comp"),
                model_state=out["model_state"] if "model_state" in extra else {},
                loss_scale=abstract_state.loss_scale.replace(**out["loss_scale"])
                if with_scale
                else None,
                frozen=None,  # not saved: loaded again from the run's base
                others=None,  # nor are the objective's frozen models
            )
            return state, out["data"], step
        if unreadable:
            first, e = unreadable[0]
            raise RunError(
                f"no checkpoint in {self.directory} is readable (steps "
                f"{', '.join(str(s) for s, _ in reversed(unreadable))}; step {first}: "
                f"{_first_line(e)}); nothing was changed. Restore the files, or start over with "
                "checkpoint.start_fresh=true (which moves this run aside) or a new run.dir."
            )
        return None

    def _set_aside_damaged(self, unreadable: list[tuple[int, Exception]], used: int) -> None:
        """Moves the unreadable checkpoints newer than the one `used` aside, with a warning."""
        for step, e in unreadable:
            name = f"{step}.damaged"
            if self._lead:
                name = set_aside(self.directory, step).name
            sync("jaxllm_checkpoint_damaged")
            _warn_unreadable(
                self.directory, step, e, f"moved it to {name}, falling back to step {used}", 4
            )
        if unreadable:
            self._mgr.reload()


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaf_shapes(tree) -> dict[str, tuple]:
    """{'a/b/0/c': shape} for every array leaf: one spelling for a target's named tuples and
    a checkpoint's metadata, which stores them as dicts and lists."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in p): tuple(getattr(x, "shape", ())) for p, x in leaves}


def _other_structure(path: Path, targets: dict, optimizer: bool) -> str | None:
    """What differs between the state items a checkpoint holds and `targets` (the items this
    config restores), from the checkpoint's metadata; None when they agree or the metadata
    itself cannot be read (then the checkpoint is damaged, not different)."""
    differ = []
    for item, want in targets.items():
        try:
            saved = ocp.StandardCheckpointer().metadata((path / item).absolute()).item_metadata.tree
        except Exception:
            return None
        theirs, ours = _leaf_shapes(saved), _leaf_shapes(want)
        if item == "train" and not optimizer:
            theirs = {k: v for k, v in theirs.items() if not k.startswith("opt/")}
        if theirs == ours:
            continue
        only_there = sorted(set(theirs) - set(ours))
        only_here = sorted(set(ours) - set(theirs))
        shapes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
        what = "parameter" if item == "params" else "training state"
        if only_there:
            differ.append(f"{len(only_there)} {what} arrays only there, e.g. {only_there[0]}")
        if only_here:
            differ.append(f"{len(only_here)} {what} arrays only here, e.g. {only_here[0]}")
        if shapes:
            k = shapes[0]
            differ.append(f"{item}/{k} of shape {theirs[k]} there, {ours[k]} here")
    return "; ".join(differ) or None
