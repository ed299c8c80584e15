"""Basic layers: the one matmul helper, RMSNorm, token embedding and rotary embeddings.

RoPE follows Su et al. 2021 (arXiv:2104.09864) in the "rotate half" layout used by Hugging Face
Llama checkpoints, so imported q/k projections need no permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, init, shape: Sequence[int], axes: tuple[str, ...], dtype) -> nnx.Param:
    """A parameter tagged with its logical axis names (read by `jaxllm.sharding`)."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), axes=axes)


def matmul(spec: str, x: jax.Array, kernel: jax.Array, dtype, out_dtype=None) -> jax.Array:
    """Every weight matmul of the model goes through here (one place to swap in fp8 later)."""
    return jnp.einsum(
        spec, x.astype(dtype), kernel.astype(dtype), preferred_element_type=out_dtype or dtype
    ).astype(out_dtype or dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019); statistics in float32."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
        self.eps, self.dtype = eps, dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (x32 * scale).astype(self.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, init_std: float, dtype, param_dtype, rngs):
        self.dtype = dtype
        init = jax.nn.initializers.normal(init_std)
        self.embedding = param(rngs, init, (vocab, dim), ("vocab", "embed"), param_dtype)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens_BxL, axis=0).astype(self.dtype)

    def attend(self, x_BxLxD: jax.Array) -> jax.Array:
        """Tied LM head: logits in float32."""
        return matmul("bld,vd->blv", x_BxLxD, self.embedding[...], self.dtype, jnp.float32)


def apply_rope(x_BxLxHxK: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
    """Rotates channel pairs (i, i + K/2) by angle position * theta^(-2i/K), in float32."""
    k = x_BxLxHxK.shape[-1]
    inv_freq_K2 = theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)
    angle_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_K2[None, None, :]
    sin = jnp.sin(angle_BxLxK2)[:, :, None, :]
    cos = jnp.cos(angle_BxLxK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)
