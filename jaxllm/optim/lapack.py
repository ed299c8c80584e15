"""Matrix decompositions in an optimizer step, one at a time.

On CPU, jaxlib runs a batched `eigh` / `svd` as a LAPACK call that splits its batch over
XLA's intra-op thread pool and blocks until the parts finish. Two such calls at once can each
hold a pool thread while waiting for parts queued behind the other: with two cores the step
never finishes. `one_at_a_time` (or `after`, in a loop that makes the calls itself) makes each
call's input depend on the previous call's output (a data dependence, `x + 0 * y`, which XLA
keeps: it does not fold float multiplication by 0), so the calls of a refresh run in sequence
and at most one pool thread ever waits."""

from __future__ import annotations

import jax.numpy as jnp


def after(x, y):
    """x, computed only once y is: x + 0 * (an element of y, non-finite values read as 0)."""
    if y is None:
        return x
    v = jnp.ravel(y)[0].astype(jnp.float32)
    return x + (jnp.where(jnp.isfinite(v), v, 0.0) * 0.0).astype(x.dtype)


def one_at_a_time(fn, xs: list) -> list:
    """`[fn(x) for x in xs]`, each call after the previous one has finished."""
    out, last = [], None
    for x in xs:
        last = fn(after(x, last))
        out.append(last)
    return out
