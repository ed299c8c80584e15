"""The decode state of linear-attention layers (`model.layer_pattern` entries `linear`): per
layer, the delta rule's state (value heads of [K, V], float32) and the last W - 1 inputs of each
causal convolution (q, k, v). Fixed-size whatever the context: generation keeps it in place of
a KV cache for these layers (`CacheView.linear`), while the model's full-attention layers keep
their KV cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.config.linear_attention import layer_kinds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """state [N, B, H, K, V] float32; tails: three [N, B, W - 1, C] (q, k, v channels), N the
    linear layers."""

    state: jax.Array
    tails: tuple[jax.Array, jax.Array, jax.Array]


def num_linear_layers(cfg) -> int:
    return layer_kinds(cfg).count("linear")


def num_full_layers(cfg) -> int:
    """Layers with softmax attention: the ones a KV cache holds."""
    return layer_kinds(cfg).count("full")


def init_linear_state(cfg, batch: int) -> LinearState | None:
    """Zeros for every linear layer of `cfg` (None without any)."""
    n = num_linear_layers(cfg)
    if not n:
        return None
    la, dtype = cfg.linear_attention, jnp.dtype(cfg.dtype)
    t = la.conv_kernel - 1
    widths = (la.num_k_heads * la.k_head_dim,) * 2 + (la.num_v_heads * la.v_head_dim,)
    return LinearState(
        state=jnp.zeros((n, batch, la.num_v_heads, la.k_head_dim, la.v_head_dim), jnp.float32),
        tails=tuple(jnp.zeros((n, batch, t, c), dtype) for c in widths),
    )


def state_bytes(cfg, batch: int) -> int:
    """Bytes of the linear layers' whole decode state (independent of the context length)."""
    s = jax.eval_shape(lambda: init_linear_state(cfg, batch))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s))


def logical_axes(s: LinearState) -> LinearState:
    """Batch over the data axes, value heads over `tensor` (the conv tails' channels stay
    whole: they are small)."""
    return LinearState(
        state=("layers", "batch", "heads", None, None),
        tails=tuple(("layers", "batch", None, None) for _ in s.tails),
    )
