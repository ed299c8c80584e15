"""The pure train and eval steps: `train_step(state, batch) -> (state, metrics)`.

Static pieces (model graph, optimizer, schedule, mesh) are bound with `functools.partial` before
`jax.jit`, so the jitted function takes exactly (state, batch). The loss is the mean next-token
cross-entropy over tokens whose `loss_mask` is 1, computed in float32, plus an optional z-loss
(PaLM, arXiv:2204.02311). Gradient accumulation scans over microbatches inside the step and
normalises by the token count of the whole global batch, so it equals one big batch exactly
(up to float summation order).

MoE models add their load-balancing and router z-losses (weights in `MoEConfig`, each a mean
over MoE layers, weighted by the microbatch's token count so accumulation averages them), log
per-expert load statistics, and, with `bias_update_rate`, move the router balancing biases in
`TrainState.model_state` by the step's expert loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxllm import sharding
from jaxllm.config import MoEConfig
from jaxllm.model import moe as moe_lib
from jaxllm.train.state import TrainState

BATCH_AXES = ("batch", "length")


def loss_fn(params, batch: dict, graphdef, z_loss: float = 0.0, model_state=None,
            moe: MoEConfig | None = None, rng=None):  # fmt: skip
    """Sums over the batch: (objective, (nll_sum, z_sum, token_count, moe_sums)). Divide by
    the count. `moe_sums` ({} for dense models) holds the MoE losses times the token count,
    the per-layer expert loads and the dropped assignments. `rng` (training) drives dropout
    when the model has any."""
    batch = sharding.sequence_layout(batch)
    model = nnx.merge(graphdef, params, *([model_state] if model_state else []))
    logits_BxLxV, aux = model(
        batch["inputs"], positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"],
        dropout_key=rng, return_aux=True,
    )  # fmt: skip
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, batch["targets"][..., None], -1)[..., 0]
    mask_BxL = batch["loss_mask"].astype(jnp.float32)
    nll_sum = jnp.sum((logz_BxL - target_logit_BxL) * mask_BxL)
    z_sum = jnp.sum(jnp.square(logz_BxL) * mask_BxL)
    count = jnp.sum(mask_BxL)
    objective = nll_sum + z_loss * z_sum
    moe_sums = {}
    if aux:
        moe = moe or MoEConfig()
        moe_sums = {
            "aux_loss": aux["aux_loss"] * count,
            "router_z_loss": aux["router_z_loss"] * count,
            "expert_counts": aux["expert_counts"],
            "dropped": aux["dropped"],
        }
        objective += moe.aux_loss_weight * moe_sums["aux_loss"]
        objective += moe.router_z_loss_weight * moe_sums["router_z_loss"]
    return objective, (nll_sum, z_sum, count, moe_sums)


def _microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each microbatch spans all data shards."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def train_step(
    state: TrainState, batch: dict, *, graphdef, tx, lr_schedule, mesh=None,
    grad_accum_steps: int = 1, z_loss: float = 0.0, sequence_attention: str = "all_gather",
    param_shardings=None, moe: MoEConfig | None = None, expert_dispatch: str = "annotations",
) -> tuple[TrainState, dict]:  # fmt: skip
    with sharding.active(sharding.Parallel(mesh, sequence_attention, expert_dispatch)):
        loss = functools.partial(loss_fn, graphdef=graphdef, z_loss=z_loss, moe=moe)
        grad_fn = jax.grad(loss, has_aux=True)
        micro = _microbatches(batch, grad_accum_steps)

        # Dropout masks differ per step and microbatch, and are a function of (seed, step), so
        # a resumed run draws the same ones.
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def accumulate(carry, xs):
            grads, nll, zs, count, moe_sums = carry
            i, mb = xs
            mb = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), mb)
            rng = jax.random.fold_in(step_key, i)
            g, (nll_i, z_i, count_i, moe_i) = grad_fn(
                state.params, mb, model_state=state.model_state, rng=rng
            )
            grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
            moe_sums = jax.tree.map(jnp.add, moe_sums, moe_i)
            return (grads, nll + nll_i, zs + z_i, count + count_i, moe_sums), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        if param_shardings is not None:  # gradients live sharded like their parameters (ZeRO)
            zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
        moe_zeros = {}
        if moe is not None and moe.enabled:  # the accumulator's shapes, from a forward trace
            first = jax.tree.map(lambda x: x[0], micro)
            moe_shapes = jax.eval_shape(loss, state.params, first, model_state=state.model_state)
            moe_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), moe_shapes[1][3])
        init = (zeros, jnp.zeros(()), jnp.zeros(()), jnp.zeros(()), moe_zeros)
        (grads, nll, zs, count, moe_sums), _ = jax.lax.scan(
            accumulate, init, (jnp.arange(grad_accum_steps), micro)
        )

        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, state.params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A NaN/Inf loss or gradient never reaches the state, nor does an update that turns
        # finite parameters non-finite (a NaN learning rate, an overflow): keep the old params
        # and moments, so a stop checkpoint holds the last finite parameters.
        finite = (jnp.isfinite(nll) & jnp.isfinite(zs) & jnp.isfinite(grad_norm)
                  & jnp.isfinite(optax.tree.norm(params)))  # fmt: skip
        params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state), (state.params, state.opt_state),
        )  # fmt: skip
        metrics = {
            "loss": nll / count,
            "z_loss": zs / count,
            "nonfinite": 1.0 - finite.astype(jnp.float32),
            "grad_norm": grad_norm,
            "param_norm": optax.tree.norm(params),
            "lr": jnp.asarray(lr_schedule(state.step), jnp.float32),
            "tokens": count,
        }
        model_state = state.model_state
        if moe_sums:
            metrics["moe_aux_loss"] = moe_sums["aux_loss"] / count
            metrics["moe_router_z_loss"] = moe_sums["router_z_loss"] / count
            metrics.update(moe_lib.load_metrics(moe_sums["expert_counts"], moe_sums["dropped"]))
            if moe is not None and moe.bias_update_rate > 0:
                new_ms = moe_lib.update_router_bias(
                    model_state, moe_sums["expert_counts"], moe.bias_update_rate
                )
                model_state = jax.tree.map(
                    lambda new, old: jnp.where(finite, new, old), new_ms, model_state
                )
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state
        )
        return new_state, metrics


def eval_step(
    params, batch: dict, model_state=None, *, graphdef, mesh=None,
    sequence_attention: str = "all_gather", expert_dispatch: str = "annotations",
) -> dict:  # fmt: skip
    """Sums for a held-out batch: {'nll_sum', 'tokens'}; the caller divides after summing."""
    with sharding.active(sharding.Parallel(mesh, sequence_attention, expert_dispatch)):
        batch = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), batch)
        _, (nll_sum, _, count, _) = loss_fn(params, batch, graphdef, model_state=model_state)
        return {"nll_sum": nll_sum, "tokens": count}
