"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in
the eigenbasis of Shampoo's preconditioner.

Each matrix G (m x n; stacked layers and experts batched over) keeps Shampoo's statistics as
moving averages, L <- b2 L + (1 - b2) G G^T and R <- b2 R + (1 - b2) G^T G, and their
eigenvectors Q_L, Q_R, recomputed with `eigh` every `precondition_every` steps (the paper
refreshes with one power-iteration-and-QR step; `eigh` is the exact basis at a higher cost
every few steps). The first moment M is kept in the parameter's own basis, the second moment V
in the rotated one: V <- b2 V + (1 - b2) (Q_L^T G Q_R)^2, and the direction is
Q_L [(Q_L^T M_hat Q_R) / (sqrt(V_hat) + eps)] Q_R^T. As in the paper's code, a step projects
with the basis of the statistics before its own gradient (which then updates them), the first
call only sets up the statistics and the basis (update 0; moments and bias correction start at
the second), and V is not rotated when the basis changes. Embeddings, the LM head and vectors
take Adam. Matrices and the stored shapes follow `shampoo` (`matrix_dims`, `side_shapes`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllm.optim.shampoo import (
    adam_leaf,
    as_square,
    eye,
    from_matrix,
    init_sides,
    leaf_dims,
    map_dims,
    mm,
    refresh_due,
    serial_map,
    to_matrix,
)


class SoapState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken, for bias correction
    mu: optax.Params  # first moment, in the parameter's basis
    nu: optax.Params  # second moment, in the eigenbasis (parameter-shaped)
    stat_l: optax.Params  # moving average of G G^T, per matrix (stored shape: `side_shapes`)
    stat_r: optax.Params  # moving average of G^T G
    basis_l: optax.Params  # eigenvectors Q_L of stat_l, as of the last refresh
    basis_r: optax.Params  # eigenvectors Q_R of stat_r


def eigenbasis(stat):
    """Eigenvectors (columns) of a stack of symmetric matrices."""
    return jnp.linalg.eigh((stat + jnp.swapaxes(stat, -1, -2)) / 2)[1]


def scale_by_soap(
    axes, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, every: int = 10
) -> optax.GradientTransformation:
    """The SOAP direction. `axes`: the parameters' logical-axis tuples; `every`: steps between
    eigenbasis refreshes (`optim.precondition_every`)."""

    def init(params):
        dims = leaf_dims(axes, params)
        zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
        stat_l, stat_r = init_sides(dims, params, lambda s: jnp.zeros(s, jnp.float32))
        basis_l, basis_r = init_sides(dims, params, eye)
        mu, nu = jax.tree.map(zeros, params), jax.tree.map(zeros, params)
        return SoapState(jnp.zeros((), jnp.int32), mu, nu, stat_l, stat_r, basis_l, basis_r)

    def update(updates, state, params=None):
        del params
        dims = leaf_dims(axes, updates)
        count = optax.safe_increment(state.count)
        t = (count - 1).astype(jnp.float32)  # Adam steps taken, this one included
        c1, c2 = 1 - b1**t, 1 - b2**t

        def step(d, g, m, v, ql, qr):
            g32 = g.astype(jnp.float32)
            if d is None:
                out, m2, v2 = adam_leaf(m, v, g, b1, b2, eps, c1, c2)
            else:
                ql, qr = as_square(ql), as_square(qr)
                rotate = lambda x: mm(mm(ql, x, ta=True), qr)  # noqa: E731  Q_L^T x Q_R
                m2 = b1 * m + (1 - b1) * g32
                g_rot = rotate(to_matrix(g32, d))
                v2 = b2 * v + (1 - b2) * from_matrix(g_rot * g_rot, d, g.shape)
                n_rot = (rotate(to_matrix(m2, d)) / c1) / (jnp.sqrt(to_matrix(v2, d) / c2) + eps)
                out = from_matrix(mm(mm(ql, n_rot), qr, tb=True), d, g.shape)  # Q_L n Q_R^T
            # the first call only sets up the statistics and the basis: no step, no moments
            first = count == 1
            out = jnp.where(first, 0.0, out)
            return out.astype(g.dtype), jnp.where(first, m, m2), jnp.where(first, v, v2)

        out = map_dims(step, dims, updates, state.mu, state.nu, state.basis_l, state.basis_r)
        pick = lambda i: map_dims(lambda d, t: t[i], dims, out)  # noqa: E731

        def stats(d, g, sl, sr):
            if d is None:
                return sl, sr
            gm = to_matrix(g, d)
            left = b2 * sl + (1 - b2) * mm(gm, gm, tb=True).reshape(sl.shape)
            return left, b2 * sr + (1 - b2) * mm(gm, gm, ta=True).reshape(sr.shape)

        pairs = map_dims(stats, dims, updates, state.stat_l, state.stat_r)
        stat_l = map_dims(lambda d, p: p[0], dims, pairs)
        stat_r = map_dims(lambda d, p: p[1], dims, pairs)

        def basis(s):
            return eigenbasis(as_square(s)).reshape(s.shape)

        # after steps 1, 1 + every, ...: the next steps' basis, from statistics up to this one
        basis_l, basis_r = jax.lax.cond(
            refresh_due(count, every),
            lambda: serial_map(basis, dims, (stat_l, stat_r)),
            lambda: (state.basis_l, state.basis_r),
        )
        new = SoapState(count, pick(1), pick(2), stat_l, stat_r, basis_l, basis_r)
        return pick(0), new

    return optax.GradientTransformation(init, update)
