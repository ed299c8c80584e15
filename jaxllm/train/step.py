"""The pure train and eval steps: `train_step(state, batch) -> (state, metrics)`.

Static pieces (model graph, optimizer, schedule, objective, parallel settings) are bound with
`functools.partial` before `jax.jit`, so the jitted function takes exactly (state, batch). The
step never names a loss: an `Objective` (`jaxllm.objectives`) gives the sums of one
microbatch, gradient accumulation scans over microbatches inside the step and normalises by the
token count of the whole global batch, so it equals one big batch exactly (up to float
summation order). The model's own statistics (MoE expert loads) go back to the model after the
update (`Transformer.after_step`), which moves its non-trained state (router biases).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxllm import parallel, sharding
from jaxllm.model import fp8_delayed, merge_model
from jaxllm.objectives import Objective, ObjectiveOutput
from jaxllm.optim.freeze import stop_frozen
from jaxllm.parallel.grad_compression import Compression
from jaxllm.sharding import Parallel
from jaxllm.train import companions, pipelined
from jaxllm.train.loss_scale import LossScaling
from jaxllm.train.state import TrainState

BATCH_AXES = ("batch", "length")


def objective_value(
    params,
    batch: dict,
    rng,
    *,
    graphdef,
    objective: Objective,
    model_state=None,
    frozen=None,
    others=None,
    other_graphdefs=None,
    weights=None,
):
    """(loss sum, ObjectiveOutput) of `objective` on `batch` with these parameters: the
    function the step differentiates. An objective that names frozen models
    (`objective.others`) also gets them, built from `others` (`TrainState.others`) and their
    `other_graphdefs` (`jaxllm.train.companions`). `weights`: params -> the params the model
    computes with (QAT's fake quantization, `jaxllm.compress.qat`), or None."""
    batch = parallel.sequence_layout(batch)
    if weights is not None:
        params = weights(params)
    model = merge_model(graphdef, params, frozen, model_state)
    wanted = companions.names(objective)
    if not wanted:
        return _checked(objective(model, batch, rng), objective)
    held = companions.modules(
        wanted,
        other_graphdefs or {},
        others,
        graphdef=graphdef,
        params=params,
        frozen=frozen,
        model_state=model_state,
    )
    return _checked(objective(model, batch, rng, held), objective)


def _checked(out, objective) -> tuple[jax.Array, ObjectiveOutput]:
    """(loss sum, out), or a TypeError naming the objective when it returned something else
    (often a factory passed uncalled: `jaxllm.next_token` instead of `jaxllm.next_token()`)."""
    if not isinstance(out, ObjectiveOutput):
        name = getattr(objective, "__qualname__", repr(objective))
        raise TypeError(
            f"objective {name} returned {type(out).__name__}, not jaxllm.ObjectiveOutput; an "
            "objective is called as objective(model, batch, rng) (call factories such as "
            "jaxllm.next_token first: objective=jaxllm.next_token())."
        )
    return out.loss_sum, out


def _microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each microbatch spans all data shards."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def _accumulated(grad_fn, params, micro: dict, step_key, grad_shardings=None):
    """(gradient sums, objective sums, largest fp8 amaxes) over the microbatches `micro` ([n,
    ...] leaves), scanned inside the step; microbatch i draws its randomness from
    fold_in(step_key, i). `grad_fn` gives (gradients, objective output, amaxes)
    (`fp8_delayed`: {} without delayed fp8 scaling)."""

    def accumulate(carry, xs):
        grads, sums, amax = carry
        i, mb = xs
        mb = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), mb)
        g, out, a = grad_fn(params, mb, jax.random.fold_in(step_key, i))
        grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
        sums = jax.tree.map(jnp.add, sums, out)
        return (grads, sums, jax.tree.map(jnp.maximum, amax, a)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if grad_shardings is not None:  # like their parameters, or split further (ZeRO-2)
        zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
    # The accumulator's shapes, from a forward trace of the first microbatch.
    first = jax.tree.map(lambda x: x[0], micro)
    _, shapes, amax_shapes = jax.eval_shape(grad_fn, params, first, step_key)
    sum_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    amax_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), amax_shapes)
    n = jax.tree.leaves(micro)[0].shape[0]
    carry = (zeros, sum_zeros, amax_zeros)
    (grads, sums, amax), _ = jax.lax.scan(accumulate, carry, (jnp.arange(n), micro))
    return grads, sums, amax


def compressed_grads(
    grad_fn, state, batch, step_key, compression, grad_accum_steps, parallel_settings, unscale
):
    """(mean gradient, objective sums, new `grad_comp` state, fp8 amaxes) of `batch` with the gradient
    exchange of `compression` (`jaxllm.parallel.grad_compression`): under a shard_map manual
    over the `data` axis each replica runs the model whole on its rows, divides its gradient
    sum by the global token count (times `unscale`, the loss scale per position, or 1), and
    the replicas' compressed shares are gathered and added. The other mesh axes have size 1
    (`train.grad_compression` refuses them), so everything but the batch is replicated."""
    mesh = parallel_settings.mesh
    batch_spec = sharding.spec(BATCH_AXES)
    comp_spec = jax.tree.map(lambda _: PartitionSpec("data"), state.grad_comp)
    # the qsgd draws: a function of the seed and the step, and different per replica
    comp_key = jax.random.fold_in(step_key, 0x67726164)  # "grad"

    def per_replica(params, batch, comp_state, comp_key, unscale, step):
        replica = jax.lax.axis_index("data")
        with sharding.active(Parallel()):  # the model is whole here: plain per-device code
            micro = _microbatches(batch, grad_accum_steps)
            key = jax.random.fold_in(step_key, replica)  # dropout differs per replica
            grads, sums, amax = _accumulated(grad_fn, params, micro, key)
        sums, amax = jax.lax.psum(sums, "data"), jax.lax.pmax(amax, "data")
        denom = jnp.maximum(sums.tokens, 1.0) * unscale
        share = jax.tree.map(lambda g: g / denom, grads)
        key = jax.random.fold_in(comp_key, replica)
        grads, comp_state = compression.exchange(share, comp_state, key, "data", step)
        return grads, sums, comp_state, amax

    return jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), batch_spec, comp_spec, *[PartitionSpec()] * 3),
        out_specs=(PartitionSpec(), PartitionSpec(), comp_spec, PartitionSpec()),
        check_vma=False,
    )(state.params, batch, state.grad_comp, comp_key, unscale, state.step)


def train_step(
    state: TrainState,
    batch: dict,
    *,
    graphdef,
    tx,
    lr_schedule,
    objective: Objective,
    parallel_settings: Parallel = Parallel(),
    grad_accum_steps: int = 1,
    grad_shardings=None,
    offload_opt_state: bool = False,
    offload_params: bool = False,
    loss_scaling: LossScaling | None = None,
    other_graphdefs=None,
    weights=None,
    compression: Compression | None = None,
    freeze_mask=None,
) -> tuple[TrainState, dict]:
    """One optimizer step of `objective` on `batch` (the global batch, split into
    `grad_accum_steps` microbatches). Metrics: the objective's (sum / tokens), `nonfinite`,
    `grad_norm`, `param_norm`, `lr`, `tokens`, the model's (MoE loads), and `loss_scale` (the
    scale this step used) with `loss_scaling`. With `compression` the data replicas exchange
    compressed gradients (`compressed_grads`) and their state moves in `state.grad_comp`.
    `freeze_mask` (`train.freeze`: bools over the params) stops the gradients of those marked."""
    if offload_params:  # kept in host memory between steps; used and updated on the device
        state = state.replace(params=jax.device_put(state.params, jax.memory.Space.Device))
    with sharding.active(parallel_settings):
        scale = None if loss_scaling is None else loss_scaling.scale(state.loss_scale)
        # S scales the loss per token position of a microbatch, as it would scale a mean loss:
        # the objective's sum would make the weight gradients, sums over all those tokens, as
        # many times larger, so the scale that fits float16 would shrink with the batch.
        positions = jax.tree.leaves(batch)[0].size // grad_accum_steps  # leaves are [B, L]

        # model.fp8_scaling=delayed: the amax histories are differentiated too; what comes
        # back for them is each use's amaxes (`fp8_delayed`), recorded after the update.
        histories = fp8_delayed.histories(state.model_state)

        def loss_fn(p, h, mb, rng):
            loss, out = objective_value(
                stop_frozen(p, freeze_mask),
                mb,
                rng,
                graphdef=graphdef,
                objective=objective,
                model_state=fp8_delayed.with_histories(state.model_state, h),
                frozen=state.frozen,
                others=state.others,
                other_graphdefs=other_graphdefs,
                weights=weights,
            )
            # Scaled before differentiation: the backward pass runs S times larger, above
            # float16's underflow; the sums in `out` stay unscaled.
            return (loss if scale is None else loss * (scale / positions)), out

        def grad_fn(p, mb, rng):
            (grads, amax), out = jax.grad(loss_fn, (0, 1), has_aux=True)(p, histories, mb, rng)
            return grads, out, amax

        amax = {}
        micro = _microbatches(batch, grad_accum_steps)

        # Dropout masks differ per step and microbatch, and are a function of (seed, step), so
        # a resumed run draws the same ones.
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        if parallel_settings.stages > 1:  # the microbatches stream through the stages
            micro = jax.tree.map(lambda x: sharding.constrain(x, (None, *BATCH_AXES)), micro)
            grads, sums = pipelined.grads_and_sums(
                state.params,
                state.frozen,
                state.model_state,
                micro,
                jax.random.key_data(step_key),
                graphdef=graphdef,
                objective=objective,
                parallel_settings=parallel_settings,
                seed=1.0 if scale is None else scale / positions,
            )
            if grad_shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        elif compression is not None:  # each data replica's share, compressed and exchanged
            grads, sums, grad_comp, amax = compressed_grads(
                grad_fn,
                state,
                batch,
                step_key,
                compression,
                grad_accum_steps,
                parallel_settings,
                1.0 if scale is None else scale / positions,
            )
        else:
            grads, sums, amax = _accumulated(grad_fn, state.params, micro, step_key, grad_shardings)

        count = jnp.maximum(sums.tokens, 1.0)
        # Unscaled in float32 (the accumulator's dtype), before clipping and the optimizer;
        # the compressed exchange has divided each replica's share already.
        denom = count if scale is None else count * (scale / positions)
        denom = 1.0 if compression is not None else denom
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, state.params)
        if freeze_mask is not None:  # zeros already, but for the pipeline's own backward pass
            grads = jax.tree.map(lambda g, m: jnp.zeros_like(g) if m else g, grads, freeze_mask)
        grad_norm = optax.tree.norm(grads)
        old_opt_state = state.opt_state
        if offload_opt_state:  # kept in host memory between steps; updated on the device
            old_opt_state = jax.device_put(old_opt_state, jax.memory.Space.Device)
        updates, opt_state = tx.update(grads, old_opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A NaN/Inf loss or gradient never reaches the state, nor does an update that turns
        # finite parameters non-finite (a NaN learning rate, an overflow): keep the old params
        # and moments, so a stop checkpoint holds the last finite parameters. With dynamic loss
        # scaling this is also the overflow check: such a step backs the scale off.
        finite = jnp.isfinite(sums.loss_sum)
        for value in sums.metrics.values():
            finite &= jnp.all(jnp.isfinite(value))
        finite &= jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(params))
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state),
            (state.params, old_opt_state),
        )
        if compression is not None:  # nor do the residuals move
            grad_comp = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), grad_comp, state.grad_comp
            )
        else:
            grad_comp = state.grad_comp
        if offload_opt_state:
            opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
        param_norm = optax.tree.norm(params)
        metrics = {k: v / count for k, v in sums.metrics.items()}
        metrics.update(
            nonfinite=1.0 - finite.astype(jnp.float32),
            grad_norm=grad_norm,
            param_norm=param_norm,
            lr=jnp.asarray(lr_schedule(state.step), jnp.float32),
            tokens=count,
        )
        if scale is not None:
            metrics["loss_scale"] = scale
        model = merge_model(graphdef, state.params, state.frozen, state.model_state)
        model_state, model_metrics = model.after_step(state.model_state, sums.model_stats, finite)
        if histories:
            recorded = fp8_delayed.recorded(histories, amax, finite)
            model_state = fp8_delayed.with_histories(model_state, recorded)
        metrics.update(model_metrics)
        new_state = state.replace(
            step=state.step + 1,
            params=jax.device_put(params, jax.memory.Space.Host) if offload_params else params,
            opt_state=opt_state,
            model_state=model_state,
            grad_comp=grad_comp,
            loss_scale=state.loss_scale
            if loss_scaling is None
            else loss_scaling.update(state.loss_scale, finite),
        )
        return new_state, metrics


def eval_step(
    params,
    batch: dict,
    model_state=None,
    frozen=None,
    others=None,
    *,
    graphdef,
    objective: Objective,
    parallel_settings: Parallel = Parallel(),
    other_graphdefs=None,
    weights=None,
    offload_params: bool = False,
) -> dict:
    """Sums for a held-out batch: `tokens` and every metric of the objective (`loss` is its
    `loss` metric, or its loss sum when it has none); the caller adds them over batches and
    divides each by the summed `tokens` (`jaxllm.train.compiled.evaluate`). `offload_params`:
    `params` arrive in host memory and are copied to the device first."""
    if offload_params:
        params = jax.device_put(params, jax.memory.Space.Device)
    with sharding.active(parallel_settings):
        batch = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), batch)
        _, out = objective_value(
            params,
            batch,
            None,
            graphdef=graphdef,
            objective=objective,
            model_state=model_state,
            frozen=frozen,
            others=others,
            other_graphdefs=other_graphdefs,
            weights=weights,
        )
        return {**out.metrics, "loss": out.metrics.get("loss", out.loss_sum), "tokens": out.tokens}
