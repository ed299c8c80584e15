"""CAME (Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient Optimization").

Adafactor's factored second moment with a first moment, and a second factored statistic, the
*instability* (u - m)^2 of the normalised update u against its running mean m, whose inverse
root scales the step: confident (stable) entries move further. Per matrix the state is m (the
parameter's shape) plus four factor vectors (rows and columns of v and of the instability),
about 4 bytes per parameter. This follows the authors' reference implementation (Algorithm 1;
no bias correction, eps1 = 1e-30 added to g^2, eps2 = 1e-16 to the instability, update RMS
clipped to 1); vectors keep an unfactored v and step by m alone, as there.

Which dims are factored comes from the logical axes: the two largest dims that do not index
stacked matrices (layers, experts), the others batched. A factor drops one dim, so it shards
like its parameter on the kept dims (`jaxllm.train.state.state_shardings`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllm.optim.adam_mini import STACKED

EPS1, EPS2, CLIP = 1e-30, 1e-16, 1.0


def factored_dims(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(row dim, column dim) of a parameter: its two largest unstacked dims, in order; None
    for a vector (one unstacked dim)."""
    inner = [i for i, a in enumerate(axes) if a not in STACKED]
    if len(inner) < 2:
        return None
    two = sorted(sorted(inner, key=lambda i: -shape[i])[:2])
    return two[0], two[1]


class CameState(NamedTuple):
    mu: optax.Params  # first moment of the clipped normalised update, the parameter's shape
    v_row: optax.Params  # factored: mean of g^2 over the column dim; vectors: v itself
    v_col: optax.Params  # factored: mean of g^2 over the row dim; vectors: None
    r_row: optax.Params  # the instability's factors (vectors: Nones)
    r_col: optax.Params


def _approx(row, col, dims):
    """Adafactor's rank-1 estimate's inverse root: rsqrt(row / mean(row)) * rsqrt(col)."""
    r, c = dims
    row, col = jnp.expand_dims(row, c), jnp.expand_dims(col, r)
    return jax.lax.rsqrt(row / jnp.mean(row, axis=r, keepdims=True)) * jax.lax.rsqrt(col)


def scale_by_came(
    axes, b1: float = 0.9, b2: float = 0.999, b3: float = 0.9999
) -> optax.GradientTransformation:
    """The CAME direction (before the learning rate). `axes`: the parameters' logical axes."""
    is_axes = lambda x: isinstance(x, tuple)  # noqa: E731

    def dims_tree(params):
        return jax.tree.map(lambda ax, p: factored_dims(ax, p.shape), axes, params, is_leaf=is_axes)

    def init_one(p, dims):
        z = lambda s: jnp.zeros(s, jnp.float32)  # noqa: E731
        if dims is None:
            return jnp.zeros_like(p), z(p.shape), None, None, None
        r, c = dims
        row, col = p.shape[:c] + p.shape[c + 1 :], p.shape[:r] + p.shape[r + 1 :]
        return jnp.zeros_like(p), z(row), z(col), z(row), z(col)

    def split(tdef, res, n):
        return [jax.tree.unflatten(tdef, [x[i] for x in tdef.flatten_up_to(res)]) for i in range(n)]

    def init(params):
        dims = dims_tree(params)
        res = jax.tree.map(init_one, params, dims, is_leaf=lambda x: x is None or is_axes(x))
        return CameState(*split(jax.tree.structure(params), res, 5))

    def one(g, m, vr, vc, rr, rc, dims):
        g = g.astype(jnp.float32)
        sq = jnp.square(g) + EPS1
        if dims is None:
            vr = b2 * vr + (1 - b2) * sq
            u = g * jax.lax.rsqrt(vr)
        else:
            r, c = dims
            vr = b2 * vr + (1 - b2) * jnp.mean(sq, axis=c)
            vc = b2 * vc + (1 - b2) * jnp.mean(sq, axis=r)
            u = g * _approx(vr, vc, dims)
        u = u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(jnp.square(u))) / CLIP)
        m = b1 * m + (1 - b1) * u
        if dims is None:
            return m, m, vr, vc, rr, rc
        inst = jnp.square(u - m) + EPS2
        rr = b3 * rr + (1 - b3) * jnp.mean(inst, axis=c)
        rc = b3 * rc + (1 - b3) * jnp.mean(inst, axis=r)
        return m * _approx(rr, rc, dims), m, vr, vc, rr, rc

    def update(updates, state, params=None):
        del params
        dims = dims_tree(updates)
        res = jax.tree.map(
            lambda g, d, *s: one(g, *s, d),
            updates,
            dims,
            *state,
            is_leaf=lambda x: x is None or is_axes(x),
        )
        out, *new = split(jax.tree.structure(updates), res, 6)
        return out, CameState(*new)

    return optax.GradientTransformation(init, update)
