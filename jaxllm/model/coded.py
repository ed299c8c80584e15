"""Quantized weights of the float and weight-activation kinds: the storage of `jaxllm quantize
--method fp8 | mxfp4 | smoothquant | llm_int8` (docs/compression.md). The integer weight-only
kinds (rtn, gptq, awq) are `quantized.QuantizedTensor`.

A weight [*lead, *in, *out] is coded as a matrix [K, N] per lead index (K the contracted dims
flattened, N the output dims flattened), by the numerics of `quantized_float` and
`quantized_act`:

    kind   codes                                     scales
    fp8    E4M3 bits as uint8 [*lead, *in, *out]     float32 [*lead, *out] (per output channel)
    mxfp4  E2M1 pairs, uint8 [*lead, *in[:-1],       E8M0 uint8 [*lead, K / 32, *out]
           in[-1] / 2, *out] (first in the low nibble)
    int8   int8 [*lead, *in, *out]                   float32 [*lead, *out] (per output channel)

`act` says what the matmul seam (`layers.matmul`) does with the activations: "none" (weight
only: the weight is decoded inside the jitted computation, fused with the dot), "fp8" (each
token's row in E4M3 with its own scale, an E4M3 x E4M3 dot in float32: W8A8-FP8), "int8" (each
token's row in int8, an int8 x int8 dot in int32: W8A8, what SmoothQuant runs) or "llm_int8"
(LLM.int8(): the input features with any |x| > `threshold` in 16 bits against the decoded
weight, the rest int8). The routed experts' grouped matmuls (`ragged_matmul`, the dropless
dispatch; the capacity dispatch's are `matmul`'s einsums) take int8 and fp8 the same way per
token row; LLM.int8() experts are decoded (weight-only) there. Codes carry the weight's
logical axes; scales those of the lead and output dims (MXFP4's blocks: none), so a coded
weight shards like the weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model import quantized_act as qa
from jaxllm.model import quantized_float as qf

KINDS = ("fp8", "mxfp4", "int8")
ACTS = ("none", "fp8", "int8", "llm_int8")


@flax.struct.dataclass
class CodedTensor:
    codes: jax.Array
    scales: jax.Array
    kind: str = flax.struct.field(pytree_node=False)
    act: str = flax.struct.field(pytree_node=False)
    threshold: float = flax.struct.field(pytree_node=False)
    n_in: int = flax.struct.field(pytree_node=False)
    n_out: int = flax.struct.field(pytree_node=False)
    dtype: np.dtype = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.codes.shape)
        if self.kind == "mxfp4":
            s[s.__len__() - self.n_out - 1] *= 2
        return tuple(s)

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def _matrix(shape, n_in, n_out) -> tuple[int, int, int]:
    lead = len(shape) - n_in - n_out
    return lead, math.prod(shape[lead : lead + n_in]), math.prod(shape[lead + n_in :])


def _per_lead(fn, lead: int):
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn


def encode(
    w: jax.Array, *, kind: str, act: str, threshold: float, n_in: int, n_out: int
) -> CodedTensor:
    """`w` [*lead, *in, *out] coded as `kind` (module docstring)."""
    shape = tuple(w.shape)
    lead, k, n = _matrix(shape, n_in, n_out)
    w2 = w.reshape(*shape[:lead], k, n)
    if kind == "fp8":
        q, s = _per_lead(qf.fp8_quantize, lead)(w2)
        codes = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(shape)
    elif kind == "mxfp4":
        q, s = _per_lead(qf.mxfp4_quantize, lead)(w2)
        packed = (*shape[: lead + n_in - 1], shape[lead + n_in - 1] // 2, *shape[lead + n_in :])
        codes = q.reshape(packed)
    else:
        q, s = _per_lead(lambda m: qa.int8_quantize(m, axis=0), lead)(w2)
        codes, s = q.reshape(shape), s[..., 0, :]
    s_shape = (
        *shape[:lead],
        *(() if kind != "mxfp4" else (k // qf.MX_BLOCK,)),
        *shape[lead + n_in :],
    )
    return CodedTensor(
        codes, s.reshape(s_shape), kind, act, threshold, n_in, n_out, np.dtype(w.dtype)
    )


def decode(t: CodedTensor, dtype=None) -> jax.Array:
    """The weight [*lead, *in, *out] in `dtype` (default: the weight's)."""
    dtype = t.dtype if dtype is None else dtype
    shape = t.shape
    lead, k, n = _matrix(shape, t.n_in, t.n_out)
    if t.kind == "fp8":
        q = jax.lax.bitcast_convert_type(t.codes, jnp.float8_e4m3fn).reshape(*shape[:lead], k, n)
        fn = lambda q, s: qf.fp8_dequantize(q, s, dtype)  # noqa: E731
        s = t.scales.reshape(*shape[:lead], n)
    elif t.kind == "mxfp4":
        q = t.codes.reshape(*shape[:lead], k // 2, n)
        fn = lambda q, s: qf.mxfp4_dequantize(q, s, dtype)  # noqa: E731
        s = t.scales.reshape(*shape[:lead], k // qf.MX_BLOCK, n)
    else:
        q = t.codes.reshape(*shape[:lead], k, n)
        fn = lambda q, s: (q.astype(jnp.float32) * s[None, :]).astype(dtype)  # noqa: E731
        s = t.scales.reshape(*shape[:lead], n)
    return _per_lead(fn, lead)(q, s).reshape(shape)


def axes(t: CodedTensor, weight_axes: Sequence[str | None]) -> CodedTensor:
    """Logical axes of the leaves of `t` (a coded weight that had `weight_axes`)."""
    ax = tuple(weight_axes)
    lead = len(ax) - t.n_in - t.n_out
    outs = ax[lead + t.n_in :]
    s_axes = (*ax[:lead], *((None,) if t.kind == "mxfp4" else ()), *outs)
    return t.replace(codes=ax, scales=s_axes)


def abstract(shape, dtype, **how) -> CodedTensor:
    spec = jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.eval_shape(lambda w: encode(w, **how), spec)


def w8a8(w) -> bool:
    """Whether `w` is a coded weight whose matmuls quantize each token's row (act int8 or fp8):
    the kinds the expert dispatch keeps coded (`ragged_matmul`); the others it decodes."""
    return isinstance(w, CodedTensor) and w.act in ("int8", "fp8")


def matmul(spec: str, x: jax.Array, t: CodedTensor, dtype, out_dtype, axis_name=None):
    """`einsum(spec, x, W)` with activations quantized per row as `t.act` says (module
    docstring): the rows' scales over the contracted dims, the weight's per output channel.
    `axis_name`: the mesh axis the contracted dims are split over under `shard_map` (the
    expert dispatch's tensor axis), whose devices then share each row's scale, as one device
    would compute it. Differentiable in x as the matmul by the decoded weight (straight through
    the rounding), so LoRA trains on a W8A8 base; the codes take no gradient."""
    fwd = lambda x, t: _quantized_matmul(spec, x, t, dtype, out_dtype, axis_name)  # noqa: E731
    return _straight_through(fwd, lambda x, w: jnp.einsum(spec, x, w), x, t)


def ragged_matmul(x_AxK, t: CodedTensor, sizes_E, out_dtype, axis_name=None) -> jax.Array:
    """`jax.lax.ragged_dot(x, W, sizes_E)` (rows grouped by expert: the first sizes_E[0] rows
    times expert 0's [K, N], ...) of a W8A8 expert stack [E, K, N]: each row quantized on its
    own scale as in `matmul` (`axis_name` too), an int8 x int8 ragged dot accumulated in int32
    (E4M3 x E4M3 in float32), each row rescaled by its scale times its expert's per output
    channel. Rows past sum(sizes_E) give zeros. Differentiable in x as `matmul`."""

    def fwd(x_AxK, t, sizes_E):
        q_AxK, s_Ax1 = _quantize_rows(x_AxK.astype(jnp.float32), t.act, (1,), axis_name)
        acc_AxN = jax.lax.ragged_dot(q_AxK, _codes(t), sizes_E, preferred_element_type=_acc(t))
        n_rows, experts = x_AxK.shape[0], jnp.arange(sizes_E.shape[0])
        expert_A = jnp.repeat(experts, sizes_E, total_repeat_length=n_rows)
        s_AxN = s_Ax1 * jnp.take(t.scales.astype(jnp.float32), expert_A, axis=0)
        return (acc_AxN.astype(jnp.float32) * s_AxN).astype(out_dtype)

    return _straight_through(fwd, jax.lax.ragged_dot, x_AxK, t, sizes_E)


def _straight_through(forward, reference, x, t: CodedTensor, *ints):
    """forward(x, t, *ints), whose gradient in x is reference(x, decode(t), *ints)'s (integer
    arguments such as group sizes take none; nor do the codes and scales)."""
    meta = t.replace(codes=None, scales=None)

    @jax.custom_vjp
    def f(x, codes, scales, *ints):
        return forward(x, meta.replace(codes=codes, scales=scales), *ints)

    def fwd(x, codes, scales, *ints):
        return f(x, codes, scales, *ints), (x, codes, scales, ints)

    def bwd(res, g):
        x, codes, scales, ints = res
        w = decode(meta.replace(codes=codes, scales=scales), jnp.float32)
        _, vjp = jax.vjp(lambda x: reference(x.astype(jnp.float32), w, *ints), x)
        (dx,) = vjp(g.astype(jnp.float32))
        zeros = [np.zeros(a.shape, jax.dtypes.float0) for a in (codes, *ints)]
        return dx.astype(x.dtype), zeros[0], jnp.zeros_like(scales), *zeros[1:]

    f.defvjp(fwd, bwd)
    return f(x, t.codes, t.scales, *ints)


def _quantize_rows(x, act: str, axes, axis_name=None):
    """(codes, scales) of float32 `x` per row: each row's largest |x| over `axes` (and over
    `axis_name`'s devices) maps to the grid's largest value, E4M3 (act fp8) or int8."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    if axis_name is not None:
        amax = jax.lax.pmax(amax, axis_name)
    if act == "fp8":
        s_x = jnp.where(amax > 0, amax / qf.FP8_MAX, 1.0)
        return (x / s_x).astype(jnp.float8_e4m3fn), s_x
    s_x = jnp.where(amax > 0, amax / qa.INT8_MAX, 1.0)
    return jnp.clip(jnp.round(x / s_x), -qa.INT8_MAX, qa.INT8_MAX).astype(jnp.int8), s_x


def _codes(t: CodedTensor) -> jax.Array:
    """The weight's codes as the dot takes them: E4M3 (act fp8) or int8."""
    if t.act == "fp8":
        return jax.lax.bitcast_convert_type(t.codes, jnp.float8_e4m3fn)
    return t.codes


def _acc(t: CodedTensor):
    return jnp.float32 if t.act == "fp8" else jnp.int32


def _quantized_matmul(
    spec: str, x: jax.Array, t: CodedTensor, dtype, out_dtype, axis_name=None
) -> jax.Array:
    ins, out = spec.split("->")
    xs, ks = ins.split(",")
    contracted = tuple(i for i, c in enumerate(xs) if c in ks and c not in out)
    x = x.astype(jnp.float32)
    if t.act == "llm_int8":
        rows = tuple(i for i in range(x.ndim) if i not in contracted)
        outlier = jnp.max(jnp.abs(x), axis=rows, keepdims=True) > t.threshold
        dense = jnp.einsum(spec, jnp.where(outlier, x, 0).astype(dtype), decode(t, dtype))
        x = jnp.where(outlier, 0, x)
    q_x, s_x = _quantize_rows(x, "fp8" if t.act == "fp8" else "int8", contracted, axis_name)
    acc = jnp.einsum(spec, q_x, _codes(t), preferred_element_type=_acc(t))
    # s_x over x's other dims, s_w over the kernel's lead and output dims: their outer product
    # laid out as the output
    x_rest = "".join(c for i, c in enumerate(xs) if i not in contracted)
    k_rest = "".join(c for c in ks if c not in xs or c in out)
    scale = jnp.einsum(
        f"{x_rest},{k_rest}->{out}", jnp.squeeze(s_x, contracted), t.scales.astype(jnp.float32)
    )
    y = acc.astype(jnp.float32) * scale
    if t.act == "llm_int8":
        y = y + dense.astype(jnp.float32)
    return y.astype(out_dtype)
