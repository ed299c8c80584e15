"""Model behaviour: causality, packing isolation, GQA grouping, remat/scan equivalence, dtypes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import sharding
from jaxllm.model import build, logical_axes


def _tokens(b, l, vocab=64, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, l), 0, vocab)


def test_causality_by_gradient(tiny_cfg):
    model = build(tiny_cfg, seed=1)
    emb = model.embed(_tokens(1, 12)).astype(jnp.float32)
    t = 5

    def out_at_t(e):
        return model(embeddings_BxLxD=e).logits[0, t].sum()

    g = jax.grad(out_at_t)(emb)
    per_position = jnp.abs(g[0]).sum(-1)
    assert np.all(per_position[t + 1 :] == 0), "logits at t depend on inputs after t"
    assert np.all(per_position[: t + 1] > 0), "logits at t ignore some inputs at or before t"


def test_packed_documents_do_not_see_each_other():
    model = build(tiny_model(init_std=0.5), seed=2)  # large init: attention far from uniform
    a, b = _tokens(1, 10, seed=3), _tokens(1, 14, seed=4)
    packed = jnp.concatenate([a, b], axis=1)
    segments = jnp.array([[1] * 10 + [2] * 14])
    positions = jnp.array([list(range(10)) + list(range(14))])
    logits = model(packed, positions_BxL=positions, segment_ids_BxL=segments).logits
    np.testing.assert_allclose(logits[:, :10], model(a).logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[:, 10:], model(b).logits, atol=1e-5, rtol=1e-5)
    # the given positions are the ones RoPE uses (a uniform shift would not show it: RoPE is
    # relative, so stretch them instead)
    stretched = model(packed, positions_BxL=2 * positions, segment_ids_BxL=segments).logits
    assert not np.allclose(stretched[:, 10:], model(b).logits, atol=1e-3)


def test_jit_matches_eager(tiny_cfg):
    model = build(tiny_cfg, seed=5)
    graphdef, state = nnx.split(model)
    tokens = _tokens(2, 16)
    eager = model(tokens).logits
    jitted = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, tokens)
    np.testing.assert_allclose(eager, jitted, atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = tiny_model(num_heads=4, num_kv_heads=2)
    mha_cfg = tiny_model(num_heads=4, num_kv_heads=4)
    gqa = build(gqa_cfg, seed=6)
    _, params = nnx.split(gqa, nnx.Param)
    pure = nnx.to_pure_dict(params)
    for name in ("k_proj", "v_proj"):  # [N, D, G, K] -> [N, D, H, K], each kv head serving 2
        pure["layers"]["attn"][name] = jnp.repeat(pure["layers"]["attn"][name], 2, axis=2)
    mha_def = nnx.graphdef(nnx.eval_shape(lambda: build(mha_cfg)))
    mha = nnx.merge(mha_def, pure)
    tokens = _tokens(2, 16)
    np.testing.assert_allclose(gqa(tokens).logits, mha(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_mqa_and_mha_run(kv_heads):
    model = build(tiny_model(num_kv_heads=kv_heads))
    logits = model(_tokens(2, 8)).logits
    assert logits.shape == (2, 8, 64) and np.isfinite(logits).all()


def _grads(cfg, tokens):
    model = build(cfg, seed=7)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        return nnx.merge(graphdef, p)(tokens).logits.astype(jnp.float32).std()

    return jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize(
    "change",
    [
        {"remat": "full"},
        {"remat": "dots"},
        {"remat": "dots_attention"},
        {"remat": "dots_attention", "attention_impl": "flash"},
        {"remat": "dots_with_no_batch_dims"},
        {"scan_unroll": 2},
    ],
)
def test_remat_and_unroll_do_not_change_gradients(change):
    base = tiny_model(num_layers=3, scan_unroll=1)
    tokens = _tokens(2, 16)
    ref = _grads(base, tokens)
    other = _grads(dataclasses.replace(base, **change), tokens)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(other)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_dtype_policy_bf16_compute_f32_params_and_logits():
    model = build(tiny_model(dtype="bfloat16", param_dtype="float32"))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)
    logits = model(_tokens(1, 8)).logits
    assert logits.dtype == jnp.float32
    # the blocks really compute in bf16: their outputs differ from the f32 model's
    f32 = build(tiny_model(dtype="float32"))
    assert not np.array_equal(logits, f32(_tokens(1, 8)).logits)
    np.testing.assert_allclose(logits, f32(_tokens(1, 8)).logits, atol=0.05)


def test_every_parameter_has_logical_axes_with_a_rule(tiny_cfg):
    state = nnx.state(build(tiny_cfg), nnx.Param)
    axes = logical_axes(state)
    shapes = nnx.to_pure_dict(state)
    pairs = zip(
        jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(shapes)
    )
    for ax, value in pairs:
        assert len(ax) == value.ndim
        assert all(a in sharding.RULES for a in ax)
    assert axes["layers"]["attn"]["q_proj"] == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["mlp"]["down_proj"] == ("layers", "mlp", "embed")


def test_tied_embeddings_have_no_lm_head():
    model = build(tiny_model(tie_embeddings=True))
    assert "lm_head" not in nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert model(_tokens(1, 4)).logits.shape == (1, 4, 64)
