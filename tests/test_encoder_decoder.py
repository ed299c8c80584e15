"""The encoder–decoder model (`model.kind=encoder_decoder`): T5 relative position buckets
against transformers' function, causality of the decoder, cross-attention through the flash
kernel (interpreted), a train step on one device vs dp2 x fsdp2 x tp2, its config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import config, sharding
from jaxllm.config.seq2seq import RelativeConfig
from jaxllm.model import build
from jaxllm.model.attention import dot_product_attention
from jaxllm.model.relative_position import relative_position_bucket
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state

T5 = dict(
    kind="encoder_decoder",
    position="relative",
    relative=RelativeConfig(num_buckets=8, max_distance=16),
    mlp_activation="geglu",
    vocab_size=64,
)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_match_t5(bidirectional):
    # transformers' T5Attention._relative_position_bucket (torch), written out on numpy
    rel = np.arange(-40, 41)[None, :] - np.zeros((1, 1), np.int64)
    n, max_distance = 8, 16
    ref = np.zeros_like(rel)
    if bidirectional:
        n //= 2
        ref += (rel > 0) * n
        dist = np.abs(rel)
    else:
        dist = -np.minimum(rel, 0)
    exact = n // 2
    with np.errstate(divide="ignore", invalid="ignore"):
        large = exact + (
            np.log(dist.astype(np.float32) / exact) / np.log(max_distance / exact) * (n - exact)
        ).astype(np.int64)
    ref += np.where(dist < exact, dist, np.minimum(large, n - 1))
    ours = relative_position_bucket(
        jnp.asarray(rel, jnp.int32), bidirectional=bidirectional, num_buckets=8, max_distance=16
    )
    np.testing.assert_array_equal(np.asarray(ours), ref)


def test_decoder_is_causal_and_encoder_padding_is_unseen():
    model = build(tiny_model(**T5), seed=0)
    rng = np.random.default_rng(0)
    ids, dec = rng.integers(1, 64, (2, 10)), rng.integers(1, 64, (2, 6))
    seg = np.ones_like(ids)
    seg[:, 7:] = 0
    forward = nnx.jit(lambda m, a, b, s: m(a, b, segment_ids_BxS=s).logits)
    logits = np.asarray(forward(model, ids, dec, seg))
    dec2 = dec.copy()
    dec2[:, 4:] = 3  # later decoder tokens change nothing before them
    ids2 = ids.copy()
    ids2[:, 7:] = 5  # nor does encoder padding
    logits2 = np.asarray(forward(model, ids2, dec2, seg))
    np.testing.assert_allclose(logits2[:, :4], logits[:, :4], atol=1e-6)
    assert not np.allclose(logits2[:, 4:], logits[:, 4:])


def test_cross_attention_flash_kernel_equals_xla():
    """Non-causal attention of 16 queries over 40 keys with key padding (segment ids)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 40, 2, 32)), jnp.float32) for _ in range(2))
    q_seg = jnp.ones((2, 16), jnp.int32)
    kv_seg = jnp.asarray(np.arange(40)[None, :] < np.array([[40], [29]]), jnp.int32)
    out = {
        impl: dot_product_attention(
            q, k, v, q_segment_ids_BxL=q_seg, kv_segment_ids_BxS=kv_seg, causal=False, impl=impl
        )
        for impl in ("xla", "flash")
    }
    np.testing.assert_allclose(out["flash"], out["xla"], atol=2e-5)


def _train(mesh_cfg: dict, devices, steps=2):
    cfg = config.Config(
        model=tiny_model(**T5, remat="full"),
        mesh=config.MeshConfig(**{"data": 1, **mesh_cfg}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=4, steps=steps, objective="span_corruption"),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        targets = rng.integers(1, 64, (4, 12)).astype(np.int32)
        batch = {
            "inputs": rng.integers(1, 64, (4, 32)).astype(np.int32),
            "segment_ids": (np.arange(32)[None] < [[32], [30], [20], [32]]).astype(np.int32),
            "decoder_inputs": np.concatenate([np.zeros((4, 1), np.int32), targets[:, :-1]], 1),
            "targets": targets,
            "loss_mask": (np.arange(12)[None] < [[12], [9], [12], [5]]).astype(np.int32),
        }
        state, metrics = step(state, to_global(batch, batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.mark.slow  # two compiles of the remat'd step: ~75 s on 2 cores
def test_train_step_single_device_equals_dp2_fsdp2_tp2():
    ref_losses, ref_params = _train({}, jax.devices()[:1])
    losses, params = _train({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[1] < losses[0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.position=relative"], "model.kind=encoder_decoder"),
        (["model.decoder_layers=2"], "model.decoder_layers"),
        (["model.kind=encoder_decoder", "model.position=rope"], "model.position"),
        (
            ["model.kind=encoder_decoder", "model.position=relative", "model.qk_norm=true"],
            "qk_norm",
        ),
        (
            ["model.kind=encoder_decoder", "model.position=none", "model.relative.num_buckets=16"],
            "model.relative",
        ),
        (["data.span_corruption.noise_density=0.3"], "data.span_corruption"),
    ],
)
def test_config_mistakes_name_their_keys(overrides, key):
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
        config.load(None, overrides)
