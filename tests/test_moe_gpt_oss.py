"""gpt-oss's mixture of experts (`model.moe.router_logit_bias`, `expert_bias`,
`activation=swiglu_clamped`) against transformers' `GptOssMLP` built tiny in float32: both
dispatch modes, with values large enough that the clamps bite; training of a gpt-oss-shaped
model (with sinks) on an expert x fsdp x tensor mesh equal to one device; the config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as hf
from conftest import tiny_model
from flax import nnx
from test_moe_parallel import _train

from jaxllm import config
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.model.moe import MoE
from jaxllm.model.moe_experts import clamped_swiglu

D, F, E, K = 12, 10, 5, 2


def _hf_mlp(seed=0):
    cfg = hf.GptOssConfig(
        hidden_size=D,
        intermediate_size=F,
        num_local_experts=E,
        num_experts_per_tok=K,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=6,
    )
    torch.manual_seed(seed)
    mlp = hf.models.gpt_oss.modeling_gpt_oss.GptOssMLP(cfg).float()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p))  # std 1: many gate / up values past the limit of 7
    return mlp


def _ours(mlp, dispatch):
    moe = MoEConfig(
        num_experts=E,
        experts_per_token=K,
        router_logit_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        dispatch=dispatch,
        capacity_factor=float(E),  # no assignment dropped
    )
    layer = MoE(
        D,
        F,
        moe,
        init_std=0.02,
        out_std=0.02,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    t = {n: p.detach().numpy() for n, p in mlp.named_parameters()}
    gate_up, gate_up_b = t["experts.gate_up_proj"], t["experts.gate_up_proj_bias"]
    layer.router[...] = jnp.asarray(t["router.weight"].T)
    layer.router_logit_bias[...] = jnp.asarray(t["router.bias"])
    layer.gate_proj[...] = jnp.asarray(gate_up[..., ::2])  # interleaved: gate even, up odd
    layer.up_proj[...] = jnp.asarray(gate_up[..., 1::2])
    layer.gate_bias[...] = jnp.asarray(gate_up_b[..., ::2])
    layer.up_bias[...] = jnp.asarray(gate_up_b[..., 1::2])
    layer.down_proj[...] = jnp.asarray(t["experts.down_proj"])
    layer.down_bias[...] = jnp.asarray(t["experts.down_proj_bias"])
    return layer


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_moe_matches_transformers(dispatch):
    mlp = _hf_mlp()
    x = np.random.default_rng(1).normal(size=(2, 7, D)).astype(np.float32)
    with torch.no_grad():
        want = mlp(torch.from_numpy(x))[0].numpy()
    got = _ours(mlp, dispatch)(jnp.asarray(x)).out
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def _gpt_oss_cfg(dispatch, **mesh) -> config.Config:
    moe = MoEConfig(
        num_experts=8,
        experts_per_token=2,
        router_logit_bias=True,
        expert_bias=True,
        activation="swiglu_clamped",
        dispatch=dispatch,
        capacity_factor=1.0,
    )
    model = tiny_model(
        vocab_size=258,
        attention_sinks=True,
        qkv_bias=True,
        o_bias=True,
        sliding_window=4,
        global_every=2,
        moe=moe,
    )
    return config.Config(
        model=model,
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=16),
        train=config.TrainConfig(global_batch_size=8, steps=2),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


@pytest.mark.parametrize(
    "dispatch,mesh",
    [
        ("dropless", dict(expert=2, fsdp=2, tensor=2)),
        pytest.param(
            "capacity",
            dict(expert=2, fsdp=2, tensor=2, expert_dispatch="all_to_all"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ep2_fsdp2_tp2-dropless", "ep2_fsdp2_tp2-capacity-all_to_all"],
)
def test_sharded_training_matches_single_device(dispatch, mesh):
    """Two train steps (sinks, biases and the clamped experts in the gradients) on an expert x
    fsdp x tensor mesh equal one device's; the biases moved from their zero init."""
    ref_losses, ref_state, _, initial = _train(_gpt_oss_cfg(dispatch), jax.devices()[:1])
    losses, state, _, _ = _train(_gpt_oss_cfg(dispatch, **mesh), jax.devices(), initial)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)),
        jax.tree.leaves(jax.device_get(ref_state.params)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    mlp = jax.device_get(state.params)["moe_layers"]["moe"]["mlp"]
    for name in ("router_logit_bias", "gate_bias", "up_bias", "down_bias"):
        assert np.abs(mlp[name]).max() > 0, name


def test_clamped_swiglu_clips():
    gate = jnp.asarray([-20.0, 0.5, 20.0])
    up = jnp.asarray([-20.0, 0.5, 20.0])
    got = np.asarray(clamped_swiglu(gate, up, alpha=1.702, limit=7.0))
    g, u = np.minimum([-20.0, 0.5, 20.0], 7.0), np.clip([-20.0, 0.5, 20.0], -7.0, 7.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_config_checks():
    with pytest.raises(ConfigError, match="swiglu_limit"):
        config.load(None, ["model.moe.num_experts=4", "model.moe.swiglu_limit=0"])
    with pytest.raises(ConfigError, match="activation"):
        config.load(None, ["model.moe.num_experts=4", "model.moe.activation=gelu"])
