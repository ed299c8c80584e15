"""Gated DeltaNet blocks in a hybrid stack (`model.layer_pattern`): packed documents equal
documents run alone, generation through the fixed-size state equals the full forward, and
the config refuses what the layers cannot take."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ConfigError, GenerateConfig, LinearAttentionConfig, ModelConfig
from jaxllm.infer.generate import generate, greedy_continue, score_with_cache
from jaxllm.model import build

LINEAR = LinearAttentionConfig(
    kind="gated_deltanet", num_k_heads=1, num_v_heads=3, k_head_dim=8, v_head_dim=6, chunk_size=8
)
HYBRID = ModelConfig(
    vocab_size=64,
    d_model=48,
    num_layers=4,
    num_heads=3,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    dtype="float32",
    max_seq_len=128,
    layer_pattern=("linear", "linear", "linear", "full"),
    linear_attention=LINEAR,
    attn_output_gate=True,
    norm_offset=1.0,
    rope=dataclasses.replace(ModelConfig().rope, partial_factor=0.25),
)


@pytest.fixture(scope="module")
def model():
    HYBRID.validate()
    return build(HYBRID, seed=3)


def test_packed_row_equals_documents_alone(model):
    toks = jax.random.randint(jax.random.key(0), (1, 21), 0, 64)
    seg = jnp.asarray([[1] * 9 + [2] * 12])
    pos = jnp.asarray([list(range(9)) + list(range(12))])
    packed = model(toks, segment_ids_BxL=seg, positions_BxL=pos).logits
    np.testing.assert_allclose(packed[:, :9], model(toks[:, :9]).logits, atol=1e-5)
    np.testing.assert_allclose(packed[:, 9:], model(toks[:, 9:]).logits, atol=1e-5)


def test_generation_through_the_state_equals_the_full_forward(model):
    """Greedy decoding with the recurrent state (right-padded prompts of two lengths)
    equals argmax continuation by full forward passes."""
    prompts = [[5, 9, 1, 33, 7, 2, 40, 11, 3, 8, 19], [4, 4, 17]]
    gen = GenerateConfig(max_new_tokens=6, temperature=0.0, kv_cache_dtype="float32")
    out = generate(model, prompts, gen)
    for p, got in zip(prompts, out.tokens, strict=True):
        assert got == greedy_continue(model, p, 6).tolist()


def test_teacher_forced_decode_matches_forward_logits(model):
    toks = jax.random.randint(jax.random.key(1), (2, 19), 0, 64)
    nll, _ = score_with_cache(model, toks, GenerateConfig(kv_cache_dtype="float32"), prefix=5)
    logp = jax.nn.log_softmax(model(toks).logits[:, 4:-1], axis=-1)
    want = -jnp.take_along_axis(logp, toks[:, 5:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(nll, want, atol=1e-4)


def test_gradients_reach_every_linear_parameter(model):
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p, rest)(toks).logits ** 2)

    grads = nnx.to_pure_dict(jax.grad(loss)(params))
    lin = grads["hybrid_layers"]["block_0"]["attn"]
    for name, g in lin.items():
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(num_layers=6), "must divide model.num_layers"),
        (dict(layer_pattern=("linear", "sliding")), "linear or full"),
        (dict(attn_soft_cap=30.0), "attn_soft_cap"),
        (dict(linear_attention=LinearAttentionConfig()), "gated_deltanet"),
        (
            dict(linear_attention=dataclasses.replace(LINEAR, num_v_heads=4, num_k_heads=3)),
            "multiple",
        ),
    ],
)
def test_bad_hybrid_configs_fail_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words) as err:
        dataclasses.replace(HYBRID, **change).validate()
    assert "\n" not in str(err.value)


def test_mla_is_refused_with_linear_layers():
    from jaxllm.config import MLAConfig

    cfg = dataclasses.replace(
        HYBRID,
        num_kv_heads=3,
        head_dim=None,
        rope=ModelConfig().rope,
        mla=MLAConfig(kv_lora_rank=8),
    )
    with pytest.raises(ConfigError, match="MLA"):
        cfg.validate()


def test_sharded_forward_and_generation_match_one_device():
    """Value and key heads over tensor, the batch over data x fsdp: logits of a packed batch
    and greedy generation equal one device's."""
    from conftest import shard_model
    from flax import nnx

    from jaxllm import sharding
    from jaxllm.config import MeshConfig

    lin = dataclasses.replace(LINEAR, num_k_heads=2, num_v_heads=4)
    cfg = dataclasses.replace(HYBRID, num_heads=4, num_kv_heads=2, linear_attention=lin)
    model = build(cfg, seed=1)
    toks = jax.random.randint(jax.random.key(5), (4, 16), 0, 64)
    seg = jnp.asarray([[1] * 7 + [2] * 9] * 4)
    want = model(toks, segment_ids_BxL=seg).logits
    mesh = sharding.make_mesh(MeshConfig(data=2, tensor=2, fsdp=2))
    sharded = shard_model(model, mesh)
    assert sharded.hybrid_layers.block_0.attn.v_proj[...].sharding.spec[2] == "tensor"
    graphdef, state = nnx.split(sharded)

    @jax.jit
    def forward(state, toks, seg):
        return nnx.merge(graphdef, state)(toks, segment_ids_BxL=seg).logits

    with sharding.active(sharding.Parallel(mesh)):
        got = forward(state, toks, seg)
    np.testing.assert_allclose(got, want, atol=2e-5)
    gen = GenerateConfig(max_new_tokens=4, kv_cache_dtype="float32")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3]]
    assert generate(sharded, prompts, gen, mesh=mesh).tokens == generate(model, prompts, gen).tokens


def test_sequence_axis_is_refused_with_linear_layers():
    from jaxllm import config

    cfg = config.Config(
        model=HYBRID, mesh=config.MeshConfig(data=1, sequence=8), data=config.DataConfig(seq_len=64)
    )
    with pytest.raises(ConfigError, match="mesh.sequence=1"):
        cfg.validate(8)


def test_param_count_matches_the_model(model):
    from flax import nnx

    from jaxllm.metrics import param_counts

    _, params, _ = nnx.split(model, nnx.Param, ...)
    assert param_counts(HYBRID)["total"] == sum(x.size for x in jax.tree.leaves(params))
