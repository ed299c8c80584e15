"""The heads a BERT-style encoder (`ModelConfig.kind=encoder`, `ModelConfig.encoder`) adds:
the MLM head's transform (Devlin et al. 2019, arXiv:1810.04805: dense, activation, norm before
the tied vocabulary projection, a bias after it) and the pooler (tanh(dense) of the first
token). Both are plain dense layers with biases; their logical axes keep the input dim on
`embed` and leave the output whole, as the norm after the transform needs every channel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.layers import make_norm, matmul, param
from jaxllm.model.mlp import _broadcast, activation
from jaxllm.sharding import constrain


class Dense(nnx.Module):
    """x W + b over the model width: W [D, D] with axes (embed, None), b [D] (embed)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, pdt = cfg.d_model, jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        init = jax.nn.initializers.normal(cfg.init_std)
        self.kernel = param(rngs, init, (d, d), ("embed", None), pdt)
        self.bias = param(rngs, jax.nn.initializers.zeros, (d,), ("embed",), pdt)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        spec = "bd,de->be" if x_BxLxD.ndim == 2 else "bld,de->ble"
        y = matmul(spec, x_BxLxD, self.kernel[...], self.dtype)
        return y + _broadcast(self.bias[...].astype(self.dtype), y.ndim)


class MLMTransform(nnx.Module):
    """norm(act(dense(h))): what BERT's MLM head does before the vocabulary projection."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dense = Dense(cfg, rngs=rngs)
        self.act = (cfg.mlp_activation, cfg.gelu_approximate)
        self.norm = make_norm(cfg)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        h_BxLxD = activation(*self.act)(self.dense(x_BxLxD))
        return constrain(self.norm(h_BxLxD), ("batch", "length", "act_embed"))


class Pooler(nnx.Module):
    """tanh(dense(h_0)) [B, D] of each row's first token (BERT's [CLS] representation)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.dense = Dense(cfg, rngs=rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return jnp.tanh(self.dense(x_BxLxD[:, 0]).astype(jnp.float32))
