"""What the model and its layers return: one NamedTuple per layer kind, the same fields whatever
the flags (a field that does not apply is None or {}). NamedTuples unpack like tuples and are
pytrees, so they pass through `jax.jit`, `jax.lax.scan` and `nnx.remat` unchanged."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class AttentionOutput(NamedTuple):
    """`Attention` / `MLAttention`: `out` [B, L, D]; `cache`: the updated KV cache view when one
    was passed, else None."""

    out: jax.Array
    cache: Any = None


class MoEOutput(NamedTuple):
    """`MoE`: `out` [B, L, D]; `stats`: this layer's `aux_loss`, `router_z_loss`,
    `expert_counts` [E] and `dropped` (see `jaxllm.model.moe`)."""

    out: jax.Array
    stats: dict


class ModelOutput(NamedTuple):
    """`Transformer`: `logits` [B, L, V] (or [B, Q, V] at `logits_at_BxQ`, float32; a reward
    model's scores [B, L, 1] with `ModelConfig.head=score`); `cache`:
    the updated KV cache view when one was passed, else None; `aux`: for MoE models the mean
    `aux_loss` and `router_z_loss` over MoE layers, `expert_counts` [N_moe, E] and the number of
    `dropped` assignments, {} for dense models; `values`: with `ModelConfig.value_head` the
    value head's V [B, L] (float32), else None; `pooled`: with `ModelConfig.encoder.pooler` the
    pooler's output [B, D] (float32), else None; `hidden`: with `hidden_only=True` the LM
    head's input [B, L, D] (and `logits` None), else None; `hidden_states`: with
    `hidden_states=True` the residual stream after each block, [N, B, L, D] in the compute
    dtype (row i is block i's output; the last row is before the final norm), else None."""

    logits: jax.Array | None
    cache: Any = None
    aux: dict = {}  # noqa: RUF012 - never mutated; a fresh dict is passed by the model
    values: jax.Array | None = None
    pooled: jax.Array | None = None
    hidden: jax.Array | None = None
    hidden_states: jax.Array | None = None
