"""How `jaxllm train` starts its state: resumed from the newest readable checkpoint, or
initialised from `checkpoint.init_from` / an imported checkpoint, or fresh."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxllm import adapters, checkpoint, config
from jaxllm.config.optim import resolved_lr
from jaxllm.model import abstract_model
from jaxllm.train import loss_scale
from jaxllm.train.console import _log
from jaxllm.train.state import init_state, init_state_from, layout, on_device


def _init_source(cfg: config.Config, ckpt_dir: Path) -> str | None:
    """Where a fresh run's parameters come from: `checkpoint.init_from`, else a weights-only
    checkpoint in the run's own directory (what `jaxllm convert import` writes), else None."""
    if cfg.checkpoint.init_from:
        return cfg.checkpoint.init_from
    steps = checkpoint.steps(ckpt_dir)
    if steps and not checkpoint.has_train_state(ckpt_dir, steps[-1]):
        return str(ckpt_dir / str(steps[-1]))
    return None


def start_state(cfg, ckpt: checkpoint.Checkpointer, mesh, tx, shardings, batches, base):
    """(state, step): the state resumed from the newest readable checkpoint, or initialised
    from `checkpoint.init_from` / an imported checkpoint, or fresh. A PEFT run's frozen base
    comes from `base` (`adapters.base_record`), the one its checkpoints record."""
    o = cfg.optim
    if o.lr_scaling != "none":
        ratio = f"{cfg.train.global_batch_size}/{o.reference_batch_size}"
        _log(
            f"lr {resolved_lr(o, cfg.train.global_batch_size):.4g}: optim.lr {o.lr:g} x "
            f"{'' if o.lr_scaling == 'linear' else 'sqrt '}({ratio}) (optim.lr_scaling="
            f"{o.lr_scaling}, global batch / optim.reference_batch_size)"
        )
    restored = None
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    if cfg.checkpoint.resume and not cfg.checkpoint.start_fresh:
        abstract = jax.eval_shape(
            lambda: init_state(cfg.model, tx, mesh, cfg.run.seed, scaling, **layout(cfg))
        )
        abstract = jax.tree.map(  # the frozen models are loaded, never restored
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract,
            shardings.replace(others=None),
        )
        restored = ckpt.restore_latest(abstract, optimizer=not cfg.checkpoint.reset_optimizer)
    if restored is not None:
        state, data_state, start = restored
        if cfg.checkpoint.reset_optimizer:
            init_opt = jax.jit(tx.init, out_shardings=shardings.opt_state)
            state = state.replace(opt_state=init_opt(on_device(state.params)))
            _log(f"checkpoint.reset_optimizer: a fresh {cfg.optim.name} state at step {start}")
        if base is not None:
            adapters.check_base(
                checkpoint.read_json_item(ckpt.directory, start, adapters.BASE_ITEM), base
            )
            state = state.replace(frozen=adapters.load_frozen(cfg, mesh, base))
        batches.set_state(data_state)
        tier = " (copied from checkpoint.local_dir)" if start in ckpt.promoted else ""
        _log(f"resumed from step {start} ({ckpt.directory.resolve()}/{start}){tier}")
        if scaling is not None and scaling.dynamic and state.loss_scale is None:
            # A checkpoint of a run without dynamic loss scaling: the scale starts afresh.
            state = state.replace(
                loss_scale=jax.device_put(scaling.initial(), shardings.loss_scale)
            )
            _log(f"the checkpoint has no loss scale; starting at {scaling.init:g}")
    elif (source := _init_source(cfg, ckpt.directory)) is not None:
        # a fine-tuning run's merged model, or its base and adapters (checkpoint.init_adapters)
        w = adapters.starting_weights(cfg, source, mesh, base, ckpt.directory)
        kw = dict(layout(cfg), adapters=w.adapters)
        state = init_state_from(
            w.params, cfg.model, tx, mesh, cfg.run.seed, w.model_state, scaling, **kw
        )
        start, fresh = 0, sorted(set(abstract_model(cfg.model)[1]) - set(w.params))
        new = f"; {', '.join(fresh)} fresh from run.seed={cfg.run.seed}" if fresh else ""
        _log(f"initialized parameters from {source}{w.how}{new}")
    else:
        state, start = init_state(cfg.model, tx, mesh, cfg.run.seed, scaling, **layout(cfg)), 0
    return state, start
