"""Feed-forward blocks.

Gated (GLU variants, Shazeer 2020, arXiv:2002.05202): down(act(gate(x)) * up(x)) with SwiGLU
(act = silu, Llama) or GeGLU (act = gelu, Gemma). Plain: down(act(up(x))) with GELU (GPT-2),
ReLU, or squared ReLU (So et al. 2021, arXiv:2109.08668, "Primer"). Optional biases on every
projection (GPT-2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import parallel
from jaxllm.model import lora
from jaxllm.model.layers import matmul, param
from jaxllm.sharding import constrain

ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "relu2")
GATED = ("swiglu", "geglu")  # with a gate projection (GLU variants)


def activation(name: str, gelu_approximate: bool = True):
    """The elementwise nonlinearity of an MLP `activation` (`ModelConfig.mlp_activation`)."""
    gelu = functools.partial(jax.nn.gelu, approximate=gelu_approximate)
    return {
        "swiglu": jax.nn.silu,
        "geglu": gelu,
        "gelu": gelu,
        "relu": jax.nn.relu,
        "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    }[name]


def _broadcast(bias: jax.Array, ndim: int) -> jax.Array:
    """A bias over the trailing axes, with leading axes of size 1 (no implicit rank promotion)."""
    return bias.reshape((1,) * (ndim - bias.ndim) + bias.shape)


class MLP(nnx.Module):
    """A feed-forward block d_model -> hidden -> d_model: gated (`swiglu`, `geglu`: gate, up
    and down projections) or plain (`gelu`, `relu`, `relu2`: up and down), with biases on every
    projection when `bias`. Projections draw from `init_std`, the down projection from
    `out_std` (default `init_std`); `dtype` is the compute dtype, `param_dtype` the storage's."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "swiglu",
        *,
        gelu_approximate: bool = True,
        bias: bool = False,
        init_std: float = 0.02,
        out_std: float | None = None,
        dtype="float32",
        param_dtype="float32",
        fp8: str | None = None,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {activation!r} is not one of {ACTIVATIONS}")
        self.dtype, self.fp8 = jnp.dtype(dtype), fp8
        self.kind, self.approximate = activation, gelu_approximate
        gated = activation in GATED
        pdt = jnp.dtype(param_dtype)
        normal = jax.nn.initializers.normal
        d, f = d_model, hidden
        out_std = init_std if out_std is None else out_std
        if gated:
            self.gate_proj = param(rngs, normal(init_std), (d, f), ("embed", "mlp"), pdt)
        self.up_proj = param(rngs, normal(init_std), (d, f), ("embed", "mlp"), pdt)
        self.down_proj = param(rngs, normal(out_std), (f, d), ("mlp", "embed"), pdt)
        if bias:
            zeros = jax.nn.initializers.zeros
            if gated:
                self.gate_bias = param(rngs, zeros, (f,), ("mlp",), pdt)
            self.up_bias = param(rngs, zeros, (f,), ("mlp",), pdt)
            self.down_bias = param(rngs, zeros, (d,), ("embed",), pdt)

    def _bias(self, y, name: str):
        bias = getattr(self, f"{name}_bias", None)
        return y if bias is None else y + _broadcast(bias[...].astype(self.dtype), y.ndim)

    def _proj(self, spec: str, x, name: str):
        y = matmul(spec, x, lora.kernel(self, f"{name}_proj"), self.dtype, fp8=self.fp8)
        return self._bias(y, name)

    def _column(self, x_BxLxD, names: tuple[str, ...]) -> list[jax.Array]:
        """The column-parallel projections `names` of x: with `mesh.overlap=[collective_matmul]`
        and plain weights, all of them on one ring of x's length chunks."""
        kernels = [lora.kernel(self, f"{name}_proj") for name in names]
        if (
            not self.fp8
            and all(isinstance(k, jax.Array) for k in kernels)
            and parallel.collective_matmul_active(x_BxLxD)
        ):
            ys = parallel.collective_matmul(x_BxLxD, kernels, self.dtype)
            return [self._bias(y, name) for y, name in zip(ys, names)]
        # whole on the sequence over `tensor`: Megatron-SP's all-gather (mesh.tensor_sequence_
        # parallel), which XLA would otherwise trade for gathering the weights
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "act_embed"))
        return [self._proj("bld,df->blf", x_BxLxD, name) for name in names]

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        act = activation(self.kind, self.approximate)
        if hasattr(self, "gate_proj"):
            gate_BxLxF, up_BxLxF = self._column(x_BxLxD, ("gate", "up"))
            h_BxLxF = act(gate_BxLxF) * up_BxLxF
        else:
            (up_BxLxF,) = self._column(x_BxLxD, ("up",))
            h_BxLxF = act(up_BxLxF)
        h_BxLxF = constrain(h_BxLxF, ("batch", "length", "act_mlp"))
        return self._proj("blf,fd->bld", h_BxLxF, "down")
