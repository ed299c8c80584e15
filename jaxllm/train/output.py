"""What every objective shares: the `ObjectiveOutput` of sums it returns, the `Objective`
signature, `token_nll`, the float32 pieces of a token-level cross-entropy (`masked_nll_sums`
their masked sums, optionally in chunks of the sequence), and `load_function`
for the `MODULE:NAME` specs of user code (objectives, rewards). Its own module
so that the objectives of other methods (`jaxllm.train.distill`) build on it while
`jaxllm.train.objectives`, the registry, imports them."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError


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
    # a masked sum rather than a gather: exact (zeros added), split over a vocab-sharded axis
    # as partial sums, and partitioned where XLA's gather fails (inside pipeline stages)
    vocab_BxLxV = jax.lax.broadcasted_iota(jnp.int32, logits_BxLxV.shape, 2)
    hit_BxLxV = vocab_BxLxV == targets_BxL[..., None].astype(jnp.int32)
    target_logit_BxL = jnp.sum(jnp.where(hit_BxLxV, logits_BxLxV, 0.0), axis=-1)
    return logz_BxL - target_logit_BxL, logz_BxL


def masked_nll_sums(model, batch: dict, out, chunks: int = 1):
    """(sum of -log p(target), sum of log Z squared) over the tokens whose `loss_mask` is 1.

    chunks = 1: from `out.logits`. chunks > 1: `out` holds the head's input (`hidden_only`) and
    the LM head and cross-entropy run on L / chunks tokens of each row at a time in a scan,
    each chunk rematerialised in the backward, so the [B, L, V] float32 logits and their
    gradient never exist at once (at a 128k vocabulary they are the largest activation).
    """
    mask_BxL = batch["loss_mask"].astype(jnp.float32)
    if chunks == 1:
        nll_BxL, logz_BxL = token_nll(out.logits, batch["targets"])
        return jnp.sum(nll_BxL * mask_BxL), jnp.sum(jnp.square(logz_BxL) * mask_BxL)
    b, l, d = out.hidden.shape
    if l % chunks:
        raise ValueError(f"{chunks} loss chunks do not divide the sequence length {l}")

    def split(x):  # [B, L, ...] -> [chunks, B, L / chunks, ...]
        return jnp.moveaxis(x.reshape(b, chunks, l // chunks, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk(sums, xs):
        h_BxCxD, targets_BxC, mask_BxC = xs
        nll_BxC, logz_BxC = token_nll(model.head_logits(h_BxCxD), targets_BxC)
        return (
            sums[0] + jnp.sum(nll_BxC * mask_BxC),
            sums[1] + jnp.sum(jnp.square(logz_BxC) * mask_BxC),
        ), None

    zero = jnp.zeros((), jnp.float32)
    xs = (split(out.hidden), split(batch["targets"]), split(mask_BxL))
    (nll_sum, z_sum), _ = jax.lax.scan(chunk, (zero, zero), xs)
    return nll_sum, z_sum


def load_function(spec: str, key: str) -> Callable:
    """The function `MODULE:NAME` or `path/to/file.py:NAME` names; ConfigError naming `key`
    when it cannot be loaded or is not callable."""
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if module_spec is None or not Path(where).is_file():
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, attr)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        raise ConfigError(f"{key}={spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r} is not a function")
    return fn
