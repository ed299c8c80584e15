"""T5's relative position buckets (Raffel et al. 2020, arXiv:1910.10683, §2.1; Hugging Face
`T5Attention._relative_position_bucket`).

A key at relative position r = key - query falls in one of `num_buckets` buckets: half of them
exact for |r| < num_buckets / 4 (bidirectional) and the rest logarithmic up to `max_distance`,
beyond which all distances share the last bucket. Bidirectional buckets (the encoder) split the
buckets between r > 0 and r <= 0; unidirectional ones (the causal decoder) only see r <= 0. Each
bucket has a learned scalar per head, added to the attention logits; one table serves every
layer of a stack (T5 keeps it in the first layer and passes the bias on).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.layers import param


def relative_position_bucket(
    relative_LxS: jax.Array, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> jax.Array:
    """Bucket (int32) of each relative position key - query."""
    buckets = jnp.zeros_like(relative_LxS)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_LxS > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(relative_LxS)
    else:
        distance = -jnp.minimum(relative_LxS, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # the float32 log of 0 is -inf for distance 0; is_small picks the exact bucket there
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
    large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, distance, large)


class RelativeBias(nnx.Module):
    """The bias table [num_buckets, H] of one stack, and the bias [H, L, S] it gives."""

    def __init__(
        self,
        num_heads: int,
        *,
        bidirectional: bool,
        num_buckets: int,
        max_distance: int,
        init_std: float,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        self.bidirectional, self.num_buckets = bidirectional, num_buckets
        self.max_distance = max_distance
        init = jax.nn.initializers.normal(init_std)
        self.embedding = param(
            rngs, init, (num_buckets, num_heads), ("relative_buckets", "heads"), param_dtype
        )

    def __call__(self, q_pos_L: jax.Array, k_pos_S: jax.Array) -> jax.Array:
        """Float32 bias [H, L, S] of queries at `q_pos_L` over keys at `k_pos_S`."""
        bucket_LxS = relative_position_bucket(
            k_pos_S[None, :].astype(jnp.int32) - q_pos_L[:, None].astype(jnp.int32),
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias_LxSxH = jnp.take(self.embedding[...].astype(jnp.float32), bucket_LxS, axis=0)
        return bias_LxSxH.transpose(2, 0, 1)
