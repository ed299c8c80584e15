"""Shampoo (Gupta, Koren & Singer 2018, "Shampoo: Preconditioned Stochastic Tensor
Optimization"), in the practical form of Anil et al. 2020 ("Scalable Second Order Optimization
for Deep Learning"): inverse roots recomputed every few steps, Adam grafting, momentum.

Each matrix G (m x n; stacked layers and experts batched over) keeps two statistics,
L += G G^T and R += G^T G, and every `precondition_every` steps their inverse fourth roots
L^{-1/4}, R^{-1/4} (from `eigh`, with a relative ridge of `RIDGE` times the largest eigenvalue,
as Anil et al.'s `matrix_epsilon`). The direction L^{-1/4} G R^{-1/4} takes its size from Adam
(grafting): it is rescaled to the Frobenius norm of G / (sqrt(v_hat) + eps), per matrix, then
goes through momentum b1 with bias correction. Embeddings, the LM head and vectors take Adam.

Matrices, their rows and columns, come from the parameters' logical axes (`matrix_dims`), the
same reading as Muon's: kernels are (inputs..., outputs...). The preconditioners are kept at
their parameter's rank (trailing dims of 1), so the train state shards them like the parameter
on the dims whose sizes allow (`jaxllm.train.state`); parameters without one keep a scalar 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllm.optim.lapack import one_at_a_time

STACKED = ("layers", "expert")  # axes that index separate matrices: batched over
RIDGE = 1e-6  # added to each statistic, times its largest eigenvalue, before the inverse root
HIGHEST = jax.lax.Precision.HIGHEST  # statistics in true float32, not a TF32 / bf16 pass


def matrix_dims(ax: tuple) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(batch, row, column) dims of a parameter with logical axes `ax` seen as a stack of
    matrices, or None for vectors and anything indexed by `vocab` (embeddings, LM head).
    Kernels are (inputs..., outputs...): `embed` last is the output, else the first inner dim
    is the input."""
    batch = tuple(i for i, a in enumerate(ax) if a in STACKED)
    inner = [i for i, a in enumerate(ax) if a not in STACKED]
    if len(inner) < 2 or "vocab" in ax:
        return None
    if ax[inner[-1]] == "embed":
        return batch, tuple(inner[:-1]), (inner[-1],)
    return batch, (inner[0],), tuple(inner[1:])


def to_matrix(x, dims):
    """`x` as a (B, m, n) stack of float32 matrices."""
    batch, rows, cols = dims
    size = lambda ds: math.prod(x.shape[d] for d in ds)  # noqa: E731
    shape = (size(batch), size(rows), size(cols))
    return jnp.transpose(x, batch + rows + cols).astype(jnp.float32).reshape(shape)


def from_matrix(y, dims, shape):
    """Inverse of `to_matrix` back to the parameter's `shape` (float32)."""
    order = dims[0] + dims[1] + dims[2]
    y = y.reshape(tuple(shape[d] for d in order))
    return jnp.transpose(y, tuple(order.index(i) for i in range(len(shape))))


def side_shapes(shape, dims) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Stored shapes of the left (m x m) and right (n x n) preconditioners of a parameter:
    (B, m, m) and (B, n, n) padded with trailing 1s to the parameter's rank; (m, m) and (n, n)
    for a single matrix."""
    batch, rows, cols = dims
    b = math.prod(shape[d] for d in batch)
    m, n = math.prod(shape[d] for d in rows), math.prod(shape[d] for d in cols)
    if len(shape) == 2:
        return (m, m), (n, n)
    pad = (1,) * (len(shape) - 3)
    return (b, m, m, *pad), (b, n, n, *pad)


def as_square(x):
    """A stored preconditioner as its (B, k, k) stack."""
    return x[None] if x.ndim == 2 else x.reshape(x.shape[:3])


def mm(a, b, ta=False, tb=False):
    """Batched a @ b (a^T, b^T where asked) in full float32."""
    sa, sb = ("bji" if ta else "bij"), ("bkj" if tb else "bjk")
    return jnp.einsum(f"{sa},{sb}->bik", a, b, precision=HIGHEST)


def inverse_root(stat, p: float):
    """stat^p (p < 0) of a stack of symmetric PSD matrices via eigh, with the ridge."""
    w, q = jnp.linalg.eigh((stat + jnp.swapaxes(stat, -1, -2)) / 2)
    w = jnp.maximum(w, 0.0)
    top = jnp.max(w, axis=-1, keepdims=True)
    w = (w + RIDGE * top + 1e-30) ** p
    return mm(q * w[:, None, :], q, tb=True)


def adam_leaf(m, v, g, b1, b2, eps, c1, c2):
    """One Adam step of a leaf: (direction, m, v)."""
    g = g.astype(jnp.float32)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return (m / c1) / (jnp.sqrt(v / c2) + eps), m, v


def leaf_dims(axes, params):
    """The tree of `matrix_dims` over the parameters (None where Adam steps)."""
    return jax.tree.map(
        lambda ax, _: matrix_dims(ax), axes, params, is_leaf=lambda x: isinstance(x, tuple)
    )


def init_sides(dims_tree, params, fill):
    """Two trees of stored preconditioners (left, right) built by `fill(shape)`; scalar 0 for
    parameters that take Adam."""

    def one(side):
        def leaf(dims, p):
            if dims is None:
                return jnp.zeros((), jnp.float32)
            return fill(side_shapes(p.shape, dims)[side])

        return jax.tree.map(leaf, dims_tree, params, is_leaf=_is_dims)

    return one(0), one(1)


def eye(shape):
    """Stacked identities in the stored preconditioner shape."""
    k = shape[-1] if len(shape) == 2 else shape[1]
    return jnp.broadcast_to(jnp.eye(k, dtype=jnp.float32), shape[:3]).reshape(shape)


def _is_dims(x):
    return x is None or (isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], tuple))


def map_dims(fn, dims_tree, *trees):
    """`jax.tree.map` over the parameters' dims tree (leaves: `matrix_dims` or None)."""
    return jax.tree.map(fn, dims_tree, *trees, is_leaf=_is_dims)


def serial_map(fn, dims_tree, stats: tuple) -> tuple:
    """`fn` (an eigendecomposition) on every matrix leaf of each tree in `stats`, one call after
    another (`lapack.one_at_a_time`); leaves whose dims are None stay as they are."""
    flat = [
        jax.tree.flatten(map_dims(lambda d, s: (d, s), dims_tree, t), is_leaf=_is_pair)
        for t in stats
    ]
    pairs = [pair for leaves, _ in flat for pair in leaves]
    done = iter(one_at_a_time(fn, [x for d, x in pairs if d is not None]))
    outs = []
    for leaves, treedef in flat:
        new = [x if d is None else next(done) for d, x in leaves]
        outs.append(jax.tree.unflatten(treedef, new))
    return tuple(outs)


def _is_pair(x):
    return isinstance(x, tuple) and len(x) == 2 and (x[0] is None or _is_dims(x[0]))


def refresh_due(count, every: int):
    """Steps 1, 1 + every, 1 + 2 every, ... recompute the preconditioners (count 1-based)."""
    return (count - 1) % every == 0


class ShampooState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken
    mu: optax.Params  # momentum of the grafted direction (Adam's first moment elsewhere)
    nu: optax.Params  # Adam's second moment (grafting norm, or Adam's own update)
    stat_l: optax.Params  # L = sum of G G^T, per matrix (stored shape: `side_shapes`)
    stat_r: optax.Params  # R = sum of G^T G
    root_l: optax.Params  # L^{-1/4}, as of the last refresh
    root_r: optax.Params  # R^{-1/4}


def scale_by_shampoo(
    axes, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, every: int = 10
) -> optax.GradientTransformation:
    """The Shampoo direction with Adam grafting. `axes`: the parameters' logical-axis tuples;
    `every`: steps between inverse-root refreshes (`optim.precondition_every`)."""

    def init(params):
        dims = leaf_dims(axes, params)
        zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
        stat_l, stat_r = init_sides(dims, params, lambda s: jnp.zeros(s, jnp.float32))
        root_l, root_r = init_sides(dims, params, eye)
        mu, nu = jax.tree.map(zeros, params), jax.tree.map(zeros, params)
        return ShampooState(jnp.zeros((), jnp.int32), mu, nu, stat_l, stat_r, root_l, root_r)

    def update(updates, state, params=None):
        del params
        dims = leaf_dims(axes, updates)
        count = optax.safe_increment(state.count)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def stats(d, g, sl, sr):
            if d is None:
                return sl, sr
            gm = to_matrix(g, d)
            return (
                sl + mm(gm, gm, tb=True).reshape(sl.shape),
                sr + mm(gm, gm, ta=True).reshape(sr.shape),
            )

        pairs = map_dims(stats, dims, updates, state.stat_l, state.stat_r)
        stat_l = map_dims(lambda d, p: p[0], dims, pairs)
        stat_r = map_dims(lambda d, p: p[1], dims, pairs)

        def root(s):
            return inverse_root(as_square(s), -0.25).reshape(s.shape)

        root_l, root_r = jax.lax.cond(
            refresh_due(count, every),
            lambda: serial_map(root, dims, (stat_l, stat_r)),
            lambda: (state.root_l, state.root_r),
        )

        def step(d, g, m, v, pl, pr):
            if d is None:
                out, m, v = adam_leaf(m, v, g, b1, b2, eps, c1, c2)
                return out.astype(g.dtype), m, v
            g32 = g.astype(jnp.float32)
            v = b2 * v + (1 - b2) * g32 * g32
            graft = to_matrix(g32 / (jnp.sqrt(v / c2) + eps), d)
            direction = mm(mm(as_square(pl), to_matrix(g32, d)), as_square(pr))
            norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))  # noqa: E731
            scaled = direction * (norm(graft) / jnp.maximum(norm(direction), 1e-30))
            m = b1 * m + (1 - b1) * from_matrix(scaled, d, g.shape)
            return (m / c1).astype(g.dtype), m, v

        out = map_dims(step, dims, updates, state.mu, state.nu, root_l, root_r)
        pick = lambda i: map_dims(lambda d, t: t[i], dims, out)  # noqa: E731
        new = ShampooState(count, pick(1), pick(2), stat_l, stat_r, root_l, root_r)
        return pick(0), new

    return optax.GradientTransformation(init, update)
