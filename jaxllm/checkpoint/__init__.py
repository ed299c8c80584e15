"""Orbax checkpoints under `<run.dir>/checkpoints/<step>/`, written so a run survives crashes,
preemption and a change of mesh.

Each checkpoint holds five items: `params` and `train` (step, optimizer state, rng) as sharded
arrays, `data` (the input iterator's state), `config` (the resolved config) and `tokenizer`
(what is needed to rebuild it); models with non-trained variables (MoE router balancing
biases) add a sixth, `model_state`, which inference restores with the parameters, and runs with
dynamic loss scaling one more, `loss_scale` (the scale and its clean-step count; a checkpoint
without it resumes with the configured initial scale), and runs with `train.early_stopping` or
`checkpoint.keep_best` the JSON item `best` (the watched eval metric's best value, its step, the
evaluations since; retention under keep_best never deletes that step), runs with
`checkpoint.quantize_opt_state=int8` the JSON item `opt_codec` (`quantized.py`), and
incremental saves the JSON item `increment`, the items hard-linked from earlier steps
(`increments.py`). A fast tier, `checkpoint.local_dir`, is `tiers.py`. Orbax writes
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

from jaxllm.checkpoint.files import (
    BEST_ITEM,
    FINALIZED,
    Weights,
    aside_name,
    best_step,
    checkpoint_dir,
    has_train_state,
    latest_step,
    manager,
    read_json_item,
    restore_weights,
    save_params,
    set_aside,
    steps,
    sync,
    tokenizer_record,
)
from jaxllm.checkpoint.trainer import METRICS_ITEM, Checkpointer

__all__ = [
    "BEST_ITEM",
    "FINALIZED",
    "METRICS_ITEM",
    "Checkpointer",
    "Weights",
    "aside_name",
    "best_step",
    "checkpoint_dir",
    "has_train_state",
    "latest_step",
    "manager",
    "read_json_item",
    "restore_weights",
    "save_params",
    "set_aside",
    "steps",
    "sync",
    "tokenizer_record",
]
