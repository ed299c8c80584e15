"""FP8 matmuls with per-tensor current scaling, behind `layers.matmul` (`model.matmul_dtype`).

The recipe of FP8 training (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; Transformer
Engine; DeepSeek-V3 §3.3): inputs and weights of the forward matmul in float8_e4m3fn (more
mantissa), the output gradient of the backward matmuls in float8_e5m2 (more range), products
accumulated in float32, each operand divided by a scale first so that its largest magnitude
lands near the format's largest finite value.

Scaling is *current*: each scale comes from the amax of the very tensor it scales, in the same
step, so there is no scaling state to carry, shard or checkpoint, and a loss spike cannot meet a
stale scale (an overflow to NaN, as e4m3fn has no infinity). The price is one extra reduction
over each operand per matmul, which delayed scaling (Transformer Engine's amax history) avoids.
Scales are powers of two, so dividing and multiplying by them is exact and the only rounding is
the cast to fp8 itself. Under a sharded jit the amax is global (XLA reduces it across devices),
so every device uses the same scale and the numbers do not depend on the mesh; inside a
`shard_map` (MoE expert dispatch) each device scales its own shard.

On CPU, XLA emulates fp8 dots (upcasts the operands); speed is a GPU question (Hopper and later
run e4m3/e5m2 dots in hardware).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def pow2_scale(amax: jax.Array, top: float) -> jax.Array:
    """The smallest power of two s with amax / s <= top (elementwise, float32); at least the
    smallest normal float32, so an all-zero tensor gets 0 / tiny = 0, not 0 / 0."""
    return jnp.maximum(jnp.exp2(jnp.ceil(jnp.log2(amax / top))), jnp.finfo(jnp.float32).tiny)


def quantize(x: jax.Array, fp8_dtype) -> tuple[jax.Array, jax.Array]:
    """(q, scale) with q = x / scale in `fp8_dtype` and scale a float32 power of two: the
    smallest one that keeps amax(|x|) / scale within the format's largest finite value."""
    top = float(jnp.finfo(fp8_dtype).max)
    x32 = x.astype(jnp.float32)
    scale = pow2_scale(jnp.max(jnp.abs(x32)), top)
    # The clip only guards the cast: e4m3fn turns overflow into NaN, not a saturated value.
    return jnp.clip(x32 / scale, -top, top).astype(fp8_dtype), scale


def _specs(spec: str) -> tuple[str, str, str]:
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    return lhs, rhs, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def einsum(spec: str, x: jax.Array, kernel: jax.Array, dtype, out_dtype) -> jax.Array:
    """`jnp.einsum(spec, x, kernel)` with both operands in e4m3 and the output in `out_dtype`;
    the gradients come from e5m2 output gradients. `x` and `kernel` are in `dtype`, and so are
    their gradients. Every index of `spec` must appear in two of its three terms (true of
    projection matmuls: no index is summed within one operand)."""
    return _einsum_fwd(spec, x, kernel, dtype, out_dtype)[0]


def _einsum_fwd(spec, x, kernel, dtype, out_dtype):
    qx, sx = quantize(x, E4M3)
    qk, sk = quantize(kernel, E4M3)
    y = jnp.einsum(spec, qx, qk, preferred_element_type=jnp.float32) * (sx * sk)
    return y.astype(out_dtype), (qx, sx, qk, sk)  # fp8 residuals: a byte per element


def _einsum_bwd(spec, dtype, out_dtype, res, g):
    qx, sx, qk, sk = res
    qg, sg = quantize(g, E5M2)
    lhs, rhs, out = _specs(spec)
    dx = jnp.einsum(f"{out},{rhs}->{lhs}", qg, qk, preferred_element_type=jnp.float32)
    dk = jnp.einsum(f"{lhs},{out}->{rhs}", qx, qg, preferred_element_type=jnp.float32)
    return (dx * (sg * sk)).astype(dtype), (dk * (sx * sg)).astype(dtype)


einsum.defvjp(_einsum_fwd, _einsum_bwd)


# x [A, D] and g [A, F] contracted over their rows A, which are ragged (grouped by sizes_E):
# one [D, F] product per group, [E, D, F] like the kernel.
_PER_GROUP_XTG = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def ragged_dot(x_AxD, kernel_ExDxF, sizes_E, dtype) -> jax.Array:
    """`jax.lax.ragged_dot` (rows of `x` grouped by `sizes_E`, group i times kernel i) in fp8
    as `einsum`; the kernel's gradient, one x^T g per group, is a `ragged_dot_general` whose
    contracting (row) dim is the ragged one, on the same e4m3 and e5m2 values."""
    return _ragged_fwd(x_AxD, kernel_ExDxF, sizes_E, dtype)[0]


def _ragged_fwd(x_AxD, kernel_ExDxF, sizes_E, dtype):
    qx, sx = quantize(x_AxD, E4M3)
    qk, sk = quantize(kernel_ExDxF, E4M3)
    y = jax.lax.ragged_dot(qx, qk, sizes_E, preferred_element_type=jnp.float32) * (sx * sk)
    return y.astype(dtype), (qx, sx, qk, sk, sizes_E)


def _ragged_bwd(dtype, res, g_AxF):
    qx, sx, qk, sk, sizes_E = res
    qg, sg = quantize(g_AxF, E5M2)
    qk_ExFxD = jnp.swapaxes(qk, 1, 2)
    dx = jax.lax.ragged_dot(qg, qk_ExFxD, sizes_E, preferred_element_type=jnp.float32)

    dk_ExDxF = jax.lax.ragged_dot_general(
        qx, qg, sizes_E, _PER_GROUP_XTG, preferred_element_type=jnp.float32
    )
    dx, dk_ExDxF = _summed_like(dx * (sg * sk), qx), _summed_like(dk_ExDxF * (sx * sg), qk)
    dsizes = np.zeros(sizes_E.shape, jax.dtypes.float0)
    return dx.astype(dtype), dk_ExDxF.astype(dtype), dsizes


def _summed_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """`grad` summed over the mesh axes it varies over and `primal` does not. Under shard_map
    (dropless experts) a kernel is the same on every device of the batch axes while the rows
    are not, and the rows are the same on every device of `tensor` while the kernel's hidden
    units are not: each operand's gradient is the sum of every device's, the psum automatic
    differentiation puts where an invariant operand meets a varying one, which a custom VJP
    must do itself."""
    extra = _varying(grad) - _varying(primal)
    return jax.lax.psum(grad, tuple(sorted(extra))) if extra else grad


def _varying(x: jax.Array) -> frozenset:
    """Mesh axes `x` varies over inside shard_map (empty outside it)."""
    return frozenset(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ()))


ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)
