"""LDAdam (Robert et al. 2024, "LDAdam: Adaptive Optimization from Low-Dimensional Gradient
Statistics").

Like GaLore, Adam runs in a rank-r subspace of each matrix (matrices, sides and state layout as
in `galore`), but the subspace moves every step and nothing is lost when it does:

- the subspace is the top-r singular vectors of rho * (the previous momentum, bias-corrected,
  back in full space) + (1 - rho) * (the gradient plus the error buffer); the first step uses
  the gradient alone;
- projection-aware state update: with C = P_prev^T P the change of basis, the momentum moves
  to m' = m C and the second moment to |(v - m^2) C^2 + m'^2| (bias-corrected as written
  there), so v keeps the variance and the moved mean;
- generalized error feedback: the buffer keeps what the projection dropped from the gradient
  plus what the change of basis dropped from the momentum (times b1 / (1 - b1), the gradient
  that would have carried it), and is added to the next gradient.

This follows the authors' reference implementation, with two readings: the subspace is an
exact SVD (theirs: one block power iteration warm-started from P_prev, an approximation of
it), and rho is `optim.b1` (their default has rho = b1). The state per matrix is P (its
smaller side x r), m and v (r x its larger side) and the full-size error buffer; embeddings,
the LM head and vectors take plain Adam.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllm.optim.galore import (
    _from_matrix,
    _red_out,
    _swap,
    as_matrix,
    get,
    matrix_dims,
    oriented,
    put,
    side_shape,
    sides,
    top_right_vectors,
)
from jaxllm.optim.lapack import after


class LDAdamState(NamedTuple):
    count: jax.Array  # int32 scalar: steps taken
    proj: optax.Params  # P per matrix (float32); others None
    mu: optax.Params  # low-rank first moment for matrices, full for the others
    nu: optax.Params  # low-rank second moment for matrices, full for the others
    err: optax.Params  # the error buffer, the matrix's shape; others None


def scale_by_ldadam(
    axes, rank: int, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8
) -> optax.GradientTransformation:
    """The LDAdam direction (before the learning rate). `axes`: the parameters' logical axes."""
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
    flat_dims = lambda: [matrix_dims(ax) for ax in jax.tree.leaves(axes, is_leaf=is_axes)]  # noqa: E731

    def init(params):
        leaves, tdef = jax.tree.flatten(params)
        proj, mu, err = [], [], []
        for p, d in zip(leaves, flat_dims()):
            if d is None:
                proj.append(None), mu.append(jnp.zeros_like(p)), err.append(None)
                continue
            proj_side, other, r = sides(p.shape, d, rank)
            q = side_shape(p.shape, d, proj_side)
            stack = tuple(p.shape[i] for i in d.stacked)
            n_q = math.prod(q)
            proj.append(put(jnp.zeros((*stack, n_q, r), jnp.float32), d, proj_side, q))
            o = side_shape(p.shape, d, other)
            n_o = math.prod(o)
            mu.append(put(jnp.zeros((*stack, n_o, r), p.dtype), d, other, o))
            err.append(jnp.zeros_like(p))
        unf = lambda xs: jax.tree.unflatten(tdef, xs)  # noqa: E731
        return LDAdamState(jnp.zeros((), jnp.int32), unf(proj), unf(mu), unf(mu), unf(err))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        c1, c2 = 1 - b1**t, 1 - b2**t
        # the previous step's corrections; 1 on the first step, where m, v and P are zero
        first = state.count == 0
        c1p = jnp.where(first, 1.0, 1 - b1 ** (t - 1))
        c2p = jnp.where(first, 1.0, 1 - b2 ** (t - 1))
        leaves, tdef = jax.tree.flatten(updates)
        flat = [tdef.flatten_up_to(x) for x in (state.proj, state.mu, state.nu, state.err)]
        out, proj, mu, nu, err = [], [], [], [], []
        last = None  # the previous matrix's basis: one SVD at a time (lapack)
        for g, d, pr, m, v, e in zip(leaves, flat_dims(), *flat):
            g = g.astype(jnp.float32)
            if d is None:  # Adam
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * jnp.square(g)
                out.append((m / c1) / (jnp.sqrt(v / c2) + eps))
                proj.append(pr), mu.append(m), nu.append(v), err.append(e)
                continue
            proj_side, other, r = sides(g.shape, d, rank)
            o_shape = side_shape(g.shape, d, other)
            x = oriented(as_matrix(g + e, d), proj_side)  # (stack, p, q), P: (stack, q, r)
            b_prev, m, v = get(pr, d, proj_side), get(m, d, other), get(v, d, other)
            m_full = m @ _swap(b_prev)
            y = jnp.where(first, x, b1 * m_full / c1p + (1 - b1) * x)
            b = last = top_right_vectors(after(y, last), r)  # one SVD at a time (lapack)
            low = x @ b
            change = _swap(b_prev) @ b  # (stack, r, r)
            m_moved = m @ change
            v_moved = jnp.abs(
                c2p * ((v / c2p - jnp.square(m) / c1p**2) @ jnp.square(change))
                + c2p * jnp.square(m_moved) / c1p**2
            )
            e = x - low @ _swap(b) + b1 / (1 - b1) * (m_full - m_moved @ _swap(b))
            m = b1 * m_moved + (1 - b1) * low
            v = b2 * v_moved + (1 - b2) * jnp.square(low)
            n = (m / c1) / (jnp.sqrt(v / c2) + eps)
            full = lambda z, d=d, ps=proj_side, s=g.shape: _from_matrix(  # noqa: E731
                oriented(z, ps), d, *_red_out(s, d)
            )
            out.append(full(n @ _swap(b)))
            proj.append(put(b, d, proj_side, side_shape(g.shape, d, proj_side)))
            mu.append(put(m, d, other, o_shape)), nu.append(put(v, d, other, o_shape))
            err.append(full(e))
        unf = lambda xs: jax.tree.unflatten(tdef, xs)  # noqa: E731
        return unf(out), LDAdamState(count, unf(proj), unf(mu), unf(nu), unf(err))

    return optax.GradientTransformation(init, update)
