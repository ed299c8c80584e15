"""Hybrid stacks (`model.layer_pattern`, Qwen3-Next's three linear-attention blocks then one
softmax-attention block): the scan over repeats of the pattern (`HybridGroup`s)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig


def dense_layers(cfg: ModelConfig) -> int:
    """Blocks of the plain `layers` stack: none with a layer pattern (`hybrid_layers` holds
    them all), the first dense ones of an MoE model, else all."""
    if cfg.layer_pattern:
        return 0
    return cfg.moe.first_dense_layers if cfg.moe.enabled else cfg.num_layers


def scan(
    model,
    groups,
    carry,
    per_layer,
    positions_BxL,
    segment_ids_BxL,
    remat,
    prefix_BxL=None,
    keep=False,
):
    """`model`'s (a `Transformer`) (carry, stacked stats of each block) of a scan over the repeats of
    model.layer_pattern (`HybridGroup`s), with their layers' inputs (`per_layer`); with
    `keep`, (carry, (stats, every block's output [N, B, L, D]))."""
    every = len(model.cfg.layer_pattern)
    per_group = jax.tree.map(lambda a: a.reshape(-1, every, *a.shape[1:]), per_layer)
    group_def, group_state = nnx.split(groups)

    def group_body(carry, xs):
        state, inputs = xs
        group = nnx.merge(group_def, state)
        stats, kept = [], []
        for i in range(every):
            block_def, block_state = nnx.split(getattr(group, f"block_{i}"))
            body = model._body(block_def, positions_BxL, segment_ids_BxL, prefix_BxL, remat, keep)
            block_in = jax.tree.map(lambda a, i=i: a[i], inputs)
            carry, ys = body(carry, (block_state, block_in))
            stats.append(ys[0] if keep else ys)
            kept += [ys[1]] if keep else []
        stats = jax.tree.map(lambda *a: jnp.stack(a), *stats)
        return carry, ((stats, jnp.stack(kept)) if keep else stats)

    carry, ys = jax.lax.scan(
        group_body, carry, (group_state, per_group), unroll=model.cfg.scan_unroll
    )
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    return carry, jax.tree.map(flat, ys)
