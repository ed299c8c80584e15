"""The train step's gradients through the pipeline (`mesh.stage` > 1).

The model's layer stack (`params['layers']`, or an MoE model's `moe_layers` groups; the `layers`
logical axis, split over the `stage` mesh axis) is cut into stage * virtual_stages chunks;
`stage_function` runs one chunk as a virtual pipeline stage: the first one also embeds the
microbatch's tokens (`Transformer.inputs`) and runs an MoE model's dense prefix, the last one
also applies the final norm and head (`Transformer.outputs`) and the objective, whose sums it
returns. The embedding, final norm and head enter the stages whole (between steps the embedding
and head are split over the stages too, by the `embed` rule) and are used by the first and last
stage only; their gradients are summed over the stages. `jaxllm.parallel.pipeline.run` runs the
schedule's table with it.

Only token-level objectives (`next_token`, `sft`) run pipelined (`jaxllm.config.pipeline`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm import parallel, sharding
from jaxllm.model import merge_model
from jaxllm.objectives import Objective
from jaxllm.parallel import pipeline, schedules
from jaxllm.sharding import Parallel


def stack_name(cfg) -> str:
    """The parameter subtree split over the stages: the blocks, or an MoE model's groups."""
    return "moe_layers" if cfg.moe.enabled else "layers"


def dense_prefix(cfg) -> int:
    """An MoE model's leading dense blocks (`layers`), run by the first stage after the
    embedding."""
    return cfg.moe.first_dense_layers if cfg.moe.enabled else 0


def moe_groups(cfg) -> int:
    """An MoE model's `MoEGroup`s (moe_every - 1 dense blocks, then an MoE block): the stack
    the stages split."""
    return (cfg.num_layers - cfg.moe.first_dense_layers) // cfg.moe.moe_every


class _Head:
    """Stands in for the model in the objective: returns the last stage's outputs (the head's
    input alone with `hidden_only`, and `head_logits` for a loss computed in chunks)."""

    def __init__(self, model, x_BxLxD):
        self.cfg, self._model, self._x = model.cfg, model, x_BxLxD

    def __call__(self, *args, hidden_only=False, **kwargs):
        return self._model.outputs(self._x, hidden_only=hidden_only)

    def head_logits(self, x_BxLxD):
        return self._model.head_logits(x_BxLxD)


def _split(tree, name: str):
    """(the stacked blocks `name`, everything else) of a params / frozen / model-state dict."""
    tree = tree or {}
    return tree.get(name, {}), {k: v for k, v in tree.items() if k != name}


def _join(stack, rest, name: str):
    return {**rest, name: stack} if stack else dict(rest)


def _moe_terms(cfg, stats, batch, c, groups: int):
    """(loss term, metric sums, model stats) of one virtual stage's MoE layers (`groups` of
    them, one per `MoEGroup`), laid out as the whole model's `moe.objective_terms` would give
    them, so that the stages' sums add up to the unpipelined objective's: the balancing and
    z-losses as this chunk's share of the mean over all MoE layers, its expert loads in its rows
    of [N_moe, E]."""
    count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    n = moe_groups(cfg)
    aux_sum = jnp.sum(stats["aux_loss"]) / n * count
    z_sum = jnp.sum(stats["router_z_loss"]) / n * count
    term = cfg.moe.aux_loss_weight * aux_sum + cfg.moe.router_z_loss_weight * z_sum
    counts = stats["expert_counts"]
    full = jnp.zeros((n, *counts.shape[1:]), counts.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, counts, c * groups, axis=0)
    metrics = {"moe_aux_loss": aux_sum, "moe_router_z_loss": z_sum}
    return term, metrics, {"expert_counts": full, "dropped": jnp.sum(stats["dropped"])}


def _gathered_table(rest):
    """XLA's SPMD partitioner aborts on the embedding gather inside the stages when the table is
    split over its embed dim (fsdp): the stage function gathers it over that dim first (as FSDP does
    for the lookup anyway), still split over `vocab`."""
    table = rest.get("embed", {}).get("embedding")
    if table is None:
        return rest
    return dict(
        rest, embed=dict(rest["embed"], embedding=sharding.constrain(table, ("vocab", None)))
    )


def stage_function(graphdef, objective: Objective, cfg, chunks: int):
    """`stage_fn(train, const, x, mb, c)` of `pipeline.run` for a model of `cfg` cut into
    `chunks` virtual stages: train = (stack chunk, rest) of the trainable parameters, const =
    ((frozen chunk, state chunk), {frozen, state, batch, key}) of the rest."""
    prefix = dense_prefix(cfg)
    per_chunk = (cfg.num_layers - prefix) // chunks  # blocks of one virtual stage
    remat = cfg.remat != "none"
    name = stack_name(cfg)

    def stage_fn(train, const, x_BxLxD, mb, c):
        (t_stack, t_rest), ((f_stack, s_stack), c_rest) = train, const
        t_rest = _gathered_table(t_rest)
        c_rest = dict(c_rest, frozen=_gathered_table(c_rest["frozen"]))
        model = merge_model(
            graphdef,
            _join(t_stack, t_rest, name),
            _join(f_stack, c_rest["frozen"], name) or None,
            _join(s_stack, c_rest["state"], name),
        )
        batch = jax.tree.map(lambda a: a[mb], c_rest["batch"])
        batch = jax.tree.map(lambda a: sharding.constrain(a, ("batch", "length")), batch)
        rng = jax.random.fold_in(jax.random.wrap_key_data(c_rest["key"]), mb)
        pos_BxL, seg_BxL = batch["positions"], batch["segment_ids"]

        keys = model.inputs(batch["inputs"], pos_BxL, seg_BxL, None, rng)[3]
        all_layers = model.per_layer(keys)

        def embed():
            x = model.inputs(batch["inputs"], pos_BxL, seg_BxL, None, rng)[0]
            if prefix:  # an MoE model's leading dense blocks
                first = jax.tree.map(lambda a: a[:prefix], all_layers)
                (x, _), _ = model.scan(model.layers, (x, None), first, pos_BxL, seg_BxL, remat)
            return x.astype(x_BxLxD.dtype)

        x_BxLxD = jax.lax.cond(c == 0, embed, lambda: x_BxLxD)
        per_layer = jax.tree.map(
            lambda a: jax.lax.dynamic_slice_in_dim(a, prefix + c * per_chunk, per_chunk),
            all_layers,
        )
        if cfg.moe.enabled:  # the chunk's MoE groups
            (x_BxLxD, _), stats = model.moe_scan(
                model.moe_layers, (x_BxLxD, None), per_layer, pos_BxL, seg_BxL, remat
            )
        else:
            (x_BxLxD, _), _ = model.scan(
                model.layers, (x_BxLxD, None), per_layer, pos_BxL, seg_BxL, remat
            )

        def head(x_BxLxD):
            out = objective(_Head(model, x_BxLxD), batch, rng)
            return (jnp.zeros_like(x_BxLxD), out.loss_sum.astype(jnp.float32)), out

        def middle(x_BxLxD):
            shapes = jax.eval_shape(head, x_BxLxD)[1]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return (x_BxLxD, jnp.zeros((), jnp.float32)), zeros

        (y, loss), out = jax.lax.cond(c == chunks - 1, head, middle, x_BxLxD)
        if cfg.moe.enabled:  # every stage adds its own layers' balancing losses and loads
            term, metrics, moe_stats = _moe_terms(
                cfg, stats, batch, c, per_chunk // cfg.moe.moe_every
            )
            loss = loss + term
            out = out._replace(
                loss_sum=out.loss_sum + term,
                metrics={**out.metrics, **metrics},
                model_stats=moe_stats,
            )
        return (y, loss), out

    return stage_fn


def grads_and_sums(
    params,
    frozen,
    model_state,
    micro: dict,
    step_key,
    *,
    graphdef,
    objective: Objective,
    parallel_settings: Parallel,
    seed,
):
    """(float32 gradients like `params`, summed ObjectiveOutput) of `objective` over the
    microbatches `micro` ([m, rows, ...] leaves), run through the pipeline of
    `parallel_settings` (its mesh's `stage` axis, schedule and virtual stages)."""
    m = jax.tree.leaves(micro)[0].shape[0]
    # Ring attention's zigzag order, as `train.step` lays out each batch; here before the stages
    # (a gather of the sequence-sharded batch inside the stage region aborts XLA's partitioner).
    micro = jax.vmap(parallel.sequence_layout)(micro)
    p, v = parallel_settings.stages, parallel_settings.virtual_stages
    table = schedules.build(parallel_settings.pipeline_schedule, p, m, v)
    model = merge_model(graphdef, params, frozen, model_state)
    cfg = model.cfg
    rows, length = micro["inputs"].shape[1:3]
    act = jax.ShapeDtypeStruct((rows, length, cfg.d_model), jnp.dtype(cfg.dtype))
    first = jax.tree.map(lambda a: a[0], micro)
    sums_like = jax.eval_shape(lambda: objective(model, first, jax.random.key(0)))
    sums_like = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_like)
    name = stack_name(cfg)
    t_stack, t_rest = _split(params, name)
    f_stack, f_rest = _split(frozen, name)
    s_stack, s_rest = _split(model_state, name)
    const_rest = {"frozen": f_rest, "state": s_rest, "batch": micro, "key": step_key}
    stage_fn = stage_function(graphdef, objective, cfg, table.chunks)
    (d_stack, d_rest), sums = pipeline.run(
        table,
        stage_fn,
        (t_stack, t_rest),
        ((f_stack, s_stack), const_rest),
        mesh=parallel_settings.mesh,
        act=act,
        sums_like=sums_like,
        seed=seed,
    )
    return _join(d_stack, d_rest, name), sums
