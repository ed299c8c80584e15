"""Integer weight-only quantized tensors: the storage of `jaxllm quantize` (docs/compression.md).

A weight of shape [*lead, *in, *out] (lead: stacked layers and experts; in: the dims the matmul
contracts; out: the rest) is stored as unsigned b-bit codes q, one scale s per group of `group`
consecutive input channels and output channel (per channel: one per output channel), and, when asymmetric, an integer zero point z per group:

    w ~ (q - z) * s,   q in [0, 2^b - 1]

Symmetric quantization has no stored zero point: z = 2^(b-1) (the offset-binary form of the
signed codes [-2^(b-1), 2^(b-1) - 1], as GPTQ and compressed-tensors store them).

Packing. Codes are packed little-endian into uint8 along the last contracted dim, in chunks of
c = lcm(8, b) / b codes into b * c / 8 bytes: int8 one a byte, int4 two (the first code in the
low nibble), int2 four, int3 eight codes in three bytes (code i at bits 3i .. 3i + 2 of the
chunk's 24-bit little-endian word). So an int3 tensor takes 3/8 of a byte a value, and its
packed dim must be a multiple of 8 (int4: 2, int2: 4).

Groups. The groups run over the contracted dims flattened row-major (for the output
projection [heads, head_dim] that is Hugging Face's flattened input of o_proj), so a group may
span heads; per channel is one group of all of them.

Layout and sharding. `codes` is [*lead, *in[:-1], in[-1] * b / 8, *out]: the same dims in the
same order as the weight, so it carries the weight's logical axes (`quantized_axes`) and shards
like it (a sharded contracted dim shards the packed bytes). `scales` / `zeros` are
[*lead, groups, *out]: the lead and out dims carry the weight's axes, the groups none
(replicated; they are a small fraction of the bytes).

Static fields hold what no leading-dim slice changes (bits, group, how many dims are in / out,
the original dtype), so a stacked tensor sliced by `nnx.scan` over layers or by the expert
dispatch is still a valid `QuantizedTensor`. Dequantization is pure jnp on the local shapes,
done inside the jitted matmul (`layers.matmul` via `lora.as_array`), so XLA fuses it with the
dot and no full-precision copy of the model ever exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np

BITS = (2, 3, 4, 8)


def chunk(bits: int) -> tuple[int, int]:
    """(codes, bytes) of one packing chunk of `bits`-bit codes: lcm(8, b) / b and b * that / 8."""
    codes = math.lcm(8, bits) // bits
    return codes, bits * codes // 8


@flax.struct.dataclass
class QuantizedTensor:
    """A weight in b-bit integer codes with per-group scales (module docstring)."""

    codes: jax.Array  # uint8 [*lead, *in[:-1], in[-1] * bits / 8, *out]
    scales: jax.Array  # [*lead, groups, *out], in the weight's dtype
    zeros: jax.Array | None  # uint8 like scales (asymmetric), None (symmetric)
    bits: int = flax.struct.field(pytree_node=False)
    group: int = flax.struct.field(pytree_node=False)  # 0: per channel
    n_in: int = flax.struct.field(pytree_node=False)  # contracted dims
    n_out: int = flax.struct.field(pytree_node=False)  # output dims (last)
    dtype: np.dtype = flax.struct.field(pytree_node=False)  # of the weight quantized

    @property
    def packed_axis(self) -> int:
        return self.codes.ndim - self.n_out - 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (of this slice, when stacked dims were sliced off)."""
        s, p = list(self.codes.shape), self.packed_axis
        codes, nbytes = chunk(self.bits)
        s[p] = s[p] // nbytes * codes
        return tuple(s)

    @property
    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def _along(v: jax.Array, ndim: int, axis: int) -> jax.Array:
    """The vector `v` as an array of rank `ndim` running along `axis`."""
    return v.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def _pack(q: jax.Array, bits: int, axis: int) -> jax.Array:
    """uint8 codes [..., n, ...] (values < 2^bits) -> packed bytes [..., n * bits / 8, ...]."""
    n_codes, n_bytes = chunk(bits)
    if bits == 8:
        return q.astype(jnp.uint8)
    s = q.shape
    q = q.astype(jnp.uint32).reshape(*s[:axis], s[axis] // n_codes, n_codes, *s[axis + 1 :])
    shifts = _along(jnp.arange(n_codes, dtype=jnp.uint32) * bits, q.ndim, axis + 1)
    word = jnp.sum(q << shifts, axis=axis + 1)
    out = jnp.stack([(word >> (8 * j)) & 0xFF for j in range(n_bytes)], axis=axis + 1)
    return out.astype(jnp.uint8).reshape(*s[:axis], s[axis] // n_codes * n_bytes, *s[axis + 1 :])


def _unpack(packed: jax.Array, bits: int, axis: int) -> jax.Array:
    """The inverse of `_pack`: uint8 bytes -> uint8 codes along `axis`."""
    if bits == 8:
        return packed
    n_codes, n_bytes = chunk(bits)
    s = packed.shape
    b = packed.astype(jnp.uint32).reshape(*s[:axis], s[axis] // n_bytes, n_bytes, *s[axis + 1 :])
    shifts = _along(jnp.arange(n_bytes, dtype=jnp.uint32) * 8, b.ndim, axis + 1)
    word = jnp.sum(b << shifts, axis=axis + 1, keepdims=True)
    code_shifts = _along(jnp.arange(n_codes, dtype=jnp.uint32) * bits, b.ndim, axis + 1)
    q = (word >> code_shifts) & (2**bits - 1)
    return q.astype(jnp.uint8).reshape(*s[:axis], s[axis] // n_bytes * n_codes, *s[axis + 1 :])


def group_shape(shape: Sequence[int], n_in: int, n_out: int, group: int) -> tuple[int, ...]:
    """The shape of `scales` / `zeros` of a weight of `shape`: [*lead, groups, *out], the
    groups running over the flattened contracted dims (one group per channel)."""
    shape = tuple(shape)
    lead = len(shape) - n_in - n_out
    k = math.prod(shape[lead : lead + n_in])
    return (*shape[:lead], k // (group or k), *shape[lead + n_in :])


def quantize(
    w: jax.Array, *, bits: int, group: int, symmetric: bool, n_in: int, n_out: int
) -> QuantizedTensor:
    """Round-to-nearest of `w` [*lead, *in, *out] (jnp, jit-able): scales from each group's
    range in float32, cast to w's dtype, and the codes rounded against that stored scale, so
    dequantization is within half a step of w (up to the clipping of the extreme value).
    Symmetric: s = absmax / (2^(b-1) - 1/2), q = clip(round(w / s), -2^(b-1), 2^(b-1) - 1) +
    2^(b-1) (GPTQ's and compressed-tensors' scale). Asymmetric: the range [min(w, 0),
    max(w, 0)] over 2^b - 1 steps, z = clip(round(-min / s), 0, 2^b - 1),
    q = clip(round(w / s) + z, 0, 2^b - 1). An all-zero group takes s = 1. w / s is computed
    as w * (1 / s) in float32, round half to even."""
    shape = tuple(w.shape)
    gshape = group_shape(shape, n_in, n_out, group)
    lead = len(shape) - n_in - n_out
    g_axis = lead  # in the grouped view [*lead, groups, group, *out]
    grouped = w.astype(jnp.float32).reshape(*gshape[: g_axis + 1], -1, *gshape[g_axis + 1 :])
    scale, zero = grid(grouped, g_axis + 1, bits=bits, symmetric=symmetric, dtype=w.dtype)
    q = codes_of(grouped, scale, zero, bits).reshape(shape)
    return from_codes(
        q,
        scale.reshape(gshape),
        None if symmetric else zero.reshape(gshape),
        bits=bits,
        group=group,
        n_in=n_in,
        n_out=n_out,
        dtype=w.dtype,
    )


def grid(grouped: jax.Array, axis: int, *, bits: int, symmetric: bool, dtype):
    """(scale, zero) in float32 of each group of `grouped` (float32, its groups' values along
    `axis`, kept as a dim of 1), as `quantize` says; the scale rounded to `dtype`, as stored."""
    top = 2**bits - 1
    if symmetric:
        scale = jnp.max(jnp.abs(grouped), axis=axis, keepdims=True) * np.float32(2 / top)
        zero = jnp.full_like(scale, 2 ** (bits - 1))
    else:
        lo = jnp.minimum(jnp.min(grouped, axis=axis, keepdims=True), 0.0)
        hi = jnp.maximum(jnp.max(grouped, axis=axis, keepdims=True), 0.0)
        scale = (hi - lo) * np.float32(1 / top)
    scale = jnp.where(scale == 0, 1.0, scale).astype(dtype).astype(jnp.float32)
    if not symmetric:
        # Divisions as products with float32 reciprocals (of the constant, and one exact
        # division per group), as bitsandbytes rounds: XLA rewrites x / c so, and codes must
        # not depend on it.
        zero = jnp.clip(jnp.round(-lo * (1.0 / scale)), 0, top)
    return scale, zero


def codes_of(w: jax.Array, scale: jax.Array, zero, bits: int) -> jax.Array:
    """Codes (float32) of float32 values `w` on the grid (scale, zero) broadcast against it:
    clip(round(w * (1 / s)) + z, 0, 2^b - 1)."""
    return jnp.clip(jnp.round(w * (1.0 / scale)) + zero, 0, 2**bits - 1)


def from_codes(
    q: jax.Array, scales, zeros, *, bits: int, group: int, n_in: int, n_out: int, dtype
) -> QuantizedTensor:
    """The `QuantizedTensor` of codes `q` [*lead, *in, *out] (values < 2^bits), `scales` and
    (asymmetric) `zeros` [*lead, groups, *out]."""
    lead = q.ndim - n_in - n_out
    return QuantizedTensor(
        codes=_pack(q.astype(jnp.uint8), bits, lead + n_in - 1),
        scales=scales.astype(dtype),
        zeros=None if zeros is None else zeros.astype(jnp.uint8),
        bits=bits,
        group=group,
        n_in=n_in,
        n_out=n_out,
        dtype=np.dtype(dtype),
    )


def dequantize(t: QuantizedTensor, dtype=None) -> jax.Array:
    """(q - z) * s in float32, in `dtype` (default: the weight's). Works on any leading-dim
    slice and on shards of the lead / out dims."""
    q = _unpack(t.codes, t.bits, t.packed_axis).astype(jnp.float32)
    shape = q.shape
    g_axis = q.ndim - t.n_in - t.n_out
    gshape = t.scales.shape
    gq = q.reshape(*gshape[: g_axis + 1], -1, *gshape[g_axis + 1 :])
    scale = jnp.expand_dims(t.scales.astype(jnp.float32), g_axis + 1)
    zero = (
        2 ** (t.bits - 1)
        if t.zeros is None
        else jnp.expand_dims(t.zeros.astype(jnp.float32), g_axis + 1)
    )
    w = ((gq - zero) * scale).reshape(shape)
    return w.astype(t.dtype if dtype is None else dtype)


def quantized_axes(t: QuantizedTensor, axes: Sequence[str | None]) -> QuantizedTensor:
    """Logical axes of the leaves of `t` (a quantized weight that had `axes`), as a tree of
    the same structure: codes the weight's own; scales / zeros the weight's on the lead and
    out dims, None on the groups."""
    axes = tuple(axes)
    lead = len(axes) - t.n_in - t.n_out
    g_axes = (*axes[:lead], None, *axes[lead + t.n_in :])
    return t.replace(codes=axes, scales=g_axes, zeros=None if t.zeros is None else g_axes)


def abstract(
    shape: Sequence[int],
    dtype,
    *,
    bits: int,
    group: int,
    symmetric: bool,
    n_in: int,
    n_out: int,
) -> QuantizedTensor:
    """The `QuantizedTensor` of a weight of `shape` / `dtype` as ShapeDtypeStructs."""
    spec = jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.eval_shape(
        lambda w: quantize(w, bits=bits, group=group, symmetric=symmetric, n_in=n_in, n_out=n_out),
        spec,
    )


def packed_nbytes(
    shape: Sequence[int], dtype, *, bits: int, group: int, symmetric: bool, n_in: int, n_out: int
) -> int:
    """Bytes of the `QuantizedTensor` of a weight of `shape`: codes, scales and zero points."""
    t = abstract(shape, dtype, bits=bits, group=group, symmetric=symmetric, n_in=n_in, n_out=n_out)
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(t))
