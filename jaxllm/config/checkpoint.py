"""`checkpoint`: where and how often the train state is saved, kept and resumed from."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from jaxllm.config.errors import fail as _fail
from jaxllm.config.optim import OptimConfig


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints: train state, data iterator, resolved config and tokenizer together."""

    dir: str | None = None
    """Checkpoint directory; null means `<run.dir>/checkpoints`."""
    every: int | None = None
    """Save every this many steps (asynchronously: training goes on while it is written); null
    never saves periodically, only at the end (`save_final`) and on SIGTERM / SIGINT."""
    keep: int = 3
    """Keep the newest this many checkpoints ..."""
    keep_every: int | None = None
    """... plus every checkpoint whose step is a multiple of this (null: none)."""
    keep_best: bool = False
    """... plus the best checkpoint by evaluation (`train.early_stopping.metric`, by default
    the objective's main one): a checkpoint is written at every evaluation (`train.eval_every`), each records
    the best step so far (its JSON item `best`), and retention never deletes that one.
    `--checkpoint best` of generate / eval / convert export reads it. Needs periodic
    evaluation."""
    async_save: bool = True
    """Write checkpoints in a background thread."""
    save_final: bool = True
    """Write a checkpoint of the train state when training ends."""
    resume: bool = True
    """Continue from the newest readable checkpoint in the directory, if there is one."""
    reset_optimizer: bool = False
    """Resume with a fresh optimizer state: the checkpoint's parameters, step, rng and data
    position are kept and its optimizer state is dropped, so `optim.*` may change (another
    `optim.name`, `amsgrad`, ...). Acts once, on this command's resume: the run's config.yaml
    records it as false with the new `optim.*`, and metrics.jsonl gets an `optimizer_reset`
    row at the step. Without it, a checkpoint of another optimizer is refused."""
    start_fresh: bool = False
    """Start over at step 0 in a run directory that holds checkpoints: the old run (its files,
    and `checkpoint.dir` when that lies elsewhere) is first moved aside to a sibling
    `<run.dir>.old` (`.old2`, ...), never deleted. Acts once; config.yaml records it as false."""
    init_from: str | None = None
    """A fresh run (nothing to resume) starts from these parameters instead of random ones: a
    run directory, its checkpoints directory, one step of it, or a Hugging Face model directory
    (config.json + safetensors). The model section must describe the same parameters. A
    LoRA / QLoRA run counts as its merged model (base + adapters, NF4 dequantized), unless
    `init_adapters` continues its adapters; a prompt-tuning run's soft prompt only continues."""
    init_adapters: Literal["merge", "continue"] = "merge"
    """When `init_from` is a fine-tuning run (peft) and this run has `peft` too: `merge` starts
    from that run's merged model and trains new adapters (or a new soft prompt) on it, as TRL
    does with an SFT adapter given to DPO; `continue` trains on that run's own adapters (or
    soft prompt) over its base, which needs the same peft.rank, alpha, rslora and targets (or
    num_virtual_tokens). Either way a reference (DPO, GRPO / PPO's KL) is the starting model.
    A run without peft always starts from the merged model."""
    # Tiers and compact states (README "Checkpoints"):
    local_dir: str | None = None
    """A second, fast tier (local disk): steps saved there every `local_every` steps, beside
    the persistent saves of `every`; resume takes the newest intact step of either tier."""
    local_every: int | None = None
    """Save to `local_dir` every this many steps (a step due for both goes to `dir`)."""
    incremental: bool = False
    """Write only the items that changed since the last save; unchanged ones (config,
    tokenizer, base and frozen models' records, ...) are hard-linked from their last copy."""
    quantize_opt_state: Literal["none", "int8"] = "none"
    """`int8`: the optimizer's float moments stored as blockwise absmax-scaled 8-bit codes
    (lossy: a resume continues from the dequantized moments)."""


def validate_checkpoint(
    c: CheckpointConfig, peft_method: str, run_dir: str = "", optim: OptimConfig | None = None
) -> None:
    """A period of 0, an empty directory, adapters continued without a run to continue, a
    local tier on the persistent one, quantized moments of an optimizer without any."""
    if c.every is not None and c.every < 1:
        _fail(
            f"checkpoint.every must be >= 1, not {c.every}; checkpoint.every=null saves only "
            "at the end and on a signal."
        )
    if c.keep < 1 or (c.keep_every is not None and c.keep_every < 1):
        _fail("checkpoint.keep and checkpoint.keep_every must be >= 1 (keep_every: null).")
    if c.dir is not None and not c.dir.strip():
        _fail("checkpoint.dir is empty; give a directory or null (<run.dir>/checkpoints).")
    if c.init_adapters == "continue" and (peft_method == "none" or not c.init_from):
        _fail(
            "checkpoint.init_adapters=continue trains on the adapters of the fine-tuning run "
            f"that checkpoint.init_from names (here {c.init_from or 'null'}) under this "
            f"run's peft (here peft.method={peft_method}); set both, or drop it."
        )
    if (c.local_dir is None) != (c.local_every is None):
        _fail(
            "checkpoint.local_dir and checkpoint.local_every go together (a fast tier and how "
            "often to save to it); set both, or neither."
        )
    if c.local_every is not None and c.local_every < 1:
        _fail(f"checkpoint.local_every must be >= 1, not {c.local_every}.")
    if c.local_dir is not None:
        local = Path(c.local_dir).expanduser().absolute()
        persistent = Path(c.dir or Path(run_dir) / "checkpoints").expanduser().absolute()
        if not c.local_dir.strip() or local in (Path(run_dir).absolute(), persistent):
            _fail(
                f"checkpoint.local_dir={c.local_dir!r} is not a second place: give a directory "
                "on fast local storage other than run.dir and checkpoint.dir."
            )
    if c.incremental and "://" in run_dir:
        _fail(
            "checkpoint.incremental links unchanged items between steps on one file system; a "
            f"run.dir in object storage ({run_dir}) cannot; set it to false."
        )
    if c.quantize_opt_state != "none" and optim is not None and not has_float_moments(optim):
        _fail(
            f"checkpoint.quantize_opt_state={c.quantize_opt_state}: optim.name={optim.name}"
            + (" without momentum" if optim.name == "sgd" else "")
            + " keeps no float moments to quantize; set it to none."
        )


def has_float_moments(o: OptimConfig) -> bool:
    """Whether the optimizer's state holds float moments (sgd only with momentum; adamw_8bit's
    are 8-bit already)."""
    if o.name == "sgd":
        return o.momentum > 0
    return o.name != "adamw_8bit"
