"""GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection") and Q-GaLore (Zhang et al. 2024, "Q-GaLore: Quantized GaLore with INT4 Projection
and Layer-Adaptive Low-Rank Gradients").

Each matrix's gradient G (m x n, its input dims by its output dims, from the logical axes;
stacked layers and experts are separate matrices) is projected onto the top-r singular vectors
of its smaller side, R = P^T G (m < n) or G P, P refreshed from the current gradient every T
steps; Adam runs on R, and the step is P N (or N P^T) times `scale`. Embeddings, the LM head and
vectors take plain Adam, as in the paper. optax.contrib.galore flattens a tensor into one matrix
and keeps flat states; this one batches stacked dims and keeps every state in its parameter's
rank with the parameter's dims (the low-rank side's dims replaced by r, 1, ...), so each state
shards like its parameter (`jaxllm.train.state.state_shardings`).

Singular vectors are defined up to sign; each column of P is flipped so that its largest entry
is positive, so the result does not depend on the SVD routine's choice.

Q-GaLore stores P in int4: two codes per byte (packed along r) plus one float32 scale per
column (absmax / 7), and projects with the dequantized P. Its weights are int8: the state keeps,
for every matrix, int8 codes in the parameter's shape and one float32 absmax / 127 per group of
256 along the last dim; each step adds the update to the dequantized weights and re-quantizes
with stochastic rounding, and the stored parameters become the dequantized int8 weights (so the
float parameters jaxllm keeps equal them). The paper's layer-adaptive lazy refresh of P is not
here: P is refreshed every T steps as in GaLore.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxllm.blockwise import blocks_per_row
from jaxllm.optim.adam_mini import STACKED
from jaxllm.optim.lapack import after

WEIGHT_GROUP = 256  # Q-GaLore's int8 weight group along the last dim


class Dims(NamedTuple):
    """A parameter seen as a batch of matrices: stacked dims, input (reduction) dims, output
    dims."""

    stacked: tuple[int, ...]
    red: tuple[int, ...]
    out: tuple[int, ...]


def matrix_dims(ax: tuple[str | None, ...]) -> Dims | None:
    """The matrix dims of a parameter with logical axes `ax`; None for embeddings, the LM head
    and vectors. Kernels are (inputs..., outputs...): `embed` last is the output."""
    inner = [i for i, a in enumerate(ax) if a not in STACKED]
    if len(inner) < 2 or "vocab" in ax:
        return None
    stacked = tuple(i for i, a in enumerate(ax) if a in STACKED)
    if ax[inner[-1]] == "embed":
        return Dims(stacked, tuple(inner[:-1]), (inner[-1],))
    return Dims(stacked, (inner[0],), tuple(inner[1:]))


def _swap(x):
    return jnp.swapaxes(x, -1, -2)


def as_matrix(x, d: Dims):
    """(stacked..., prod(red dims), prod(out dims))."""
    y = jnp.transpose(x, d.stacked + d.red + d.out)
    s = len(d.stacked)
    return y.reshape(*y.shape[:s], math.prod(y.shape[s : s + len(d.red)]), -1)


def _from_matrix(y, d: Dims, red_shape, out_shape):
    perm = d.stacked + d.red + d.out
    return jnp.transpose(y.reshape(*y.shape[:-2], *red_shape, *out_shape), np.argsort(perm))


def _padded(k, n):
    return (k,) + (1,) * (n - 1)


def put(y, d: Dims, side: str, side_shape):
    """y (stacked..., a, k), `a` running over the `side` ("red" or "out") dims of shape
    `side_shape`, into the parameter's rank and dim order (the other side's dims: k, 1, ...)."""
    if side == "red":
        return _from_matrix(y, d, side_shape, _padded(y.shape[-1], len(d.out)))
    return _from_matrix(_swap(y), d, _padded(y.shape[-1], len(d.red)), side_shape)


def get(x, d: Dims, side: str):
    """The inverse of `put`: (stacked..., a, k)."""
    y = as_matrix(x, d)
    return y if side == "red" else _swap(y)


def sides(shape, d: Dims, rank: int):
    """(projected side, other side, effective rank): P spans the smaller side (GaLore's choice;
    the rows when m < n), R keeps the other side's size."""
    m = math.prod(shape[i] for i in d.red)
    n = math.prod(shape[i] for i in d.out)
    return ("red", "out", min(rank, m)) if m < n else ("out", "red", min(rank, n))


def side_shape(shape, d: Dims, side: str):
    return tuple(shape[i] for i in (d.red if side == "red" else d.out))


def oriented(g2, proj_side: str):
    """The matrix with the projected side last: X (stacked..., p, q), P (q x r), R = X P."""
    return _swap(g2) if proj_side == "red" else g2


def top_right_vectors(x, r: int):
    """The top-r right singular vectors of x (stacked..., p, q) as columns (stacked..., q, r),
    each with its largest entry positive."""
    _, _, vh = jnp.linalg.svd(x.astype(jnp.float32), full_matrices=False)
    b = _swap(vh[..., :r, :])
    idx = jnp.argmax(jnp.abs(b), axis=-2, keepdims=True)
    return b * jnp.sign(jnp.take_along_axis(b, idx, axis=-2))


def quantize_int4(b):
    """Columns of b (…, q, r) -> (uint8 codes packed two per byte along r, float32 scale per
    column (…, 1, r)); symmetric, 15 levels."""
    scale = jnp.max(jnp.abs(b), axis=-2, keepdims=True) / 7
    scale = jnp.where(scale == 0, 1.0, scale)
    codes = (jnp.clip(jnp.round(b / scale), -7, 7) + 8).astype(jnp.uint8)
    if codes.shape[-1] % 2:
        codes = jnp.concatenate([codes, jnp.full(codes.shape[:-1] + (1,), 8, jnp.uint8)], -1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def dequantize_int4(packed, scale):
    r = scale.shape[-1]
    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return (codes[..., :r].astype(jnp.float32) - 8) * scale


class GaLoreState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken; P is refreshed when count % T == 0
    proj: optax.Params  # P per matrix (GaLore: float32; Q-GaLore: packed int4); others None
    proj_scale: optax.Params  # Q-GaLore: float32 scale per column of P; otherwise None
    inner: optax.OptState  # Adam's moments: low-rank R's shape for matrices, full otherwise


def scale_by_galore(
    axes,
    rank: int,
    update_gap: int,
    scale: float,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    int4: bool = False,
) -> optax.GradientTransformation:
    """The GaLore direction (Adam in each matrix's low-rank space). `axes`: the parameters'
    logical axes; `int4`: keep P quantized (Q-GaLore)."""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    flat_dims = lambda: [matrix_dims(ax) for ax in jax.tree.leaves(axes, is_leaf=is_axes)]  # noqa: E731

    def store(b, d, shape, proj_side):
        if not int4:
            return put(b, d, proj_side, side_shape(shape, d, proj_side)), None
        packed, s = quantize_int4(b)
        ones = (1,) * len(side_shape(shape, d, proj_side))
        return put(packed, d, proj_side, side_shape(shape, d, proj_side)), put(
            s, d, proj_side, ones
        )

    def load(p, s, d, proj_side):
        if not int4:
            return get(p, d, proj_side)
        return dequantize_int4(get(p, d, proj_side), get(s, d, proj_side))

    def init(params):
        leaves, tdef = jax.tree.flatten(params)
        proj, scales, low = [], [], []
        for p, d in zip(leaves, flat_dims()):
            if d is None:
                proj.append(None), scales.append(None), low.append(p)
                continue
            proj_side, other, r = sides(p.shape, d, rank)
            q = math.prod(side_shape(p.shape, d, proj_side))
            stack = tuple(p.shape[i] for i in d.stacked)
            pr, sc = store(jnp.zeros((*stack, q, r), jnp.float32), d, p.shape, proj_side)
            proj.append(pr), scales.append(sc)
            n_other = math.prod(side_shape(p.shape, d, other))
            low_r = jnp.zeros((*stack, n_other, r), p.dtype)
            low.append(put(low_r, d, other, side_shape(p.shape, d, other)))
        unf = lambda xs: jax.tree.unflatten(tdef, xs)  # noqa: E731
        return GaLoreState(jnp.zeros((), jnp.int32), unf(proj), unf(scales), adam.init(unf(low)))

    def update(updates, state, params=None):
        del params
        refresh = state.count % update_gap == 0
        leaves, tdef = jax.tree.flatten(updates)
        dims = flat_dims()
        proj, scales, low, bases = [], [], [], []
        last = None  # the previous matrix's projection: refreshes run one at a time (lapack)
        for g, d, pr, sc in zip(
            leaves, dims, tdef.flatten_up_to(state.proj), tdef.flatten_up_to(state.proj_scale)
        ):
            if d is None:
                proj.append(pr), scales.append(sc), low.append(g), bases.append(None)
                continue
            proj_side, other, r = sides(g.shape, d, rank)
            x = oriented(as_matrix(g, d), proj_side)
            pr, sc = jax.lax.cond(
                refresh,
                lambda x=after(x, last), r=r, d=d, ps=proj_side: store(
                    top_right_vectors(x, r), d, g.shape, ps
                ),
                lambda pr=pr, sc=sc: (pr, sc),
            )
            last = sc
            b = load(pr, sc, d, proj_side).astype(g.dtype)
            proj.append(pr), scales.append(sc), bases.append(b)
            low.append(put(x @ b, d, other, side_shape(g.shape, d, other)))
        n, inner = adam.update(jax.tree.unflatten(tdef, low), state.inner)
        out = []
        for g, d, b, nl in zip(leaves, dims, bases, tdef.flatten_up_to(n)):
            if d is None:
                out.append(nl)
                continue
            proj_side, other, _ = sides(g.shape, d, rank)
            full = oriented(get(nl, d, other) @ _swap(b), proj_side)
            out.append(scale * _from_matrix(full, d, *_red_out(g.shape, d)))
        unf = lambda xs: jax.tree.unflatten(tdef, xs)  # noqa: E731
        count = optax.safe_increment(state.count)
        return unf(out), GaLoreState(count, unf(proj), unf(scales), inner)

    return optax.GradientTransformation(init, update)


def _red_out(shape, d: Dims):
    return side_shape(shape, d, "red"), side_shape(shape, d, "out")


# ------------------------------------------------------------------ Q-GaLore's int8 weights


def quantize_int8_sr(w, key):
    """w -> (int8 codes, float32 absmax / 127 per group of WEIGHT_GROUP along the last dim),
    rounding stochastically: floor(w / s + u), u uniform in [0, 1). key None: nearest."""
    n, size = blocks_per_row(w.shape[-1], WEIGHT_GROUP)
    pad = n * size - w.shape[-1]
    wb = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)]).reshape(*w.shape[:-1], n, size)
    s = jnp.max(jnp.abs(wb), axis=-1) / 127
    s = jnp.where(s == 0, 1.0, s)
    x = wb / s[..., None]
    if key is None:
        q = jnp.round(x)
    else:
        q = jnp.floor(x + jax.random.uniform(key, x.shape))
    q = jnp.clip(q, -127, 127).reshape(*w.shape[:-1], n * size)[..., : w.shape[-1]]
    return q.astype(jnp.int8), s


def dequantize_int8(q, s):
    n, size = blocks_per_row(q.shape[-1], WEIGHT_GROUP)
    return q.astype(jnp.float32) * jnp.repeat(s, size, axis=-1)[..., : q.shape[-1]]


def rounding_key(count, index):
    """The stochastic-rounding key of step `count` (0-based) for the index-th parameter leaf."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), count), index)


class Int8WeightsState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken (the rounding noise's seed)
    codes: optax.Params  # int8 weights, the parameter's shape; non-matrices None
    scales: optax.Params  # float32 absmax / 127 per group; non-matrices None
    inner: optax.OptState


def with_int8_weights(inner: optax.GradientTransformation, axes) -> optax.GradientTransformation:
    """`inner` stepping int8 weights (Q-GaLore) for the matrices among `axes`: the update it
    returns takes each stored matrix to its new int8 weights, dequantized."""
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    flat_dims = lambda: [matrix_dims(ax) for ax in jax.tree.leaves(axes, is_leaf=is_axes)]  # noqa: E731

    def init(params):
        leaves, tdef = jax.tree.flatten(params)
        codes, scales = [], []
        for p, d in zip(leaves, flat_dims()):
            q, s = quantize_int8_sr(p, None) if d is not None else (None, None)
            codes.append(q), scales.append(s)
        unf = lambda xs: jax.tree.unflatten(tdef, xs)  # noqa: E731
        return Int8WeightsState(
            jnp.zeros((), jnp.int32), unf(codes), unf(scales), inner.init(params)
        )

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("q_galore's int8 weights need the parameters in update()")
        leaves, tdef = jax.tree.flatten(params)
        dims = flat_dims()
        qs, ss = tdef.flatten_up_to(state.codes), tdef.flatten_up_to(state.scales)
        w = [p if d is None else dequantize_int8(q, s) for p, d, q, s in zip(leaves, dims, qs, ss)]
        u, inner_state = inner.update(grads, state.inner, jax.tree.unflatten(tdef, w))
        out, codes, scales = [], [], []
        for i, (p, d, wi, ui) in enumerate(zip(leaves, dims, w, tdef.flatten_up_to(u))):
            if d is None:
                out.append(ui), codes.append(qs[i]), scales.append(ss[i])
                continue
            q, s = quantize_int8_sr(wi + ui, rounding_key(state.count, i))
            out.append((dequantize_int8(q, s) - p).astype(p.dtype))
            codes.append(q), scales.append(s)
        unf = lambda xs: jax.tree.unflatten(tdef, xs)  # noqa: E731
        count = optax.safe_increment(state.count)
        return unf(out), Int8WeightsState(count, unf(codes), unf(scales), inner_state)

    return optax.GradientTransformation(init, update)
