"""Bidirectional attention (`model.kind=encoder`) with padding through segment ids: what a token
sees, on the XLA path and the interpreted flash kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm.config import ConfigError
from jaxllm.model import build
from jaxllm.model.attention import dot_product_attention

SEGMENTS_BxL = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 2, 2, 0]], jnp.int32)


def _qkv(seed=0, b=2, l=8, h=4, g=2, k=16):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, l, h, k), jnp.float32)
    kv = [jax.random.normal(key, (b, l, g, k), jnp.float32) for key in keys[1:]]
    return q, *kv


def _reference(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, seg_BxL):
    """Plain softmax attention in numpy, every query over the keys of its own segment."""
    q, k, v, seg = (np.asarray(a, np.float64) for a in (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, seg_BxL))
    r = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
    s_BxHxLxS = np.einsum("blhk,bshk->bhls", q, k) * q.shape[-1] ** -0.5
    visible_Bx1xLxS = (seg[:, :, None] == seg[:, None, :])[:, None]
    s_BxHxLxS = np.where(visible_Bx1xLxS, s_BxHxLxS, -np.inf)
    p = np.exp(s_BxHxLxS - s_BxHxLxS.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhls,bshk->blhk", p, v)


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_non_causal_attention_sees_its_whole_segment_and_no_padding(impl):
    q, k, v = _qkv()
    got = dot_product_attention(q, k, v, q_segment_ids_BxL=SEGMENTS_BxL, causal=False, impl=impl)
    np.testing.assert_allclose(got, _reference(q, k, v, SEGMENTS_BxL), atol=2e-5)
    causal = dot_product_attention(q, k, v, q_segment_ids_BxL=SEGMENTS_BxL, impl=impl)
    assert not np.allclose(got[:, :5], causal[:, :5], atol=1e-3)  # the flag changes something


def _encoder(**overrides):
    return tiny_model(kind="encoder", **overrides)


def _input_grads(cfg, tokens_BxL, segments_BxL, position):
    """d(sum of logits at `position`) / d(input embeddings) per position: [B, L]."""
    model = build(cfg, seed=0)
    emb_BxLxD = model.embed(tokens_BxL)

    def out(e):
        logits = model(embeddings_BxLxD=e, segment_ids_BxL=segments_BxL).logits
        return logits[:, position].sum()

    return np.abs(np.asarray(jax.jit(jax.grad(out))(emb_BxLxD))).sum(-1)


# the kernel's non-causal path runs by default in the two tests around this one
@pytest.mark.parametrize("impl", ["xla", pytest.param("flash", marks=pytest.mark.slow)])
def test_encoder_token_sees_later_tokens_of_its_segment_only(impl):
    """Gradient test: position 1 depends on every real token of its segment (later ones
    included) and on no padding (a decoder's sees only positions 0 and 1: test_knobs)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 1, 64)
    grads = _input_grads(_encoder(attention_impl=impl, num_layers=1), tokens, SEGMENTS_BxL, 1)
    assert (grads[0, :6] > 0).all() and (grads[0, 6:] == 0).all()
    assert (grads[1, :3] > 0).all() and (grads[1, 3:] == 0).all()  # segment 1 only


def test_encoder_outputs_ignore_padding_tokens_and_flash_matches_xla():
    cfg = _encoder(num_layers=1)
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
    other = jnp.where(SEGMENTS_BxL == 0, 7, tokens)  # different tokens under the padding
    model = build(cfg, seed=0)
    a = model(tokens, segment_ids_BxL=SEGMENTS_BxL).logits
    b = model(other, segment_ids_BxL=SEGMENTS_BxL).logits
    real = np.asarray(SEGMENTS_BxL > 0)
    np.testing.assert_array_equal(np.asarray(a)[real], np.asarray(b)[real])
    flash = build(dataclasses.replace(cfg, attention_impl="flash"), seed=0)
    got = flash(tokens, segment_ids_BxL=SEGMENTS_BxL).logits
    np.testing.assert_allclose(got, a, atol=2e-5)


def test_kind_is_checked():
    assert tiny_model().causal and not _encoder().causal
    with pytest.raises(ConfigError, match="model.kind=encoder_decoder"):
        tiny_model(kind="encoder_decoder").validate()
