"""Position knobs: RoPE scaling (against transformers), the local RoPE base, ALiBi, and how each position kind uses positions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm.config import RopeConfig
from jaxllm.model import (
    alibi_slopes,
    apply_rope,
    build,
    dot_product_attention,
    rope_frequencies,
)
from jaxllm.model.attention import Attention


def _tokens(b, l, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, l), 0, 64)


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _set(model, pure):
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
    nnx.update(model, state)


# -- positions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope, hf",
    [
        ({}, None),
        ({"scaling": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
        (
            {"scaling": "llama3", "factor": 8.0, "original_max_len": 64},
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        (
            {"scaling": "yarn", "factor": 4.0, "original_max_len": 128},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        ),
    ],
    ids=["default", "linear", "llama3", "yarn"],
)
@pytest.mark.torch
def test_rope_frequencies_match_transformers(rope, hf):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = rope_frequencies(RopeConfig(theta=50000.0, **rope), 64, max_seq_len=512)
    hf_cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 50000.0, **(hf or {"rope_type": "default"})},
    )
    if hf is None:
        want = 1.0 / (50000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))
        want_scaling = 1.0
    else:
        want, want_scaling = ROPE_INIT_FUNCTIONS[hf["rope_type"]](hf_cfg, "cpu")
        want = want.numpy()
    np.testing.assert_allclose(inv_freq, want, rtol=1e-6)
    assert scaling == pytest.approx(want_scaling)
    if hf is not None:  # the scaling really changes something
        plain = rope_frequencies(RopeConfig(theta=50000.0), 64, max_seq_len=512)[0]
        assert not np.allclose(inv_freq, plain)


def test_ntk_scaling_raises_the_base():
    rope, k = RopeConfig(scaling="ntk", factor=4.0), 8
    plain = RopeConfig(theta=rope.theta * 4.0 ** (k / (k - 2)))
    want = rope_frequencies(plain, k)[0]
    np.testing.assert_allclose(rope_frequencies(rope, k)[0], want, rtol=1e-6)


def test_rope_local_theta_gives_windowed_layers_their_own_unscaled_base():
    """Gemma 3: a windowed layer rotates by base rope.local_theta without scaling, a global
    layer by rope.theta with it; picked by the scanned layer's traced flag, statically when
    every layer is windowed."""
    yarn = RopeConfig(theta=1e6, local_theta=100.0, scaling="yarn", factor=4.0, original_max_len=16)
    cfg = tiny_model(sliding_window=4, global_every=2, rope=yarn)
    attn = Attention(cfg, out_std=0.02, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 7, 4, 8))
    pos = jnp.broadcast_to(jnp.arange(7) * 3, (2, 7))
    local = 1.0 / 100.0 ** (np.arange(0, 8, 2, dtype=np.float32) / 8)
    global_freq, global_scaling = rope_frequencies(cfg.rope, cfg.rope_dim, cfg.max_seq_len)
    assert global_scaling != 1.0 and not np.allclose(local, global_freq)
    rope = jax.jit(lambda w: attn._rope(x, pos, w))
    np.testing.assert_allclose(rope(True), apply_rope(x, pos, local), atol=1e-6)
    np.testing.assert_allclose(
        rope(False), apply_rope(x, pos, global_freq, global_scaling), atol=1e-6
    )
    np.testing.assert_allclose(attn._rope(x, pos), apply_rope(x, pos, local), atol=1e-6)
    # a whole model: all windowed with the knob == the plain model with that base
    tokens = _tokens(1, 10)
    linear = RopeConfig(theta=1e6, local_theta=100.0, scaling="linear", factor=4.0)
    all_local = build(tiny_model(sliding_window=4, rope=linear), seed=0)
    plain = build(tiny_model(sliding_window=4, rope=RopeConfig(theta=100.0)), seed=0)
    np.testing.assert_allclose(all_local(tokens).logits, plain(tokens).logits, atol=1e-5)
    local = RopeConfig(local_theta=100.0)
    knob = build(tiny_model(sliding_window=4, global_every=2, rope=local), seed=0)
    no_knob = build(tiny_model(sliding_window=4, global_every=2), seed=0)
    assert not np.allclose(knob(tokens).logits, no_knob(tokens).logits, atol=1e-4)


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    # 6 heads: the 4 slopes of n=4, then every other slope of n=8
    np.testing.assert_allclose(alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


def test_alibi_attention_adds_the_distance_penalty():
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.normal(size=s), jnp.float32)
        for s in [(1, 6, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8)]
    )
    slopes = alibi_slopes(4)
    got = dot_product_attention(q, k, v, alibi_slopes_H=jnp.asarray(slopes))
    kk, vv = np.repeat(np.asarray(k), 2, axis=2), np.repeat(np.asarray(v), 2, axis=2)
    s = np.einsum("blhk,bshk->bhls", np.asarray(q), kk) / math.sqrt(8)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    s = s - slopes[None, :, None, None] * (i - j)
    s = np.where(j <= i, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("bhls,bshk->blhk", p, vv), atol=1e-5)


def test_each_position_kind_uses_positions_its_own_way():
    tokens = _tokens(1, 10)
    pos = jnp.arange(10)[None]
    out = {}
    for kind in ("rope", "alibi", "learned", "none"):
        model = build(tiny_model(position=kind, init_std=0.3), seed=0)
        a = model(tokens, positions_BxL=pos).logits
        b = model(
            tokens, positions_BxL=2 * pos
        ).logits  # stretched: RoPE is relative, so not a shift
        moved = not np.allclose(a, b, atol=1e-4)
        assert moved == (kind in ("rope", "learned")), kind
        out[kind] = a
    assert not np.allclose(out["alibi"], out["none"], atol=1e-4)
    learned = _pure(build(tiny_model(position="learned")))
    assert learned["pos_embed"].shape == (64, 32)
    assert "pos_embed" not in _pure(build(tiny_model()))


# -- MLP, norms -------------------------------------------------------------------------------
