"""Mixture-of-experts routing: top-k choice and weights, the balancing bias, group-limited
routing against DeepSeek-V2/V3's routers, the auxiliary and z-losses, load metrics, and the
config mistakes the MoE section refuses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import config
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.model.moe import MoE, load_metrics, route


def test_router_scores_top_k_and_bias():
    logits = jnp.log(jnp.array([[[0.1, 0.2, 0.3, 0.4]]]))  # softmax = these probabilities
    r = route(logits, None, MoEConfig(num_experts=4, experts_per_token=2))
    np.testing.assert_array_equal(r.expert_BxLxX[0, 0], [3, 2])
    np.testing.assert_allclose(r.weight_BxLxX[0, 0], [0.4 / 0.7, 0.3 / 0.7], rtol=1e-6)
    raw = route(logits, None, MoEConfig(num_experts=4, experts_per_token=2, normalize_top_k=False))
    np.testing.assert_allclose(raw.weight_BxLxX[0, 0], [0.4, 0.3], rtol=1e-6)
    # the bias moves the choice to expert 0 but its weight is still the unbiased score
    sig = MoEConfig(
        num_experts=4,
        experts_per_token=1,
        router_score="sigmoid",
        route_scale=2.0,
        normalize_top_k=False,
    )
    biased = route(logits, jnp.array([1.0, 0.0, 0.0, 0.0]), sig)
    assert int(biased.expert_BxLxX[0, 0, 0]) == 0
    np.testing.assert_allclose(biased.weight_BxLxX[0, 0, 0], 2.0 * jax.nn.sigmoid(logits[0, 0, 0]))
    # bfloat16 activations: the router still computes in float32
    layer = nnx.eval_shape(
        lambda: MoE(
            8,
            8,
            MoEConfig(num_experts=4),
            init_std=0.1,
            out_std=0.1,
            dtype=jnp.bfloat16,
            param_dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0),
        )
    )
    jaxpr = str(jax.make_jaxpr(lambda m, x: m(x))(layer, jnp.ones((1, 2, 8), jnp.bfloat16)))
    assert "top_k[" in jaxpr and "f32[1,2,4]" in jaxpr


def _deepseek_v3_router(logits_TxE, bias_E, groups, keep, top_k, scale):
    """transformers' `DeepseekV3TopkRouter.forward` in numpy, token by token: sigmoid scores,
    biased for the choice; groups ranked by the sum of their two best biased scores; top-k
    within the best `keep` groups; unbiased weights renormalised and scaled."""
    scores_TxE = 1 / (1 + np.exp(-logits_TxE))
    experts, weights = [], []
    for score_E in scores_TxE:
        choice_GxS = (score_E + bias_E).reshape(groups, -1)
        group_score_G = np.sort(choice_GxS, axis=-1)[:, -2:].sum(-1)
        masked_GxS = np.full_like(choice_GxS, -np.inf)
        best = np.argsort(-group_score_G)[:keep]
        masked_GxS[best] = choice_GxS[best]
        top = np.sort(np.argsort(-masked_GxS.ravel())[:top_k])
        experts.append(top)
        weights.append(score_E[top] / score_E[top].sum() * scale)
    return np.array(experts), np.array(weights)


def test_group_limited_routing_equals_deepseek_v3s_router():
    cfg = MoEConfig(
        num_experts=16,
        experts_per_token=4,
        router_score="sigmoid",
        num_groups=4,
        groups_per_token=2,
        route_scale=2.5,
        router_bias=True,
    )
    rng = np.random.default_rng(0)
    logits_BxLxE = rng.normal(size=(2, 24, 16)).astype(np.float32)
    bias_E = (0.2 * rng.normal(size=16)).astype(np.float32)
    r = jax.jit(route, static_argnums=2)(jnp.asarray(logits_BxLxE), jnp.asarray(bias_E), cfg)
    order_BxLxX = np.argsort(np.asarray(r.expert_BxLxX), axis=-1)
    got_experts = np.take_along_axis(np.asarray(r.expert_BxLxX), order_BxLxX, -1).reshape(48, 4)
    got_weights = np.take_along_axis(np.asarray(r.weight_BxLxX), order_BxLxX, -1).reshape(48, 4)
    want_experts, want_weights = _deepseek_v3_router(
        logits_BxLxE.reshape(48, 16), bias_E, 4, 2, 4, 2.5
    )
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-6)
    assert max(len(set(row // 4)) for row in got_experts) == 2  # at most 2 groups of 4
    free = route(
        jnp.asarray(logits_BxLxE), jnp.asarray(bias_E), dataclasses.replace(cfg, groups_per_token=4)
    )
    assert (np.sort(np.asarray(free.expert_BxLxX), -1).reshape(48, 4) != got_experts).any()


def _deepseek_v2_router(logits_TxE, groups, keep, top_k, scale):
    """transformers' `DeepseekV2TopkRouter.forward` (topk_method group_limited_greedy) in
    numpy, token by token: softmax scores; groups ranked by their highest score; the scores
    outside the best `keep` groups set to 0; top-k weights scaled, not renormalised."""
    scores_TxE = np.exp(logits_TxE) / np.exp(logits_TxE).sum(-1, keepdims=True)
    experts, weights = [], []
    for score_E in scores_TxE:
        score_GxS = score_E.reshape(groups, -1)
        masked_GxS = np.zeros_like(score_GxS)
        best = np.argsort(-score_GxS.max(-1))[:keep]
        masked_GxS[best] = score_GxS[best]
        top = np.sort(np.argsort(-masked_GxS.ravel())[:top_k])
        experts.append(top)
        weights.append(score_E[top] * scale)
    return np.array(experts), np.array(weights)


def test_group_limited_routing_by_max_equals_deepseek_v2s_router():
    cfg = MoEConfig(
        num_experts=16,
        experts_per_token=4,
        num_groups=4,
        groups_per_token=2,
        group_score="max",
        normalize_top_k=False,
        route_scale=16.0,
    )
    logits_BxLxE = np.random.default_rng(1).normal(size=(2, 24, 16)).astype(np.float32)
    r = jax.jit(route, static_argnums=2)(jnp.asarray(logits_BxLxE), None, cfg)
    order_BxLxX = np.argsort(np.asarray(r.expert_BxLxX), axis=-1)
    got_experts = np.take_along_axis(np.asarray(r.expert_BxLxX), order_BxLxX, -1).reshape(48, 4)
    got_weights = np.take_along_axis(np.asarray(r.weight_BxLxX), order_BxLxX, -1).reshape(48, 4)
    want_experts, want_weights = _deepseek_v2_router(logits_BxLxE.reshape(48, 16), 4, 2, 4, 16.0)
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5)
    # the group score matters here: ranking by the top-2 sum picks other experts for some tokens
    top2 = route(jnp.asarray(logits_BxLxE), None, dataclasses.replace(cfg, group_score="top2_sum"))
    assert (np.sort(np.asarray(top2.expert_BxLxX), -1).reshape(48, 4) != got_experts).any()


def test_aux_loss_z_loss_and_load_metrics():
    e = 4
    cfg = MoEConfig(num_experts=e, experts_per_token=1)
    # perfectly balanced: token t prefers expert t % 4 with the same margin
    balanced = jnp.tile(jnp.eye(e) * 2.0, (1, 2, 1))  # [1, 8, 4]
    r = route(balanced, None, cfg)
    assert float(r.aux_loss) == pytest.approx(1.0, abs=1e-6)
    lse = np.log(np.exp(2.0) + 3.0)
    assert float(r.z_loss) == pytest.approx(lse**2, rel=1e-6)
    # everything on expert 0: f = (1, 0, 0, 0), so the loss is E * P_0
    skewed = jnp.tile(jnp.array([2.0, 0.0, 0.0, 0.0]), (1, 8, 1))
    r = route(skewed, None, cfg)
    p0 = np.exp(2.0) / (np.exp(2.0) + 3.0)
    assert float(r.aux_loss) == pytest.approx(e * p0, rel=1e-6)
    m = load_metrics(jnp.array([[8.0, 0, 0, 0], [2.0, 2, 2, 2]]), jnp.array(4.0))
    assert float(m["moe_load_max"]) == 1.0 and float(m["moe_load_min"]) == 0.0
    assert float(m["moe_load_cv"]) == pytest.approx(np.sqrt(3) / 2)  # (sqrt(3) + 0) / 2
    assert float(m["moe_dropped_frac"]) == pytest.approx(4 / 16)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.moe.num_experts=4", "model.moe.experts_per_token=5"], "experts_per_token"),
        (
            ["model.moe.num_experts=4", "model.moe.first_dense_layers=1", "model.moe.moe_every=2"],
            "moe_every",
        ),
        (["model.moe.num_experts=4", "model.moe.first_dense_layers=4"], "first_dense_layers"),
        (["model.moe.num_experts=4", "model.moe.capacity_factor=0"], "capacity_factor"),
        (["model.moe.num_experts=4", "model.moe.bias_update_rate=-1"], "bias_update_rate"),
        (["model.moe.num_experts=-1"], "num_experts"),
        (["model.moe.num_experts=6", "model.moe.num_groups=4"], "num_groups"),
        (
            ["model.moe.num_experts=8", "model.moe.num_groups=4", "model.moe.groups_per_token=5"],
            "groups_per_token",
        ),
        (
            ["model.moe.num_experts=8", "model.moe.num_groups=4", "model.moe.experts_per_token=3"],
            "raise groups_per_token",
        ),  # one group of 2 holds fewer than 3 experts
    ],
)
def test_moe_config_mistakes(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        config.load(None, overrides)
