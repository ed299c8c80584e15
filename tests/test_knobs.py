"""Architecture knobs of `ModelConfig`: each one changes the computation the way its paper / the
reference implementation says (positions, RoPE scaling, activations, norms and their placement,
QK-norm, biases, soft caps, sliding windows, embedding scale, dropout) and is validated."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import config, optim
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.metrics import param_counts
from jaxllm.model import (
    MLP,
    LayerNorm,
    RMSNorm,
    build,
)
from jaxllm.objectives import next_token
from jaxllm.train.step import objective_value


def _tokens(b, l, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, l), 0, 64)


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _logits(model, tokens):
    """The model's logits, compiled (eager NNX calls dispatch op by op)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s: nnx.merge(graphdef, s)(tokens).logits)(state)


def _set(model, pure):
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
    nnx.update(model, state)


# -- positions --------------------------------------------------------------------------------


@pytest.mark.parametrize("act", ["swiglu", "geglu", "gelu", "relu", "relu2"])
def test_mlp_activations(act):
    mlp = MLP(32, 64, act, gelu_approximate=False, bias=True, out_std=0.1, rngs=nnx.Rngs(0))
    p = _pure(mlp)
    assert ("gate_proj" in p) == (act in ("swiglu", "geglu"))
    rng = np.random.default_rng(1)
    p = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), p)
    _set(mlp, p)
    x = rng.normal(size=(2, 3, 32)).astype(np.float32)
    up = x @ p["up_proj"] + p["up_bias"]
    erf = np.vectorize(math.erf)
    f = {
        "swiglu": lambda g: g / (1 + np.exp(-g)),
        "geglu": lambda g: 0.5 * g * (1 + erf(g / math.sqrt(2))),
        "gelu": lambda u: 0.5 * u * (1 + erf(u / math.sqrt(2))),
        "relu": lambda u: np.maximum(u, 0),
        "relu2": lambda u: np.maximum(u, 0) ** 2,
    }[act]
    h = f(x @ p["gate_proj"] + p["gate_bias"]) * up if "gate_proj" in p else f(up)
    np.testing.assert_allclose(
        mlp(jnp.asarray(x)), h @ p["down_proj"] + p["down_bias"], rtol=2e-4, atol=2e-4
    )


def test_layernorm_and_norm_offset():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 16)).astype(np.float32) * 3 + 1
    ln = LayerNorm(16, eps=1e-5, dtype=jnp.float32, param_dtype=jnp.float32)
    scale, bias = rng.normal(size=16).astype(np.float32), rng.normal(size=16).astype(np.float32)
    _set(ln, {"scale": scale, "bias": bias})
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln(jnp.asarray(x)), want * scale + bias, atol=1e-5)
    # Gemma stores scale - 1: a fresh offset-1 norm (stored 0) is the identity-scale norm
    plain = RMSNorm(16, eps=1e-6, dtype=jnp.float32, param_dtype=jnp.float32)
    gemma = RMSNorm(16, eps=1e-6, dtype=jnp.float32, param_dtype=jnp.float32, offset=1.0)
    assert not np.asarray(gemma.scale[...]).any()
    np.testing.assert_allclose(gemma(jnp.asarray(x)), plain(jnp.asarray(x)), atol=1e-6)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich"])
def test_norm_placement(placement):
    cfg = tiny_model(norm_placement=placement, num_layers=1, init_std=0.3)
    model = build(cfg, seed=0)
    p = _pure(model)
    assert ("final_norm" in p) == (placement != "post")
    assert ("post_attn_norm" in p["layers"]) == (placement == "sandwich")
    rng = np.random.default_rng(0)
    layer = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(nnx.state(model.layers, nnx.Param)))
    for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        if name in layer:  # distinct scales, so a swapped norm would show
            layer[name]["scale"] = jnp.asarray(rng.uniform(0.5, 1.5, 32), jnp.float32)
    _set(model.layers, jax.tree.map(lambda a: a[None], layer))

    def one_block(x):
        from jaxllm.model.transformer import Block

        b = Block(cfg, rngs=nnx.Rngs(0))
        _set(b, layer)
        pos, seg = jnp.arange(8)[None], jnp.ones((1, 8), jnp.int32)
        attn = lambda h: b.attn(h, pos, seg).out  # noqa: E731
        if placement == "pre":
            x = x + attn(b.attn_norm(x))
            return x + b.mlp(b.mlp_norm(x))
        if placement == "post":
            x = b.attn_norm(x + attn(x))
            return b.mlp_norm(x + b.mlp(x))
        x = x + b.post_attn_norm(attn(b.attn_norm(x)))
        return x + b.post_mlp_norm(b.mlp(b.mlp_norm(x)))

    x = model.embed(_tokens(1, 8))
    h = one_block(x)
    if placement != "post":
        h = model.final_norm(h)
    np.testing.assert_allclose(model(embeddings_BxLxD=x).logits, h @ p["lm_head"], atol=1e-4)


def test_qk_norm_makes_attention_invariant_to_query_and_key_scale():
    model = build(tiny_model(qk_norm=True, init_std=0.3), seed=0)
    p = _pure(model)
    assert p["layers"]["attn"]["q_norm"]["scale"].shape == (2, 8)
    tokens = _tokens(2, 8)
    ref = _logits(model, tokens)
    for name in ("q_proj", "k_proj"):
        p["layers"]["attn"][name] = p["layers"]["attn"][name] * 7.0
    _set(model, p)
    np.testing.assert_allclose(_logits(model, tokens), ref, atol=2e-4)
    plain = build(tiny_model(init_std=0.3), seed=0)
    q = _pure(plain)
    q["layers"]["attn"]["q_proj"] = q["layers"]["attn"]["q_proj"] * 7.0
    before = _logits(plain, tokens)
    _set(plain, q)
    assert not np.allclose(_logits(plain, tokens), before, atol=1e-3)


@pytest.mark.parametrize(
    "flags, names",
    [
        ({"qkv_bias": True}, {"q_bias", "k_bias", "v_bias"}),
        ({"o_bias": True}, {"o_bias"}),
        ({"mlp_bias": True}, {"gate_bias", "up_bias", "down_bias"}),
    ],
)
def test_biases_are_parameters_that_act_and_take_no_weight_decay(flags, names):
    model = build(tiny_model(**flags), seed=0)
    p = _pure(model)
    got = {k for k in {**p["layers"]["attn"], **p["layers"]["mlp"]} if k.endswith("_bias")}
    assert got == names
    mask = optim.decay_mask(p)
    for group in ("attn", "mlp"):
        for k, v in mask["layers"][group].items():
            assert v == (not k.endswith("_bias")), k
    tokens = _tokens(1, 6)
    before = model(tokens).logits
    for group in ("attn", "mlp"):
        for k in p["layers"][group]:
            if k.endswith("_bias"):
                p["layers"][group][k] = p["layers"][group][k] + 0.5
    _set(model, p)
    assert not np.allclose(model(tokens).logits, before, atol=1e-4)


# -- caps, windows, embeddings, dropout -------------------------------------------------------


def test_final_soft_cap_bounds_logits():
    capped = build(tiny_model(init_std=2.0, final_soft_cap=3.0), seed=0)
    raw = build(tiny_model(init_std=2.0), seed=0)
    tokens = _tokens(1, 8)
    a, b = np.asarray(capped(tokens).logits), np.asarray(raw(tokens).logits)
    assert np.abs(b).max() > 3.0 and np.abs(a).max() <= 3.0
    np.testing.assert_allclose(a, 3.0 * np.tanh(b / 3.0), atol=1e-4)


def test_sliding_window_limits_the_receptive_field():
    """One windowed layer: logits at t depend on inputs t - w + 1 .. t only; with a global
    layer after it (global_every=2) they depend on the whole prefix."""
    t, w = 11, 4
    for layers, every, first_seen in ((1, 0, t - w + 1), (2, 2, 0)):
        model = build(
            tiny_model(num_layers=layers, sliding_window=w, global_every=every, init_std=0.3),
            seed=1,
        )
        emb = model.embed(_tokens(1, 14)).astype(jnp.float32)
        g = jax.jit(jax.grad(lambda e: model(embeddings_BxLxD=e).logits[0, t].sum()))(emb)
        seen = np.abs(np.asarray(g[0])).sum(-1) > 0
        assert seen[first_seen : t + 1].all() and not seen[t + 1 :].any()
        assert not seen[:first_seen].any()
    assert tiny_model(num_layers=6, sliding_window=8, global_every=3).layer_windows() == (
        8,
        8,
        0,
        8,
        8,
        0,
    )


# ~35 s; soft cap and windows in the flash kernel: tests/test_flash_attention.py
@pytest.mark.slow
def test_gemma_style_model_flash_matches_xla():
    """Soft cap + alternating window through the Pallas kernel (interpreted, lax.cond picks the
    windowed or the global kernel per scanned layer): logits and gradients match XLA."""
    knobs = dict(
        sliding_window=5,
        global_every=2,
        attn_soft_cap=2.0,
        init_std=0.3,
        norm_placement="sandwich",
        mlp_activation="geglu",
    )
    tokens = _tokens(2, 16)

    def run(impl):
        model = build(tiny_model(attention_impl=impl, **knobs), seed=3)
        graphdef, params = nnx.split(model, nnx.Param)
        f = lambda p: nnx.merge(graphdef, p)(tokens).logits.std()  # noqa: E731
        return model(tokens).logits, jax.grad(f)(params)

    (a, ga), (b, gb) = run("xla"), run("flash")
    np.testing.assert_allclose(a, b, atol=2e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(x, y, atol=2e-5)


def test_scale_embeddings_multiplies_by_sqrt_d():
    scaled = build(tiny_model(scale_embeddings=True), seed=0)
    plain = build(tiny_model(), seed=0)
    e = plain.embed(_tokens(1, 6))
    np.testing.assert_allclose(
        scaled(embeddings_BxLxD=e).logits,
        plain(embeddings_BxLxD=e * math.sqrt(32)).logits,
        atol=1e-5,
    )


def test_dropout_only_with_a_key():
    """Dropout acts only when the train step passes an rng (different rngs, different masks);
    without one the model is the dropout-free model."""
    cfg = tiny_model(dropout=0.3)
    graphdef, params = nnx.split(build(cfg, seed=0), nnx.Param)
    off_def, off_params = nnx.split(build(dataclasses.replace(cfg, dropout=0.0), seed=0), nnx.Param)
    tokens = _tokens(2, 9)
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": jnp.broadcast_to(jnp.arange(8), (2, 8)),
        "segment_ids": jnp.ones((2, 8), jnp.int32),
        "loss_mask": jnp.ones((2, 8)),
    }

    objective = next_token()

    def loss(params, graphdef, rng=None):
        value = jax.jit(
            lambda p, r: objective_value(p, batch, r, graphdef=graphdef, objective=objective)[0]
        )
        return float(value(params, rng))

    base = loss(off_params, off_def)
    assert loss(params, graphdef) == pytest.approx(base, rel=1e-6)
    a, b = loss(params, graphdef, jax.random.key(0)), loss(params, graphdef, jax.random.key(1))
    assert len({base, a, b}) == 3
    assert loss(params, graphdef, jax.random.key(0)) == a


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.rope.factor=2.0"], "model.rope.factor"),
        (
            ["model.position=alibi", "model.rope.scaling=linear", "model.rope.factor=2.0"],
            "model.rope.",
        ),
        (["model.global_every=2"], "model.global_every"),
        (["model.sliding_window=0"], "model.sliding_window"),
        (["model.rope.local_theta=10000.0"], "model.rope.local_theta"),
        (["model.sliding_window=8", "model.rope.local_theta=0.0"], "model.rope.local_theta"),
        (["model.dropout=1.0"], "model.dropout"),
        (["model.position=alibi", "model.attention_impl=flash"], "model.position=alibi"),
        (["model.attn_soft_cap=-1.0"], "model.attn_soft_cap"),
        (["model.sliding_window=64", "mesh.sequence_attention=ring"], "ring"),
        (["model.mlp_activation=swish"], "model.mlp_activation"),
    ],
)
def test_invalid_knob_combinations(overrides, key):
    with pytest.raises(ConfigError) as e:
        config.load(None, overrides)
    assert key in str(e.value)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {
            "mlp_activation": "gelu",
            "norm": "layernorm",
            "position": "learned",
            "qkv_bias": True,
            "o_bias": True,
            "mlp_bias": True,
            "tie_embeddings": True,
        },
        {"norm_placement": "sandwich", "qk_norm": True, "head_dim": 16},
        {"norm_placement": "post", "mlp_activation": "relu2", "norm": "layernorm"},
        {  # gpt-oss: sinks, attention biases, a router bias and expert biases
            "attention_sinks": True,
            "qkv_bias": True,
            "o_bias": True,
            "moe": MoEConfig(
                num_experts=4, experts_per_token=2, router_logit_bias=True, expert_bias=True
            ),
        },
    ],
)
def test_param_count_matches_the_model(knobs):
    cfg = tiny_model(**knobs)
    abstract = nnx.state(nnx.eval_shape(lambda: build(cfg)), nnx.Param)
    assert param_counts(cfg)["total"] == sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
