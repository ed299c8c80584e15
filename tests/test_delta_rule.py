"""The gated delta rule's chunked and recurrent forms against a naive per-token reference
(float64 numpy, written from the paper's update S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} +
beta_t k_t v_t^T), values and gradients, and packed documents equal to documents run alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.model import delta_rule


def naive(q, k, v, g, beta, reset=None):
    """Per token and value head, in float64; the state is zeroed before a reset token."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, l, hk, kd = q.shape
    h, vd = v.shape[2], v.shape[3]
    out = np.zeros((b, l, h, vd))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((kd, vd))
            for t in range(l):
                if reset is not None and reset[bi, t]:
                    s = np.zeros((kd, vd))
                kt = k[bi, t, hi // (h // hk)]
                qt = q[bi, t, hi // (h // hk)]
                kt = kt / np.sqrt(kt @ kt + 1e-6)
                qt = qt / np.sqrt(qt @ qt + 1e-6) / np.sqrt(kd)
                a, bt = np.exp(g[bi, t, hi]), beta[bi, t, hi]
                s = a * (np.eye(kd) - bt * np.outer(kt, kt)) @ s + bt * np.outer(kt, v[bi, t, hi])
                out[bi, t, hi] = s.T @ qt
    return out


def inputs(seed, b=2, l=23, hk=2, h=4, kd=8, vd=6):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, l, hk, kd))
    k = jax.random.normal(ks[1], (b, l, hk, kd))
    v = jax.random.normal(ks[2], (b, l, h, vd))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, l, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, l, h)))
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [8, 64])
def test_forms_match_naive_reference(chunk):
    args = inputs(0)
    want = naive(*args)
    o_rec, s_rec = delta_rule.recurrent(*args)
    o_chk, s_chk = delta_rule.chunked(*args, chunk=chunk)
    np.testing.assert_allclose(o_rec, want, atol=1e-5)
    np.testing.assert_allclose(o_chk, want, atol=1e-5)
    np.testing.assert_allclose(s_chk, s_rec, atol=1e-5)


def test_state_carries_between_calls():
    """Running the second half from the first half's state equals running the whole."""
    q, k, v, g, beta = inputs(1, l=20)
    whole, s_whole = delta_rule.chunked(q, k, v, g, beta, chunk=8)
    cut = lambda x, a, b: x[:, a:b]  # noqa: E731
    first = [cut(x, 0, 13) for x in (q, k, v, g, beta)]
    second = [cut(x, 13, 20) for x in (q, k, v, g, beta)]
    o1, s1 = delta_rule.chunked(*first, chunk=8)
    o2, s2 = delta_rule.recurrent(*second, state_BxHxKxV=s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], axis=1), whole, atol=1e-5)
    np.testing.assert_allclose(s2, s_whole, atol=1e-5)


def test_gradients_match():
    args = inputs(2, l=19)
    weights = jax.random.normal(jax.random.key(9), (2, 19, 4, 6))

    def loss(fn, *a):
        return jnp.sum(fn(*a)[0] * weights)

    rec = jax.grad(lambda *a: loss(delta_rule.recurrent, *a), argnums=(0, 1, 2, 3, 4))(*args)
    chk = jax.grad(
        lambda *a: loss(lambda *x: delta_rule.chunked(*x, chunk=8), *a), argnums=(0, 1, 2, 3, 4)
    )(*args)
    for a, b in zip(rec, chk, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-4)


def test_packed_documents_equal_documents_alone():
    """Three documents in one row (boundaries inside and across chunks) equal each alone."""
    q, k, v, g, beta = inputs(3, b=1, l=30)
    bounds = [0, 11, 19, 30]
    reset = np.zeros((1, 30), bool)
    reset[0, bounds[1:-1]] = True
    want = naive(q, k, v, g, beta, reset)
    o_chk, _ = delta_rule.chunked(q, k, v, g, beta, reset_BxL=jnp.asarray(reset), chunk=8)
    o_rec, _ = delta_rule.recurrent(q, k, v, g, beta, reset_BxL=jnp.asarray(reset))
    np.testing.assert_allclose(o_chk, want, atol=1e-5)
    np.testing.assert_allclose(o_rec, want, atol=1e-5)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        alone, _ = delta_rule.chunked(*(x[:, a:b] for x in (q, k, v, g, beta)), chunk=8)
        np.testing.assert_allclose(o_chk[:, a:b], alone, atol=1e-5)


def test_conv_resets_and_carries_its_tail():
    x = jax.random.normal(jax.random.key(4), (1, 12, 5))
    w = jax.random.normal(jax.random.key(5), (4, 5))
    reset = jnp.zeros((1, 12), bool).at[0, 7].set(True)
    out, _ = delta_rule.causal_conv(x, w, reset)
    for a, b in ((0, 7), (7, 12)):
        alone, _ = delta_rule.causal_conv(x[:, a:b], w)
        np.testing.assert_allclose(out[:, a:b], alone, atol=1e-6)
    whole, _ = delta_rule.causal_conv(x, w)
    first, tail = delta_rule.causal_conv(x[:, :9], w)
    second, _ = delta_rule.causal_conv(x[:, 9:], w, tail_BxTxC=tail)
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), whole, atol=1e-6)


def test_unit_lower_inverse_and_its_gradient_equal_numpy():
    """The forward substitution that replaces a triangular solve: T^-1 against float64 numpy,
    and the gradient of a loss through it against autodiff of a general inverse of the same
    matrix (nothing on the unit diagonal or above it)."""
    a = jax.random.normal(jax.random.key(3), (2, 3, 9, 9)) * 0.5
    t = jnp.tril(a, -1) + jnp.eye(9)[None, None] + jnp.triu(a, 1)  # the upper part must be ignored
    inv = delta_rule.unit_lower_inverse(t)
    t64 = np.tril(np.asarray(t, np.float64), -1) + np.eye(9)
    ref = np.linalg.inv(t64)
    np.testing.assert_allclose(np.asarray(inv), ref, rtol=1e-5, atol=1e-5)
    w = jax.random.normal(jax.random.key(4), (2, 3, 9, 9))
    grad = jax.grad(lambda t: jnp.sum(jnp.sin(delta_rule.unit_lower_inverse(t)) * w))(t)
    general = lambda t: jnp.linalg.inv(jnp.tril(t, -1) + jnp.eye(9)[None, None])  # noqa: E731
    ref_grad = jax.grad(lambda t: jnp.sum(jnp.sin(general(t)) * w))(t)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-5)
    assert not np.asarray(grad)[..., np.triu_indices(9)[0], np.triu_indices(9)[1]].any()
