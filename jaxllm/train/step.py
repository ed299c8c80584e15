"""The pure train and eval steps: `train_step(state, batch) -> (state, metrics)`.

Static pieces (model graph, optimizer, schedule, mesh) are bound with `functools.partial` before
`jax.jit`, so the jitted function takes exactly (state, batch). The loss is the mean next-token
cross-entropy over tokens whose `loss_mask` is 1, computed in float32, plus an optional z-loss
(PaLM, arXiv:2204.02311). Gradient accumulation scans over microbatches inside the step and
normalises by the token count of the whole global batch, so it equals one big batch exactly
(up to float summation order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxllm import sharding
from jaxllm.train.state import TrainState

BATCH_AXES = ("batch", "length")


def loss_fn(params, batch: dict, graphdef, z_loss: float = 0.0, rng=None):
    """Sums over the batch: (objective, (nll_sum, z_sum, token_count)). Divide by the count.
    `rng` (training) drives dropout when the model has any."""
    batch = sharding.sequence_layout(batch)
    model = nnx.merge(graphdef, params)
    logits_BxLxV = model(
        batch["inputs"], positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"],
        dropout_key=rng,
    ).astype(jnp.float32)  # fmt: skip
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, batch["targets"][..., None], -1)[..., 0]
    mask_BxL = batch["loss_mask"].astype(jnp.float32)
    nll_sum = jnp.sum((logz_BxL - target_logit_BxL) * mask_BxL)
    z_sum = jnp.sum(jnp.square(logz_BxL) * mask_BxL)
    return nll_sum + z_loss * z_sum, (nll_sum, z_sum, jnp.sum(mask_BxL))


def _microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each microbatch spans all data shards."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def train_step(
    state: TrainState, batch: dict, *, graphdef, tx, lr_schedule, mesh=None,
    grad_accum_steps: int = 1, z_loss: float = 0.0, sequence_attention: str = "all_gather",
    param_shardings=None,
) -> tuple[TrainState, dict]:  # fmt: skip
    with sharding.active_mesh(mesh, sequence_attention):
        grad_fn = jax.grad(loss_fn, has_aux=True)
        micro = _microbatches(batch, grad_accum_steps)

        # Dropout masks differ per step and microbatch, and are a function of (seed, step), so
        # a resumed run draws the same ones.
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def accumulate(carry, xs):
            grads, nll, zs, count = carry
            i, mb = xs
            mb = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), mb)
            rng = jax.random.fold_in(step_key, i)
            g, (nll_i, z_i, count_i) = grad_fn(state.params, mb, graphdef, z_loss, rng)
            grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g)
            return (grads, nll + nll_i, zs + z_i, count + count_i), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        if param_shardings is not None:  # gradients live sharded like their parameters (ZeRO)
            zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
        init = (zeros, jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
        (grads, nll, zs, count), _ = jax.lax.scan(
            accumulate, init, (jnp.arange(grad_accum_steps), micro)
        )

        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, state.params)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A NaN/Inf loss or gradient never reaches the state: keep the old params and moments.
        finite = jnp.isfinite(nll) & jnp.isfinite(zs) & jnp.isfinite(grad_norm)
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
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics


def eval_step(
    params, batch: dict, *, graphdef, mesh=None, sequence_attention: str = "all_gather"
) -> dict:
    """Sums for a held-out batch: {'nll_sum', 'tokens'}; the caller divides after summing."""
    with sharding.active_mesh(mesh, sequence_attention):
        batch = jax.tree.map(lambda x: sharding.constrain(x, BATCH_AXES), batch)
        _, (nll_sum, _, count) = loss_fn(params, batch, graphdef)
        return {"nll_sum": nll_sum, "tokens": count}
