"""Orbax checkpoints of the train state under `<run.dir>/checkpoints/<step>/`.

Restoring takes target shardings, so each host reads only its shards and a state saved on one
mesh can be restored onto another.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


def checkpoint_dir(run_dir: str | Path, configured: str | None = None) -> Path:
    return Path(configured) if configured else Path(run_dir) / "checkpoints"


def manager(directory: str | Path, **options) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        Path(directory).absolute(), options=ocp.CheckpointManagerOptions(create=True, **options)
    )


def save(directory: str | Path, state) -> None:
    """Saves a TrainState at its step, as two items (`params`, and `train` = the rest) so that
    inference can read the parameters alone. Waits until it is on disk."""
    rest = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    step = int(jax.device_get(state.step))
    with manager(directory) as mgr:
        if step in mgr.all_steps():  # a re-run of the same run dir replaces its checkpoint
            mgr.delete(step)
        mgr.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(rest)
            ),
            force=True,
        )
        mgr.wait_until_finished()


def latest_step(directory: str | Path) -> int | None:
    if not Path(directory).is_dir():
        return None
    with manager(directory) as mgr:
        return mgr.latest_step()


def restore_params(directory: str | Path, target, step: int | None = None):
    """Parameters only, into `target`: a pytree of jax.ShapeDtypeStruct whose `.sharding` says
    where each leaf goes (each host reads only its shards)."""
    with manager(directory) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {directory}")
        out = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
        return out["params"]
