"""What every objective shares: the `ObjectiveOutput` of sums it returns, the `Objective`
signature, and `token_nll`, the float32 pieces of a token-level cross-entropy. Its own module
so that the objectives of other methods (`jaxllm.train.distill`) build on it while
`jaxllm.train.objectives`, the registry, imports them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class ObjectiveOutput(NamedTuple):
    """What an objective returns for one (micro)batch; all sums over the batch."""

    loss_sum: jax.Array  # float32 scalar the gradient comes from
    tokens: jax.Array  # float32 scalar: what the sums count; the step divides by the total
    metrics: dict[str, jax.Array] = {}  # sums; logged as sum / tokens (`loss` is eval's loss)
    model_stats: Any = {}  # the model's aux sums (MoE), for `Transformer.after_step`


Objective = Callable[[nnx.Module, dict, "jax.Array | None"], ObjectiveOutput]


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array):
    """(-log p(target) [B, L], log Z [B, L]) in float32: the pieces of a token-level loss."""
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], -1)[..., 0]
    return logz_BxL - target_logit_BxL, logz_BxL
