"""Fake-quantized activations for quantization-aware training (`train.qat.activations`).

A weight wrapped in `FakeQuantKernel` tells the matmul seam (`layers.matmul`) to round its input
activations the way the stored weight-activation kinds of `jaxllm quantize` do at run time
(`coded.matmul`): each row of x (every index outside the contracted dims) gets its own scale
from its largest |x| over the contracted dims,

    int8:  s = max|x| / 127,  x_q = clip(round(x / s), -127, 127) * s
    fp8:   s = max|x| / 448,  x_q = e4m3(x / s) * s

and the gradient passes the rounding unchanged (straight through): x_used = x + sg(x_q - x).
Anything that reads the weight without the seam (`lora.as_array`: the routed experts'
grouped matmuls) sees the plain weight, so the experts' activations stay in the compute dtype,
as they do in a quantized run's expert dispatch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxllm.model import quantized_act as qa
from jaxllm.model import quantized_float as qf

ACTS = ("int8", "fp8")


@flax.struct.dataclass
class FakeQuantKernel:
    w: jax.Array
    act: str = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype


def rows(x: jax.Array, contracted: tuple[int, ...], act: str) -> jax.Array:
    """x with each row quantize-dequantized to `act` (module docstring), in x's dtype; the
    gradient straight through."""
    if act not in ACTS:
        raise ValueError(f"activation kind {act!r} is not one of {', '.join(ACTS)}")
    f = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(f), axis=contracted, keepdims=True)
    top = qa.INT8_MAX if act == "int8" else qf.FP8_MAX
    s = jnp.where(amax > 0, amax / top, 1.0)
    if act == "int8":
        q = jnp.clip(jnp.round(f / s), -top, top) * s
    else:
        q = (f / s).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s
    return x + jax.lax.stop_gradient(q.astype(x.dtype) - x)


def activations(spec: str, x: jax.Array, kernel: FakeQuantKernel) -> jax.Array:
    """`rows` of x for the einsum `spec`: the contracted dims are x's letters that the kernel
    shares and the output lacks."""
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    contracted = tuple(i for i, c in enumerate(xs) if c in ks and c not in out)
    return rows(x, contracted, kernel.act)
