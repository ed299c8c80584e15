"""The jitted train and eval steps of a config, and evaluation over held-out batches: what
`jaxllm train`, `plan`, `bench` and `eval` compile the same way."""

from __future__ import annotations

import functools

import jax

from jaxllm import config, objectives, optim, sharding
from jaxllm.compress import qat
from jaxllm.config.grad_compression import step_optim
from jaxllm.config.pipeline import microbatches
from jaxllm.model import abstract_model
from jaxllm.model.groups import freeze_mask
from jaxllm.parallel.grad_compression import Compression
from jaxllm.sharding import to_global
from jaxllm.train import companions, determinism, loss_scale, overlap
from jaxllm.train.state import grad_shardings, layout, sparse_weights, state_shardings
from jaxllm.train.step import BATCH_AXES, eval_step, train_step


def check_param_groups(cfg: config.Config) -> None:
    """ConfigError when an `optim.param_groups` entry holds no parameter of the model."""
    optim.groups.frozen_mask(abstract_model(cfg.model, cfg.peft)[1], cfg.optim.param_groups)


def compile_steps(cfg: config.Config, mesh):
    """(train_step, eval_step, tx, shardings): jitted once with explicit shardings and donation."""
    if cfg.model.remat == "auto":  # a training step needs a policy (`jaxllm.train.remat_auto`)
        raise ValueError("model.remat=auto is resolved by remat_auto.resolve before compiling")
    graphdef, abstract, axes = abstract_model(cfg.model, cfg.peft)
    weights = qat.transform(abstract, axes, cfg.train.qat)  # None unless train.qat
    o = optim.resolve(step_optim(cfg), cfg.train.global_batch_size)  # lr_scaling applied
    frozen = freeze_mask(abstract, cfg.train.freeze, cfg.peft.method)  # None: all train
    frozen = optim.groups.frozen_mask(abstract, o.param_groups, frozen)  # and lr_scale 0
    tx = optim.build(o, cfg.train.steps, axes, sparse_weights(cfg, axes), cfg.run.seed, frozen)
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    batch_sh = sharding.named(mesh, BATCH_AXES)
    objective = objectives.from_config(cfg)
    held = companions.resolve_others(cfg, objective)  # a reference, a teacher
    shardings = state_shardings(cfg.model, tx, mesh, scaling, **layout(cfg))
    shardings = shardings.replace(others=companions.shardings(held, mesh))
    other_graphdefs = companions.graphdefs(held)
    parallel_settings = sharding.Parallel.of(mesh, cfg.mesh)
    step_fn = functools.partial(
        train_step,
        graphdef=graphdef,
        tx=tx,
        lr_schedule=optim.schedule(o, cfg.train.steps),
        objective=objective,
        parallel_settings=parallel_settings,
        grad_accum_steps=microbatches(cfg),
        grad_shardings=grad_shardings(cfg.model, mesh, cfg.mesh.zero_stage, cfg.peft),
        offload_opt_state=cfg.optim.offload == "host",
        offload_params=cfg.model.param_offload == "host",
        loss_scaling=scaling,
        other_graphdefs=other_graphdefs,
        weights=weights,
        compression=Compression.of(cfg),
        freeze_mask=frozen,
    )
    if o.param_groups:
        step_fn = _with_group_lrs(step_fn, o.param_groups)
    platform = mesh.devices.flat[0].platform
    platform = "gpu" if platform == "cuda" else platform
    options = overlap.compiler_options(cfg.mesh.overlap, platform)
    options |= determinism.compiler_options(cfg.train.deterministic, platform)
    exact = functools.partial(determinism.full_precision, deterministic=cfg.train.deterministic)
    jit_train = jax.jit(
        exact(step_fn),
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, None),
        donate_argnums=0,
        compiler_options=options or None,
    )
    jit_eval = jax.jit(
        exact(
            functools.partial(
                eval_step,
                graphdef=graphdef,
                objective=objective,
                parallel_settings=parallel_settings,
                other_graphdefs=other_graphdefs,
                weights=weights,
                offload_params=cfg.model.param_offload == "host",
            )
        ),
        compiler_options=options or None,
        in_shardings=(
            shardings.params,
            batch_sh,
            shardings.model_state,
            shardings.frozen,
            shardings.others,
        ),
    )
    return jit_train, jit_eval, tx, shardings, batch_sh


def _with_group_lrs(step_fn, groups):
    """`step_fn` whose metrics add each training group's learning rate (`lr/group_I`)."""

    def step(state, batch):
        state, metrics = step_fn(state, batch)
        return state, metrics | optim.groups.group_lrs(groups, metrics["lr"])

    return step


def evaluate(
    jit_eval, params, batches: list[dict], batch_sh, model_state=None, frozen=None, others=None
) -> dict[str, float]:
    """{'eval_loss', 'eval_<metric>' ...}: every metric of the objective over the held-out
    `batches`, its sum divided by the summed `tokens` (as training logs them)."""
    global_rows = len(batches[0]["inputs"]) * jax.process_count() if batches else 0
    model_state = {} if model_state is None else model_state
    sums = [
        jit_eval(params, to_global(b, batch_sh, global_rows), model_state, frozen, others)
        for b in batches
    ]
    totals = {k: sum(float(s[k]) for s in sums) for k in (sums[0] if sums else {"loss": 0})}
    tokens = max(totals.pop("tokens", 0.0), 1.0)
    return {f"eval_{k}": v / tokens for k, v in totals.items()}
