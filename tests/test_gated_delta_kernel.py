"""The Pallas kernel of the chunked gated delta rule's inter-chunk recurrence, interpreted on
CPU: equal to its reference, and the chunked form run through it equal to the `lax.scan` form
(packed documents included), values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxllm.kernels.gated_delta import chunk_scan, chunk_scan_reference

from jaxllm.model import delta_rule


def test_kernel_equals_its_reference():
    b, h, n, c, k, v = 2, 3, 4, 16, 16, 16
    ks = jax.random.split(jax.random.key(0), 7)
    args = (
        jax.random.normal(ks[0], (b, h, n, c, v)),
        0.1 * jax.random.normal(ks[1], (b, h, n, c, k)),
        0.1 * jax.random.normal(ks[2], (b, h, n, c, c)),
        0.1 * jax.random.normal(ks[3], (b, h, n, c, k)),
        0.1 * jax.random.normal(ks[4], (b, h, n, c, k)),
        jax.nn.sigmoid(jax.random.normal(ks[5], (b, h, n, k))),
        jax.random.normal(ks[6], (b, h, k, v)),
    )
    o, s = chunk_scan(*args, True)
    o_ref, s_ref = chunk_scan_reference(*args)
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5)


def test_chunked_form_through_the_kernel_equals_the_scan():
    ks = jax.random.split(jax.random.key(1), 5)
    b, l, g, h, kd, vd = 2, 37, 1, 2, 16, 16
    q = jax.random.normal(ks[0], (b, l, g, kd))
    k = jax.random.normal(ks[1], (b, l, g, kd))
    v = jax.random.normal(ks[2], (b, l, h, vd))
    g_ = -jax.nn.softplus(jax.random.normal(ks[3], (b, l, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, l, h)))
    reset = jnp.zeros((b, l), bool).at[0, 20].set(True).at[1, 9].set(True)
    weights = jax.random.normal(jax.random.key(2), (b, l, h, vd))

    def loss(kernel, *a):
        o, s = delta_rule.chunked(*a, reset_BxL=reset, chunk=16, kernel=kernel, interpret=True)
        return jnp.sum(o * weights) + jnp.sum(s), (o, s)

    args = (q, k, v, g_, beta)
    grad = jax.grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True)
    (g_kernel, (o_kernel, s_kernel)), (g_scan, (o_scan, s_scan)) = (
        grad(True, *args),
        grad(False, *args),
    )
    np.testing.assert_allclose(o_kernel, o_scan, atol=1e-5)
    np.testing.assert_allclose(s_kernel, s_scan, atol=1e-5)
    for a, b_ in zip(g_kernel, g_scan, strict=True):
        np.testing.assert_allclose(a, b_, atol=1e-4)
