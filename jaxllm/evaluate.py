"""`jaxllm eval`: restore only the weights of a run and report loss and perplexity on a dataset.

The dataset is the run's own held-out split unless overrides name another one, e.g.
`data.eval_sources=[{path: valid.jsonl}]`.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax

from jaxllm import checkpoint, config, sharding
from jaxllm.data import check_vocab
from jaxllm.data.pipeline import eval_batches, load_splits
from jaxllm.train.loop import evaluate, process_rows
from jaxllm.model import abstract_model, abstract_model_state
from jaxllm.train.step import BATCH_AXES, eval_step


def resolve(path: str | Path) -> tuple[Path, Path, int | None]:
    """A run directory, its checkpoints directory, or one step's directory ->
    (run dir, checkpoints dir, step or None for the newest)."""
    path = Path(path)
    for run_dir, ckpt_dir, step in (
        (path, None, None),
        (path.parent, path, None),
        (path.parent.parent, path.parent, path.name),
    ):
        if (run_dir / "config.yaml").is_file():
            if step is not None and not step.isdigit():
                continue
            return run_dir, ckpt_dir, None if step is None else int(step)
    raise config.ConfigError(
        f"{path} is not a run directory, its checkpoints directory, or a checkpoint step in one."
    )


def restore(path, overrides=()):
    """A run directory / checkpoint path -> (config, mesh, graphdef, params, model_state, step):
    the newest readable (or the named) checkpoint's weights and non-trained model state (MoE routing
    biases; {} otherwise), restored straight into their shards on the configured mesh.
    ConfigError when there is nothing to restore."""
    run_dir, ckpt_dir, step = resolve(path)
    cfg = config.load(run_dir / "config.yaml", list(overrides))
    check_vocab(cfg.data, cfg.model.vocab_size)
    ckpt_dir = ckpt_dir or checkpoint.checkpoint_dir(run_dir, cfg.checkpoint.dir)
    devices = jax.devices()
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    graphdef, abstract, axes = abstract_model(cfg.model)
    sharding.check_divisible(mesh, abstract, axes)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        sharding.tree_shardings(mesh, axes),
    )
    abstract_ms, ms_axes = abstract_model_state(cfg.model)
    ms_target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_ms,
        sharding.tree_shardings(mesh, ms_axes),
    )
    params, model_state, step = checkpoint.restore_weights(ckpt_dir, target, ms_target, step)
    return cfg, mesh, graphdef, params, model_state, step


def evaluate_checkpoint(path, overrides=(), num_batches: int | None = None) -> dict:
    cfg, mesh, graphdef, params, model_state, step = restore(path, overrides)
    batch_sh = sharding.named(mesh, BATCH_AXES)
    jit_eval = jax.jit(
        functools.partial(
            eval_step, graphdef=graphdef, mesh=mesh, sequence_attention=cfg.mesh.sequence_attention,
            expert_dispatch=cfg.mesh.expert_dispatch,
        ),
        in_shardings=(
            jax.tree.map(lambda p: p.sharding, params), batch_sh,
            jax.tree.map(lambda p: p.sharding, model_state),
        ),
    )  # fmt: skip
    gbs = cfg.train.global_batch_size
    _, eval_rows = load_splits(cfg.data)
    batches = eval_batches(
        eval_rows, gbs, num_batches or cfg.train.eval_batches, process_rows(batch_sh, gbs)
    )
    loss = evaluate(jit_eval, params, batches, batch_sh, model_state)
    return {
        "step": step,
        "eval_loss": loss,
        "perplexity": math.exp(loss),
        "tokens": len(batches) * gbs * cfg.data.seq_len,
    }
