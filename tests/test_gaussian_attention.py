"""Gaussian-kernel attention (`model.attention_kernel=gaussian`): a hand-computed example, the
kernel against its definition with masks, causality by gradient, packed documents alone, GQA
against repeated-kv MHA, cached generation against full forward passes, a learned sigma that
trains, and the refusals."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import config
from jaxllm.config import GenerateConfig
from jaxllm.infer import generate, greedy_continue
from jaxllm.model import build
from jaxllm.model.gaussian import gaussian_attention

GAUSSIAN = dict(attention_kernel="gaussian", gaussian_sigma=0.8)


def _tokens(b, l, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, l), 0, 64)


def test_hand_computed_example():
    """K = 4 (sqrt 2), sigma 1: keys 0 and 2 e0, the second query 2 e0. Its squared distances
    are 4 and 0, logits -4 / (2 * 2) = -1 and 0, weights 1 / (1 + e) and e / (1 + e); the first
    query sees only key 0. (The dot product would give logits 0 and 4 / 2 = 2 instead.)"""
    e0 = np.eye(4, dtype=np.float32)[0]
    q = jnp.asarray(np.stack([0 * e0, 2 * e0]))[None, :, None]
    k = jnp.asarray(np.stack([0 * e0, 2 * e0]))[None, :, None]
    v = jnp.asarray(np.eye(4, dtype=np.float32)[:2])[None, :, None]
    out = gaussian_attention(q, k, v, jnp.ones(1))[0, :, 0]
    e = math.e
    np.testing.assert_allclose(out[0], [1, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(out[1], [1 / (1 + e), e / (1 + e), 0, 0], atol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
def test_kernel_equals_its_definition_with_gqa_and_packing(window):
    """-||q - k||^2 / (2 sigma_h^2 sqrt(K)) per head, computed directly, under the causal,
    segment and window masks; every kv head serves two query heads (GQA), each head with its
    own sigma."""
    b, l, h, g, kd = 2, 9, 4, 2, 8
    q, k, v = (
        jax.random.normal(jax.random.key(i), (b, l, n, kd)) * 1.5
        for i, n in ((0, h), (1, g), (2, g))
    )
    sigma = jnp.array([0.5, 1.0, 1.5, 2.0])
    seg = jnp.array([[1] * 5 + [2] * 4, [1] * 9])
    got = gaussian_attention(q, k, v, sigma, q_segment_ids_BxL=seg, sliding_window=window)
    k_rep, v_rep = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    dist = jnp.sum((q[:, :, None] - k_rep[:, None]) ** 2, -1)  # [B, L, S, H]
    logits = -dist / (2 * sigma[None, None, None] ** 2 * math.sqrt(kd))
    i, j = np.arange(l)[:, None], np.arange(l)[None, :]
    visible = (j <= i)[None] & (seg[:, :, None] == seg[:, None, :])
    if window:
        visible = visible & (i - j < window)[None]
    logits = jnp.where(visible[..., None], logits, -jnp.inf)
    want = jnp.einsum("blsh,bshv->blhv", jax.nn.softmax(logits, axis=2), v_rep)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    mha = gaussian_attention(q, k_rep, v_rep, sigma, q_segment_ids_BxL=seg, sliding_window=window)
    np.testing.assert_allclose(got, mha, atol=1e-6, rtol=1e-6)


def test_causality_by_gradient():
    model = build(tiny_model(**GAUSSIAN), seed=1)
    emb = model.embed(_tokens(1, 12)).astype(jnp.float32)
    t = 5
    g = jax.grad(lambda e: model(embeddings_BxLxD=e).logits[0, t].sum())(emb)
    per_position = jnp.abs(g[0]).sum(-1)
    assert np.all(per_position[t + 1 :] == 0), "logits at t depend on inputs after t"
    assert np.all(per_position[: t + 1] > 0), "logits at t ignore some inputs at or before t"


def test_packed_row_equals_the_documents_alone():
    model = build(tiny_model(init_std=0.5, **GAUSSIAN), seed=2)
    a, b = _tokens(1, 10, seed=3), _tokens(1, 14, seed=4)
    packed = jnp.concatenate([a, b], axis=1)
    segments = jnp.array([[1] * 10 + [2] * 14])
    positions = jnp.array([list(range(10)) + list(range(14))])
    logits = model(packed, positions_BxL=positions, segment_ids_BxL=segments).logits
    np.testing.assert_allclose(logits[:, :10], model(a).logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[:, 10:], model(b).logits, atol=1e-5, rtol=1e-5)


def test_gqa_model_equals_mha_with_repeated_kv_heads():
    gqa = build(tiny_model(num_heads=4, num_kv_heads=2, **GAUSSIAN), seed=6)
    pure = nnx.to_pure_dict(nnx.split(gqa, nnx.Param)[1])
    for name in ("k_proj", "v_proj"):
        pure["layers"]["attn"][name] = jnp.repeat(pure["layers"]["attn"][name], 2, axis=2)
    mha_cfg = tiny_model(num_heads=4, num_kv_heads=4, **GAUSSIAN)
    mha = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: build(mha_cfg))), pure)
    tokens = _tokens(2, 16)
    np.testing.assert_allclose(gqa(tokens).logits, mha(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_cached_greedy_generation_equals_full_forward_passes(impl):
    """The cache holds [k ; ||k||^2]: decode steps (the reference and the Pallas decode kernel)
    give the tokens of repeated full forward passes."""
    model = build(tiny_model(init_std=0.5, **GAUSSIAN), seed=3)
    prompts, n = [[1, 2, 3, 4, 5], [7, 8, 9]], 8
    gen = GenerateConfig(max_new_tokens=n, kv_cache_dtype="float32", decode_impl=impl)
    got = generate(model, prompts, gen).tokens
    want = [greedy_continue(model, p, n).tolist() for p in prompts]
    assert got == want
    assert len({t for seq in want for t in seq}) > 3  # not a degenerate repetition


def test_engine_with_chunked_prefill_equals_generate():
    """The paged engine (a 20-token prompt prefilled in chunks of 16 over the cache) gives
    `generate`'s tokens."""
    from jaxllm.infer.engine import Engine, SamplingParams

    model = build(tiny_model(init_std=0.5, **GAUSSIAN), seed=3)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 27))]
    engine = Engine(model, max_num_seqs=4, page_size=8, num_pages=48, chunk_size=16)
    got = [o[0].tokens for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
    gen = GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32")
    assert got == generate(model, prompts, gen).tokens


def test_sigma_is_learned_per_head_or_fixed():
    fixed = build(tiny_model(**GAUSSIAN), seed=0)
    assert not any("sigma" in "/".join(map(str, p)) for p in nnx.to_flat_state(nnx.state(fixed)))
    learned = build(tiny_model(**GAUSSIAN, gaussian_sigma_learned=True), seed=0)
    log_sigma = learned.layers.attn.gaussian_log_sigma
    assert log_sigma.shape == (2, 4)  # [layers, heads]
    np.testing.assert_allclose(log_sigma[...], math.log(0.8), rtol=1e-6)
    graphdef, params = nnx.split(learned, nnx.Param)
    tokens = _tokens(2, 12)

    def loss(p):
        return nnx.merge(graphdef, p)(tokens).logits.std()

    grad = jax.grad(loss)(params)["layers"]["attn"]["gaussian_log_sigma"][...]
    assert np.all(np.abs(grad) > 0)
    # sigma changes the output (so it is the one the logits use)
    state = nnx.to_pure_dict(params)
    state["layers"]["attn"]["gaussian_log_sigma"] = log_sigma[...] + 1.0
    wider = nnx.merge(graphdef, state)(tokens).logits
    assert not np.allclose(wider, learned(tokens).logits, atol=1e-3)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention_impl="flash"), "attention_impl xla or auto, not flash"),
        (dict(attn_soft_cap=5.0), "model.attn_soft_cap"),
        (dict(attn_scale=0.1), "model.attn_scale"),
        (dict(gaussian_sigma=0.0), "gaussian_sigma must be positive"),
        (dict(attention_kernel="softmax", gaussian_sigma_learned=True), "apply to"),
    ],
)
def test_refusals(changes, message):
    with pytest.raises(config.ConfigError, match=message):
        config.from_dict({"model": {**GAUSSIAN, **changes}}).model.validate()


def test_export_names_the_kernel_no_config_json_holds():
    from jaxllm.convert import families

    with pytest.raises(config.ConfigError, match="attention_kernel='gaussian'"):
        families.hf_config(tiny_model(**GAUSSIAN), families.FAMILIES["llama"])
