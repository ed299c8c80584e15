"""The fast tier (`checkpoint.local_dir`): steps saved often to local storage beside the
persistent ones of `checkpoint.dir`. A resume takes the newest intact step of either: local
steps newer than the newest persistent one are first copied into the persistent directory
(into a temporary `<step>.promoting`, renamed when complete), so that the usual restore, its
fallback past damaged steps, and everything that reads a run's checkpoints then see one
directory. The local tier keeps only steps newer than the newest persistent one (at most
`LOCAL_KEEP` of them): it is a cache of the persistent tier, never the only home of an old step.

Two Orbax managers rather than Orbax's multi-tier (emergency) checkpointing, which assumes
several processes with peer-to-peer replication of local steps and does not run in one process."""

from __future__ import annotations

import shutil
from pathlib import Path

from jaxllm.checkpoint.files import has_train_state, set_aside, steps

LOCAL_KEEP = 2


def promote(local: Path, persistent: Path) -> list[int]:
    """Copies the local training steps newer than the newest persistent step into the
    persistent directory; returns their steps (lead process only: callers sync after)."""
    newest = max(steps(persistent), default=-1)
    fresh = [s for s in steps(local) if s > newest and has_train_state(local, s)]
    for s in fresh:
        tmp = persistent / f"{s}.promoting"
        if tmp.exists():  # a copy cut short by an earlier crash
            shutil.rmtree(tmp)
        if (persistent / str(s)).exists():  # a stray with the step's name: kept aside
            set_aside(persistent, s, "stray")
        shutil.copytree(local / str(s), tmp)
        tmp.rename(persistent / str(s))
    return fresh


def obsolete(local: Path, persistent: Path) -> list[int]:
    """The local steps to delete: those not newer than the newest persistent step, and all
    but the newest `LOCAL_KEEP` of the rest."""
    newest = max(steps(persistent), default=-1)
    found = steps(local)
    newer = [s for s in found if s > newest][-LOCAL_KEEP:]
    return [s for s in found if s not in newer]
