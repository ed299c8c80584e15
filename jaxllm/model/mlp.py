"""SwiGLU feed-forward (Shazeer 2020, arXiv:2002.05202): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
from flax import nnx

from jaxllm.model.layers import matmul, param
from jaxllm.sharding import constrain


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, mlp_dim: int, *, init_std, out_std, dtype, param_dtype, rngs):
        self.dtype = dtype
        normal = jax.nn.initializers.normal
        d, f = d_model, mlp_dim
        self.gate_proj = param(rngs, normal(init_std), (d, f), ("embed", "mlp"), param_dtype)
        self.up_proj = param(rngs, normal(init_std), (d, f), ("embed", "mlp"), param_dtype)
        self.down_proj = param(rngs, normal(out_std), (f, d), ("mlp", "embed"), param_dtype)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        gate_BxLxF = matmul("bld,df->blf", x_BxLxD, self.gate_proj[...], self.dtype)
        up_BxLxF = matmul("bld,df->blf", x_BxLxD, self.up_proj[...], self.dtype)
        h_BxLxF = constrain(jax.nn.silu(gate_BxLxF) * up_BxLxF, ("batch", "length", "act_mlp"))
        return matmul("blf,fd->bld", h_BxLxF, self.down_proj[...], self.dtype)
