"""FP8 matmuls with delayed scaling (`model.fp8_scaling=delayed`): Transformer Engine's recipe.

Each projection weight that `layers.matmul` takes through `lora.kernel` gets an amax history
beside it (`Fp8History`, [3, H] float32 per layer: rows for the input, the weight and the
output gradient; H = `model.fp8_amax_history`, Transformer Engine's and Flax's default 1024).
A matmul scales each operand by the power of two that fits the largest amax of its row
(`fp8.pow2_scale`, amax_compute_algo "max") instead of by its own amax, so the cast does not wait
for a reduction over the tensor it casts; it still measures the tensor's amax, which goes into
the history after the step. A row that has recorded nothing yet (all zeros: a fresh run, or
weights loaded from a run without histories) scales by the tensor's own amax, as current
scaling does, so the first step never meets a scale of zero. A value above the delayed scale's
range saturates at the format's largest finite value (the clip before the cast) rather than
becoming NaN.

How the amaxes leave the step (Flax's "overwrite with gradient"): the history is an input of the
matmul's custom VJP, and the cotangent the backward returns for it is not a gradient but the
three amaxes of this use, in the history's newest column. The train step differentiates its loss
with respect to the histories too (`histories`), takes the largest amax over its microbatches
(and over the data replicas of a compressed exchange) and, when the step is finite, rolls each
history by one and writes them in (`recorded`). The histories live in the model state
(`TrainState.model_state`), not the parameters: no optimizer, weight decay or gradient norm sees
them, they are checkpointed and restored with the run, and evaluation and generation read them.

A weight used twice in one differentiated pass adds its two amaxes (autodiff sums cotangents),
a bound above their max: DoRA's second product (with dropout) therefore reads the history
without recording. MLA's `kv_b_proj` (merged with its adapter in the step) is delayed in its
training form and current in the absorbed decode form; the MoE experts (per device inside the
expert `shard_map`, or grouped) keep current scaling; the pipelined step (`mesh.stage` > 1) has
no delayed scaling (the config refuses it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model.fp8 import E4M3, E5M2, pow2_scale

SUFFIX = "_fp8"  # a weight `name`'s history is the module's `name + SUFFIX`
ROWS = ("input", "kernel", "output_grad")


class Fp8History(nnx.Variable):
    """[3, H] amaxes of one projection's input, weight and output gradient, newest in column 0.
    Not an `nnx.Param`: in the model state; the train step writes it (`recorded`)."""


class DelayedKernel(NamedTuple):
    """A weight with its amax history, as `lora.kernel` hands it to `layers.matmul`."""

    w: object  # an array, or any kernel kind `lora.as_array` reads
    history: jax.Array  # [3, H] float32


def attach(model: nnx.Module, history: int) -> None:
    """Adds a zero `Fp8History` next to every projection weight (`*_proj`, two dims or more, no
    expert dim, not in the module's `fp8_exempt`) of each module whose matmuls run delayed fp8
    (`module.fp8 == "delayed"`), stacked on the weight's leading `layers` dims."""
    for _, module in list(nnx.iter_modules(model)):
        if getattr(module, "fp8", None) != "delayed":
            continue
        for name, var in list(vars(module).items()):
            if not isinstance(var, nnx.Param) or not name.endswith("_proj") or var.ndim < 2:
                continue
            if name in getattr(module, "fp8_exempt", ()):
                continue
            axes = tuple(var.get_metadata().get("axes", ()))
            if "expert" in axes:
                continue
            lead = 0
            while lead < len(axes) and axes[lead] == "layers":
                lead += 1
            zeros = jnp.zeros((*var.shape[:lead], len(ROWS), history), jnp.float32)
            setattr(module, name + SUFFIX, Fp8History(zeros, axes=(*axes[:lead], None, None)))


def wrap(module: nnx.Module, name: str, w):
    """`w` with the history of `module`'s weight `name`, when it has one."""
    h = getattr(module, name + SUFFIX, None)
    return w if h is None else DelayedKernel(w, h[...])


def no_record(kernel):
    """The kernel reading its history without recording into it (a second use in one pass)."""
    if isinstance(kernel, DelayedKernel):
        return kernel._replace(history=jax.lax.stop_gradient(kernel.history))
    return kernel


def _scale(past: jax.Array, amax: jax.Array, fp8_dtype) -> jax.Array:
    """The power-of-two scale from the largest amax of the history row `past`, or from the
    tensor's own `amax` while the row has recorded nothing."""
    top = float(jnp.finfo(fp8_dtype).max)
    best = jnp.max(past)
    return pow2_scale(jnp.where(best > 0, best, amax), top)


def _cast(x32: jax.Array, scale: jax.Array, fp8_dtype) -> jax.Array:
    top = float(jnp.finfo(fp8_dtype).max)
    return jnp.clip(x32 / scale, -top, top).astype(fp8_dtype)


def _specs(spec: str) -> tuple[str, str, str]:
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    return lhs, rhs, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def einsum(spec: str, x, kernel, history, dtype, out_dtype) -> jax.Array:
    """`jnp.einsum(spec, x, kernel)` with e4m3 operands and e5m2 output gradients scaled by
    `history` ([3, H]); the cotangent of `history` is this use's three amaxes in column 0."""
    return _fwd(spec, x, kernel, history, dtype, out_dtype)[0]


def _fwd(spec, x, kernel, history, dtype, out_dtype):
    x32, k32 = x.astype(jnp.float32), kernel.astype(jnp.float32)
    ax, ak = jnp.max(jnp.abs(x32)), jnp.max(jnp.abs(k32))
    sx, sk = _scale(history[0], ax, E4M3), _scale(history[1], ak, E4M3)
    qx, qk = _cast(x32, sx, E4M3), _cast(k32, sk, E4M3)
    y = jnp.einsum(spec, qx, qk, preferred_element_type=jnp.float32) * (sx * sk)
    return y.astype(out_dtype), (qx, sx, qk, sk, history, ax, ak)


def _bwd(spec, dtype, out_dtype, res, g):
    qx, sx, qk, sk, history, ax, ak = res
    g32 = g.astype(jnp.float32)
    ag = jnp.max(jnp.abs(g32))
    sg = _scale(history[2], ag, E5M2)
    qg = _cast(g32, sg, E5M2)
    lhs, rhs, out = _specs(spec)
    dx = jnp.einsum(f"{out},{rhs}->{lhs}", qg, qk, preferred_element_type=jnp.float32)
    dk = jnp.einsum(f"{lhs},{out}->{rhs}", qx, qg, preferred_element_type=jnp.float32)
    amaxes = jnp.zeros_like(history).at[:, 0].set(jnp.stack([ax, ak, ag]))
    return (dx * (sg * sk)).astype(dtype), (dk * (sx * sg)).astype(dtype), amaxes


einsum.defvjp(_fwd, _bwd)


def histories(model_state) -> dict:
    """The amax histories of a model state (a nested dict), in the same nesting; {} if none."""
    if not isinstance(model_state, Mapping):
        return {}
    out = {}
    for k, v in model_state.items():
        if isinstance(v, Mapping):
            if sub := histories(v):
                out[k] = sub
        elif isinstance(k, str) and k.endswith(SUFFIX):
            out[k] = v
    return out


def with_histories(model_state, hist: Mapping):
    """`model_state` with the entries of `hist` (same nesting) put in."""
    if not hist:
        return model_state
    out = dict(model_state)
    for k, v in hist.items():
        out[k] = with_histories(out[k], v) if isinstance(v, Mapping) else v
    return out


def recorded(hist: Mapping, amaxes: Mapping, keep: jax.Array) -> dict:
    """Each history rolled by one column with the step's `amaxes` (cotangents from `einsum`:
    column 0) written in as the newest; unchanged where `keep` (the step was finite) is false."""

    def roll(h, a):
        new = jnp.roll(h, 1, axis=-1).at[..., 0].set(a[..., 0].astype(h.dtype))
        return jnp.where(keep, new, h)

    return jax.tree.map(roll, dict(hist), dict(amaxes))
