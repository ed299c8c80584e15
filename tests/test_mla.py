"""Multi-head Latent Attention: the layer equals the DeepSeek-V2/V3 equations written out, its
latent cache decodes the same tokens as full forward passes (absorbed form) while storing only
[latent ; rope key] per token, and it trains sharded like a single device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shard_model, tiny_model
from flax import nnx

from jaxllm import config, sharding
from jaxllm.config import ConfigError, GenerateConfig, MeshConfig, MLAConfig, RopeConfig
from jaxllm.infer import generate, greedy_continue
from jaxllm.infer import kv_cache as kvc
from jaxllm.metrics import param_counts
from jaxllm.model import MLAttention, build

MLA = MLAConfig(
    kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]


def _cfg(mla=MLA, **kw):
    base = dict(num_kv_heads=4, mla=mla, init_std=0.5, max_seq_len=64)
    return tiny_model(**{**base, **kw})


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope_hf(x_BxHxLxE, pos_L, theta, interleave):
    """Hugging Face DeepSeek-V3's rotary embedding (`apply_rotary_pos_emb_interleave` when the
    checkpoint pairs adjacent channels): de-interleave, then rotate half."""
    e = x_BxHxLxE.shape[-1]
    if interleave:
        b, h, l, _ = x_BxHxLxE.shape
        x_BxHxLxE = x_BxHxLxE.reshape(b, h, l, e // 2, 2).swapaxes(3, 4).reshape(b, h, l, e)
    inv = 1.0 / theta ** (np.arange(0, e, 2) / e)
    ang = pos_L[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x_BxHxLxE[..., e // 2 :], x_BxHxLxE[..., : e // 2]], -1)
    return x_BxHxLxE * cos + rot * sin


def _reference(p, x_BxLxD, a: MLAConfig, h, interleave):
    """DeepSeek-V3 attention (transformers' `DeepseekV3Attention.forward`) in numpy, with torch
    layouts built from our [in, out] weights; causal, no cache."""
    b, l, _ = x_BxLxD.shape
    n, e, v = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    if a.q_lora_rank:
        q = _rms(x_BxLxD @ p["q_a_proj"], p["q_a_norm"]["scale"]) @ p["q_b_proj"].reshape(
            a.q_lora_rank, -1
        )
    else:
        q = x_BxLxD @ p["q_proj"].reshape(x_BxLxD.shape[-1], -1)
    q = q.reshape(b, l, h, n + e).transpose(0, 2, 1, 3)
    q_pass, q_rot = q[..., :n], q[..., n:]
    ckv = x_BxLxD @ p["kv_a_proj"]
    k_pass, k_rot = ckv[..., : a.kv_lora_rank], ckv[..., a.kv_lora_rank :]
    k_pass = _rms(k_pass, p["kv_a_norm"]["scale"]) @ p["kv_b_proj"].reshape(a.kv_lora_rank, -1)
    k_pass = k_pass.reshape(b, l, h, n + v).transpose(0, 2, 1, 3)
    k_pass, value = k_pass[..., :n], k_pass[..., n:]
    k_rot = k_rot.reshape(b, 1, l, e)
    pos = np.arange(l, dtype=np.float64)
    q_rot, k_rot = (
        _rope_hf(q_rot, pos, 10000.0, interleave),
        _rope_hf(k_rot, pos, 10000.0, interleave),
    )
    k_rot = np.broadcast_to(k_rot, (b, h, l, e))
    q_all, k_all = np.concatenate([q_pass, q_rot], -1), np.concatenate([k_pass, k_rot], -1)
    s = q_all @ k_all.swapaxes(-1, -2) * (n + e) ** -0.5
    s = np.where(np.tril(np.ones((l, l), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out = (w / w.sum(-1, keepdims=True)) @ value  # [B, H, L, V]
    return out.transpose(0, 2, 1, 3).reshape(b, l, h * v) @ p["o_proj"].reshape(h * v, -1)


@pytest.mark.parametrize("q_lora_rank", [0, 12])
@pytest.mark.parametrize("interleave", [False, True])
def test_layer_equals_the_deepseek_equations(q_lora_rank, interleave):
    mla = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    cfg = _cfg(mla, rope=RopeConfig(interleave=interleave))
    layer = MLAttention(cfg, out_std=0.5, rngs=nnx.Rngs(0))
    p = jax.tree.map(
        lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    )
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 10, cfg.d_model)))
    got = layer(jnp.asarray(x, jnp.float32), jnp.broadcast_to(jnp.arange(10), (2, 10)), None).out
    want = _reference(p, x.astype(np.float64), cfg.mla, cfg.num_heads, interleave)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    assert ("q_proj" in p) == (q_lora_rank == 0)


def test_flash_attention_pads_the_narrower_values():
    """q/k heads are N + E wide, values V: the kernel runs on zero-padded values."""
    x_cfg = _cfg(attention_impl="xla")
    tokens = jax.random.randint(jax.random.key(0), (1, 16), 0, 64)
    want = build(x_cfg, seed=0)(tokens).logits
    got = build(dataclasses.replace(x_cfg, attention_impl="flash"), seed=0)(tokens).logits
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def model():
    return build(_cfg(), seed=0)


@pytest.mark.parametrize(
    "gen",
    [
        GenerateConfig(kv_cache_dtype="float32"),
        GenerateConfig(kv_cache_dtype="float32", kv_page_size=16, kv_group=16),
    ],
    ids=["contiguous", "paged"],
)
def test_latent_cache_decodes_like_full_forward_passes(model, gen):
    n = 10
    out = generate(model, PROMPTS, dataclasses.replace(gen, max_new_tokens=n))
    ref = [greedy_continue(model, p, n).tolist() for p in PROMPTS]
    assert out.tokens == ref
    assert len({t for seq in ref for t in seq}) > 3  # not a degenerate repetition


def test_latent_cache_holds_only_the_latent_and_rope_key(model):
    cfg = model.cfg
    g, k, value_dim = kvc.cache_dims(cfg)
    assert (g, k, value_dim) == (1, 16 + 4, 16)
    cache = kvc.init_cache(
        num_layers=2,
        batch=3,
        num_kv_heads=g,
        head_dim=k,
        max_len=32,
        kind="bfloat16",
        value_dim=value_dim,
    )
    assert cache.v is None and cache.k.shape == (2, 3, 1, 32, 20)
    per_token = kvc.model_bytes_per_token(cfg, "bfloat16")
    assert per_token == 2 * (16 + 4) * 2  # layers x (latent + rope key) x 2 bytes
    # the same heads as GQA-free multi-head attention would cache 2 x H x (N + E) per layer
    mha = kvc.bytes_per_token("bfloat16", 2, 4, 8 + 4, 32)
    assert per_token / mha == pytest.approx(20 / (2 * 4 * 12))
    assert kvc.model_bytes_per_token(cfg, "int8") == 2 * (20 + 2)
    out = generate(model, PROMPTS, GenerateConfig(max_new_tokens=4, kv_cache_dtype="bfloat16"))
    assert out.cache_bytes_per_token == per_token


def test_int8_latent_cache_decodes_mostly_the_same_tokens(model):
    n = 10
    ref = generate(model, PROMPTS, GenerateConfig(max_new_tokens=n, kv_cache_dtype="float32"))
    got = generate(model, PROMPTS, GenerateConfig(max_new_tokens=n, kv_cache_dtype="int8"))
    agree = np.mean([a == b for x, y in zip(got.tokens, ref.tokens) for a, b in zip(x, y)])
    assert agree >= 0.8, agree


def test_sharded_generation_matches_one_device(model):
    """Batch over data x fsdp, heads over tensor; the one-head latent cache is replicated over
    tensor."""
    gen = GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32")
    want = generate(model, PROMPTS, gen).tokens
    mesh = sharding.make_mesh(MeshConfig(data=2, tensor=2, fsdp=2))
    sharded = shard_model(model, mesh)
    assert sharded.layers.attn.kv_b_proj[...].sharding.spec[2] == "tensor"
    assert generate(sharded, PROMPTS, gen, mesh=mesh).tokens == want


# ~50 s each; the sharded MLA step compiles in test_plan (latent cache on a mesh) by default
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor=2, sequence=4, sequence_attention="ring"),
        dict(tensor=2, sequence=2, data=2, sequence_attention="ulysses"),
        dict(tensor=2, sequence=4, sequence_attention="usp", sequence_ulysses=2),
    ],
    ids=["ring", "ulysses", "usp"],
)
def test_sharded_training_matches_one_device(layout):
    """Heads split over tensor, the sequence over a ring (whose kernel-shaped blocks take the
    zero-padded values), Ulysses' head groups (values of their own width) or both: two steps
    equal one device's."""
    from jaxllm.bench import synthetic_batch
    from jaxllm.train.loop import compile_steps, to_global
    from jaxllm.train.state import init_state

    def run(mesh_cfg, devices):
        cfg = config.Config(
            model=_cfg(init_std=0.02, vocab_size=264, d_model=64),
            mesh=mesh_cfg,
            data=config.DataConfig(seq_len=32),
            train=config.TrainConfig(global_batch_size=8, steps=2),
            optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
        ).validate(len(devices))
        mesh = sharding.make_mesh(cfg.mesh, devices)
        step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
        state = init_state(cfg.model, tx, mesh, seed=0)
        losses = []
        for i in range(2):
            state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state.params)

    ref_losses, ref_params = run(MeshConfig(data=1), jax.devices()[:1])
    losses, params = run(MeshConfig(**{"data": 1, **layout}), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_param_count_matches_the_model(model):
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert param_counts(model.cfg)["total"] == n


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.mla.kv_lora_rank=16"], "num_kv_heads"),  # default GQA heads
        (["model.mla.kv_lora_rank=16", "model.num_kv_heads=4", "model.position=alibi"], "position"),
        (["model.mla.kv_lora_rank=16", "model.num_kv_heads=4", "model.qk_norm=true"], "qk_norm"),
        (
            ["model.mla.kv_lora_rank=16", "model.num_kv_heads=4", "generate.kv_cache_dtype=int4"],
            "int4",
        ),
        (
            ["model.mla.kv_lora_rank=16", "model.num_kv_heads=4", "generate.kv_cache_dtype=int2"],
            "int2",
        ),
        (
            ["model.mla.kv_lora_rank=16", "model.num_kv_heads=4", "generate.decode_impl=kernel"],
            "decode_impl",
        ),
    ],
)
def test_invalid_mla_configs(overrides, key):
    with pytest.raises(ConfigError, match=key):
        config.load(None, overrides).validate()
