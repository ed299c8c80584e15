"""Gaussian-kernel attention: the logit of query q and key k is an RBF kernel's log,
-||q - k||^2 / (2 sigma_h^2 sqrt(K)), instead of the dot product q.k / sqrt(K) (attention as a
kernel smoother: Tsai et al. 2019, "Transformer Dissection", arXiv:1908.11775; Gaussian
self-attention: Chen et al. 2021, "Skyformer", arXiv:2111.00035). sigma_h is per head, fixed or
learned (`ModelConfig.attention_kernel`, `gaussian_sigma`, `gaussian_sigma_learned`).

Expanding the square, -||q - k||^2 = 2 q.k - ||k||^2 - ||q||^2, and the last term is the same
for every key of a query, which the softmax ignores. So the Gaussian logits are dot products of
one extra channel each (`augment`): q' = [q, -1/2] / (sigma_h^2 sqrt(K)) and k' = [k, ||k||^2],
at logit scale 1. Every mask, window, ALiBi bias and the KV cache then work unchanged: the cache
holds k' (K + 1 channels, values zero-padded to match) and a decode step attends over it as over
any key. What the constant changes, a logit soft cap (c tanh(s / c) is not shift-invariant), is
refused by the config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxllm.model.dot_product import dot_product_attention


def augment(
    q_BxLxHxK: jax.Array, k_BxSxGxK: jax.Array, sigma_H: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(q' [B, L, H, K + 1], k' [B, S, G, K + 1]), in the inputs' dtypes, whose dot products
    are the Gaussian logits of q and k up to a per-query constant; computed in float32."""
    b, l, h, k = q_BxLxHxK.shape
    inv_H = 1.0 / (jnp.asarray(sigma_H, jnp.float32) ** 2 * math.sqrt(k))
    inv_1x1xHx1 = inv_H[None, None, :, None]
    q_BxLxHx1 = jnp.broadcast_to(-0.5 * inv_1x1xHx1, (b, l, h, 1))
    q_BxLxHxK1 = jnp.concatenate([q_BxLxHxK.astype(jnp.float32) * inv_1x1xHx1, q_BxLxHx1], -1)
    k_f32 = k_BxSxGxK.astype(jnp.float32)
    k_BxSxGxK1 = jnp.concatenate([k_f32, jnp.sum(k_f32 * k_f32, -1, keepdims=True)], -1)
    return q_BxLxHxK1.astype(q_BxLxHxK.dtype), k_BxSxGxK1.astype(k_BxSxGxK.dtype)


def gaussian_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxV: jax.Array,
    sigma_H: jax.Array,
    **kwargs,
) -> jax.Array:
    """softmax(-||q - k||^2 / (2 sigma_h^2 sqrt(K)) + masks) v: `dot_product_attention` (xla;
    its other keyword arguments but scale and soft_cap) over the augmented queries and keys."""
    q_BxLxHxK1, k_BxSxGxK1 = augment(q_BxLxHxK, k_BxSxGxK, sigma_H)
    return dot_product_attention(q_BxLxHxK1, k_BxSxGxK1, v_BxSxGxV, scale=1.0, **kwargs)
