"""`flash_attention_with_lse` (the logsumexp, its value and its gradient) and
`flash_attention_backward` (the backward from statistics of a longer attention, as ring attention
uses it), in interpret mode on CPU against the pure-JAX reference and the definition.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs as _inputs
from attention_inputs import packed_ids as _packed_ids
from jaxllm.kernels import (
    MASK_VALUE,
    BlockSizes,
    flash_attention_backward,
    flash_attention_reference_with_lse,
    flash_attention_with_lse,
)
from test_flash_attention import TOL


def _direct_lse(q, k, mask_BxLxS, soft_cap=None):
    """log sum_j exp(s_ij) over visible keys, straight from the definition (empty rows: -inf)."""
    b, l, h, d = q.shape
    g = k.shape[2]
    k_rep = jnp.repeat(k.astype(jnp.float32), h // g, axis=2)
    s = jnp.einsum("blhk,bshk->bhls", q.astype(jnp.float32), k_rep) * d**-0.5
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return jax.nn.logsumexp(jnp.where(mask_BxLxS[:, None], s, -jnp.inf), axis=-1)


# id -> (L, S, H, G, kwargs); segment ids are a (q_ids, kv_ids) pair in every case.
LSE_CASES = {
    "causal_gqa2_odd": (40, 40, 4, 2, dict(causal=True)),
    "softcap_window_mqa": (32, 32, 4, 1, dict(causal=True, sliding_window=9, soft_cap=2.0)),
    "cross_empty_rows": (24, 40, 4, 2, dict()),  # q segment 9 has no key
}


def _lse_case(name, dtype):
    """q, k, v and the keyword arguments (masks, segment id pair) of one LSE_CASES entry."""
    l, s, h, g, kw = LSE_CASES[name]
    q, k, v, _ = _inputs(2, l, s, h, g, 32, dtype)
    q_ids = _packed_ids(2, l, [11, 30])
    if name == "cross_empty_rows":
        q_ids = q_ids.at[:, 18:].set(9)
    return q, k, v, dict(kw, segment_ids=(q_ids, _packed_ids(2, s, [11, 30])))


def _mask_from_definition(l, s, kw):
    q_ids, kv_ids = kw["segment_ids"]
    mask = q_ids[:, :, None] == kv_ids[:, None, :]
    qi, ki = np.arange(l)[:, None], np.arange(s)[None, :]
    if kw.get("causal"):
        mask &= jnp.asarray(ki <= qi)[None]
    if kw.get("sliding_window") is not None:
        mask &= jnp.asarray(qi - kw["sliding_window"] < ki)[None]
    return mask


@pytest.mark.parametrize(
    "name, dtype",
    [pytest.param(name, jnp.float32, id=f"float32-{name}") for name in LSE_CASES]
    + [pytest.param("softcap_window_mqa", jnp.bfloat16, id="bfloat16-softcap_window_mqa")],
)
def test_with_lse_values_and_gradients_through_lse(name, dtype):
    """loss = sum(out * w1) + sum(lse * w2): the kernel's gradients, which reach the backward as
    delta - dlse, equal jax.grad of the jnp reference; lse equals its definition."""
    q, k, v, kw = _lse_case(name, dtype)
    b, l, h, _ = q.shape
    s = k.shape[1]
    w1 = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)
    w2 = jax.random.normal(jax.random.key(8), (b, h, l), jnp.float32)

    def loss_and_grads(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v, **kw)
            return jnp.sum(out.astype(jnp.float32) * w1) + jnp.sum(lse * w2), (out, lse)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    kern = functools.partial(
        flash_attention_with_lse, interpret=True, block_sizes=BlockSizes(16, 16)
    )
    (_, (out, lse)), grads = loss_and_grads(kern)
    (_, (out_ref, lse_ref)), grads_ref = loss_and_grads(flash_attention_reference_with_lse)
    assert lse.dtype == jnp.float32 and lse.shape == (b, h, l)
    tol = TOL[dtype]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=tol["out"], rtol=tol["out"])
    np.testing.assert_allclose(f32(lse), f32(lse_ref), atol=tol["out"], rtol=tol["out"])
    for name_, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert got.dtype == dtype and np.all(np.isfinite(f32(got))), name_
        np.testing.assert_allclose(
            f32(got), f32(want), atol=tol["grad"], rtol=tol["grad"], err_msg=name_
        )

    direct = np.asarray(_direct_lse(q, k, _mask_from_definition(l, s, kw), kw.get("soft_cap")))
    visible = np.isfinite(direct)
    np.testing.assert_allclose(f32(lse)[visible], direct[visible], atol=tol["out"], rtol=1e-5)
    # Empty rows: the finite MASK_VALUE (merges with weight 0), zero output and zero dq.
    assert (name == "cross_empty_rows") == bool(np.any(~visible))
    np.testing.assert_array_equal(f32(lse)[~visible], np.float32(MASK_VALUE))
    empty_BxL = ~visible.any(axis=1)
    assert np.all(f32(out)[empty_BxL] == 0) and np.all(f32(grads[0])[empty_BxL] == 0)


def test_xla_backend_returns_the_reference_out_and_lse():
    q, k, v, kw = _lse_case("causal_gqa2_odd", jnp.float32)
    out, lse = flash_attention_with_lse(q, k, v, backend="xla", **kw)
    out_k, lse_k = jax.jit(functools.partial(flash_attention_with_lse, interpret=True, **kw))(
        q, k, v
    )
    out_ref, lse_ref = flash_attention_reference_with_lse(q, k, v, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_ref))
    np.testing.assert_allclose(np.asarray(out_k), np.asarray(out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse_k), np.asarray(lse), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "xla"])
def test_backward_of_key_blocks_with_global_statistics_sums_to_full_gradient(backend):
    """Keys in two blocks (as ring attention sees them): `flash_attention_backward` on each block
    with the (out, lse) of the whole attention gives dq summing, and dk/dv concatenating, to the
    gradients of the whole attention."""
    l, s, cut = 24, 48, 28  # the cut is not a multiple of the block size: padded tails
    q, k, v, do = _inputs(2, l, s, 4, 2, 32, jnp.float32, seed=3)
    q_ids = _packed_ids(2, l, [10]).at[:, 20:].set(9)  # segment 9: rows with no key at all
    kv_ids = _packed_ids(2, s, [20])
    kw = dict(
        soft_cap=3.0, interpret=backend != "xla", backend=backend, block_sizes=BlockSizes(16, 16)
    )

    @jax.jit
    def blockwise_and_full(q, k, v, do):
        full = functools.partial(
            flash_attention_reference_with_lse, soft_cap=3.0, segment_ids=(q_ids, kv_ids)
        )
        (out, lse), vjp = jax.vjp(full, q, k, v)
        grads = [
            flash_attention_backward(
                q, k[:, blk], v[:, blk], out, lse, do, segment_ids=(q_ids, kv_ids[:, blk]), **kw
            )
            for blk in (slice(0, cut), slice(cut, s))
        ]
        dq = grads[0][0] + grads[1][0]
        dk, dv = (jnp.concatenate([grads[0][i], grads[1][i]], axis=1) for i in (1, 2))
        return (dq, dk, dv), vjp((do, jnp.zeros_like(lse)))

    got, want = blockwise_and_full(q, k, v, do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=name)
    assert np.all(np.asarray(got[0])[:, 20:] == 0)
