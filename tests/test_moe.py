"""Mixture-of-experts: the layer against a dense every-expert reference (forward and gradients,
both dispatch modes), routing and losses, layer layouts, expert-parallel training against one
device, auxiliary-loss-free balancing, checkpoints, presets, plans."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxllm
from jaxllm import checkpoint, config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.metrics import flops_per_token, param_counts
from jaxllm.model import build
from jaxllm.model.moe import (
    MoE,
    RouterBias,
    capacity,
    combine_weights,
    dense_reference,
    load_metrics,
    route,
    update_router_bias,
)
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state
from jaxllm.train.step import loss_fn

REPO = Path(__file__).resolve().parent.parent


def _random_init(module, seed=0, std=0.3):
    """An abstract module filled with host-side normal values: no compiled RNG, so fast."""
    graphdef, state = nnx.split(module)
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, std, s.shape), s.dtype), state)
    return nnx.merge(graphdef, state)


def _layer(moe: MoEConfig, d=16, f=24, seed=0) -> MoE:
    """A float32 layer with random parameters (and a random balancing bias, if it has one,
    large enough to change which experts are chosen)."""
    abstract = nnx.eval_shape(
        lambda: MoE(d, f, moe, init_std=0.3, out_std=0.3, dtype=jnp.float32,
                    param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    )  # fmt: skip
    return _random_init(abstract, seed)


def _reference(layer: MoE, x_BxLxD, keep_BxLxX=None):
    """Every expert on every token, weighted by the layer's own routing (and the shared
    experts); `keep_BxLxX` zeroes dropped assignments."""
    cfg = layer.cfg
    logits = jnp.einsum("bld,de->ble", x_BxLxD, layer.router[...])
    bias = None if layer.router_bias is None else layer.router_bias[...]
    r = route(logits, bias, cfg)
    combine_BxLxE = combine_weights(r, cfg.num_experts, keep_BxLxX)
    out = dense_reference(x_BxLxD, combine_BxLxE, layer.gate_proj[...], layer.up_proj[...],
                          layer.down_proj[...], jnp.float32)  # fmt: skip
    if layer.shared is not None:
        out = out + layer.shared(x_BxLxD)
    return out


def _value_and_grads(fn, layer: MoE, x_BxLxD, cotangent):
    """f(layer, x) -> (output, grads w.r.t. every parameter and x) of <output, cotangent>."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    @jax.jit
    def run(params, rest, x_BxLxD, cotangent):
        def scalar(p, x):
            out = fn(nnx.merge(graphdef, p, rest), x)
            return jnp.sum(out * cotangent), out

        (_, out), grads = jax.value_and_grad(scalar, (0, 1), has_aux=True)(params, x_BxLxD)
        return out, grads

    return run(params, rest, x_BxLxD, cotangent)


ROUTERS = {
    "softmax_top2": MoEConfig(num_experts=4, experts_per_token=2),
    "softmax_top1_unnormalized": MoEConfig(num_experts=4, experts_per_token=1,
                                           normalize_top_k=False),
    "sigmoid_shared_bias": MoEConfig(num_experts=8, experts_per_token=3, router_score="sigmoid",
                                     num_shared_experts=2, route_scale=2.5,
                                     bias_update_rate=0.1),
    "sigmoid_groups_frozen_bias": MoEConfig(num_experts=8, experts_per_token=2,
                                            router_score="sigmoid", num_shared_experts=1,
                                            route_scale=2.5, num_groups=4, groups_per_token=2,
                                            router_bias=True),
}  # fmt: skip


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_layer_equals_dense_reference_forward_and_gradients(router, dispatch):
    # capacity_factor = E / k gives C = L slots: room for every token, so nothing is dropped
    moe = ROUTERS[router]
    moe = dataclasses.replace(moe, dispatch=dispatch,
                              capacity_factor=moe.num_experts / moe.experts_per_token)  # fmt: skip
    layer = _layer(moe)
    rng = np.random.default_rng(1)
    x, cot = (jnp.asarray(rng.normal(size=(3, 10, 16)), jnp.float32) for _ in range(2))
    out, grads = _value_and_grads(lambda m, x: m(x)[0], layer, x, cot)
    ref_out, ref_grads = _value_and_grads(_reference, layer, x, cot)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    assert float(nnx.jit(lambda m, x: m(x)[1]["dropped"])(layer, x)) == 0.0
    # the gradient reaches every routed expert and the router
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads[0]))


def _gshard_keep(expert_BxLxX: np.ndarray, cap: int) -> np.ndarray:
    """Which assignments fit: all first choices of a sequence in order, then second ones."""
    b, l, x = expert_BxLxX.shape
    keep = np.zeros((b, l, x), bool)
    for i in range(b):
        used: dict[int, int] = {}
        for j in range(x):
            for t in range(l):
                e = int(expert_BxLxX[i, t, j])
                keep[i, t, j] = used.get(e, 0) < cap
                used[e] = used.get(e, 0) + 1
    return keep


def test_capacity_mode_drops_and_counts_assignments_over_capacity():
    moe = MoEConfig(num_experts=4, experts_per_token=2, dispatch="capacity", capacity_factor=0.5)
    layer = _layer(moe, seed=4)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 16, 16)), jnp.float32)
    out, stats = nnx.jit(lambda m, x: m(x))(layer, x)
    cap = capacity(moe, 16)
    assert cap == 4  # 0.5 * 2 * 16 / 4
    r = jax.jit(route, static_argnums=2)(jnp.einsum("bld,de->ble", x, layer.router[...]), None, moe)
    keep = _gshard_keep(np.asarray(r.expert_BxLxX), cap)
    assert (~keep).sum() > 0
    assert float(stats["dropped"]) == (~keep).sum()
    ref = nnx.jit(_reference)(layer, x, jnp.asarray(keep))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    # counts are the router's choices, before dropping
    np.testing.assert_array_equal(
        stats["expert_counts"], np.bincount(r.expert_BxLxX.ravel(), minlength=4)
    )


def test_router_scores_top_k_and_bias():
    logits = jnp.log(jnp.array([[[0.1, 0.2, 0.3, 0.4]]]))  # softmax = these probabilities
    r = route(logits, None, MoEConfig(num_experts=4, experts_per_token=2))
    np.testing.assert_array_equal(r.expert_BxLxX[0, 0], [3, 2])
    np.testing.assert_allclose(r.weight_BxLxX[0, 0], [0.4 / 0.7, 0.3 / 0.7], rtol=1e-6)
    raw = route(logits, None, MoEConfig(num_experts=4, experts_per_token=2, normalize_top_k=False))
    np.testing.assert_allclose(raw.weight_BxLxX[0, 0], [0.4, 0.3], rtol=1e-6)
    # the bias moves the choice to expert 0 but its weight is still the unbiased score
    sig = MoEConfig(num_experts=4, experts_per_token=1, router_score="sigmoid", route_scale=2.0,
                    normalize_top_k=False)  # fmt: skip
    biased = route(logits, jnp.array([1.0, 0.0, 0.0, 0.0]), sig)
    assert int(biased.expert_BxLxX[0, 0, 0]) == 0
    np.testing.assert_allclose(biased.weight_BxLxX[0, 0, 0], 2.0 * jax.nn.sigmoid(logits[0, 0, 0]))
    # bfloat16 activations: the router still computes in float32
    layer = nnx.eval_shape(lambda: MoE(8, 8, MoEConfig(num_experts=4), init_std=0.1, out_std=0.1,
                                       dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                       rngs=nnx.Rngs(0)))  # fmt: skip
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
    cfg = MoEConfig(num_experts=16, experts_per_token=4, router_score="sigmoid", num_groups=4,
                    groups_per_token=2, route_scale=2.5, router_bias=True)  # fmt: skip
    rng = np.random.default_rng(0)
    logits_BxLxE = rng.normal(size=(2, 24, 16)).astype(np.float32)
    bias_E = (0.2 * rng.normal(size=16)).astype(np.float32)
    r = jax.jit(route, static_argnums=2)(jnp.asarray(logits_BxLxE), jnp.asarray(bias_E), cfg)
    order_BxLxX = np.argsort(np.asarray(r.expert_BxLxX), axis=-1)
    got_experts = np.take_along_axis(np.asarray(r.expert_BxLxX), order_BxLxX, -1).reshape(48, 4)
    got_weights = np.take_along_axis(np.asarray(r.weight_BxLxX), order_BxLxX, -1).reshape(48, 4)
    want_experts, want_weights = _deepseek_v3_router(logits_BxLxE.reshape(48, 16), bias_E, 4, 2,
                                                     4, 2.5)  # fmt: skip
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-6)
    assert max(len(set(row // 4)) for row in got_experts) == 2  # at most 2 groups of 4
    free = route(jnp.asarray(logits_BxLxE), jnp.asarray(bias_E),
                 dataclasses.replace(cfg, groups_per_token=4))  # fmt: skip
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
    cfg = MoEConfig(num_experts=16, experts_per_token=4, num_groups=4, groups_per_token=2,
                    group_score="max", normalize_top_k=False, route_scale=16.0)  # fmt: skip
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


def test_layer_layouts_param_counts_and_flops():
    moe = MoEConfig(num_experts=4, experts_per_token=2, first_dense_layers=1, moe_every=2,
                    num_shared_experts=1, expert_mlp_dim=16)  # fmt: skip
    cfg = tiny_model(num_layers=5, moe=moe)
    model = nnx.eval_shape(lambda: build(cfg))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # 1 leading dense block, then 2 x (dense, MoE)
    assert params["layers"]["mlp"]["gate_proj"].shape == (1, 32, 64)
    assert params["moe_layers"]["dense"]["mlp"]["gate_proj"].shape == (2, 1, 32, 64)
    assert params["moe_layers"]["moe"]["mlp"]["gate_proj"].shape == (2, 4, 32, 16)
    assert params["moe_layers"]["moe"]["mlp"]["shared"]["up_proj"].shape == (2, 32, 16)
    logits, aux = nnx.jit(lambda m, t: m(t, return_aux=True))(
        _random_init(model, std=0.05), jnp.ones((2, 8), jnp.int32)
    )
    assert logits.shape == (2, 8, 64) and aux["expert_counts"].shape == (2, 4)
    np.testing.assert_array_equal(aux["expert_counts"].sum(-1), [2 * 8 * 2] * 2)
    counts = param_counts(cfg)
    assert counts["total"] == sum(x.size for x in jax.tree.leaves(params))
    # a token uses 2 of the 4 experts: each MoE block has 2 * 3 * 32 * 16 inactive weights
    assert counts["total"] - counts["active"] == 2 * 2 * 3 * 32 * 16
    dense = param_counts(dataclasses.replace(cfg, moe=MoEConfig()))
    assert flops_per_token(cfg, 8)["dense"] == 6 * (
        dense["matmul"] - 2 * 3 * 32 * 64 + 2 * (32 * 4 + 3 * 32 * 16 * 3)
    )  # two dense MLPs become routers + 2 routed + 1 shared expert of width 16
    # every MoE block is the same module as the dense one but for its feed-forward layer
    axes = jaxllm.model.logical_axes(nnx.state(model, nnx.Param))
    assert axes["moe_layers"]["moe"]["mlp"]["gate_proj"] == ("layers", "expert", "embed", "mlp")
    assert axes["moe_layers"]["dense"]["attn"]["q_proj"][:2] == ("layers", "layers")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.moe.num_experts=4", "model.moe.experts_per_token=5"], "experts_per_token"),
        (["model.moe.num_experts=4", "model.moe.first_dense_layers=1", "model.moe.moe_every=2"],
         "moe_every"),
        (["model.moe.num_experts=4", "model.moe.first_dense_layers=4"], "first_dense_layers"),
        (["model.moe.num_experts=4", "model.moe.capacity_factor=0"], "capacity_factor"),
        (["model.moe.num_experts=4", "model.moe.bias_update_rate=-1"], "bias_update_rate"),
        (["model.moe.num_experts=-1"], "num_experts"),
        (["model.moe.num_experts=6", "model.moe.num_groups=4"], "num_groups"),
        (["model.moe.num_experts=8", "model.moe.num_groups=4", "model.moe.groups_per_token=5"],
         "groups_per_token"),
        (["model.moe.num_experts=8", "model.moe.num_groups=4", "model.moe.experts_per_token=3"],
         "raise groups_per_token"),  # one group of 2 holds fewer than 3 experts
    ],
)  # fmt: skip
def test_moe_config_mistakes(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        config.load(None, overrides)


def test_experts_must_split_over_the_expert_axis():
    cfg = config.load(None, ["model.moe.num_experts=6", "mesh=expert"])
    with pytest.raises(ConfigError, match="mesh.expert"):
        cfg.validate(8)


# ------------------------------------------------------------------ training on a mesh


def _train_cfg(dispatch: str, **mesh) -> config.Config:
    moe = MoEConfig(num_experts=8, experts_per_token=2, dispatch=dispatch, capacity_factor=1.0,
                    num_shared_experts=1, first_dense_layers=1, bias_update_rate=0.01)  # fmt: skip
    return config.Config(
        model=tiny_model(vocab_size=258, num_layers=2, moe=moe),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=16),
        train=config.TrainConfig(global_batch_size=8, steps=2),
        # eps well above float32 noise: Adam would otherwise blow ~1e-9 gradient noise up to lr
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, devices, initial=None):
    """Two steps from `initial` (a host copy of a state; fresh init when None)."""
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    state = (
        init_state(cfg.model, tx, mesh, 0)
        if initial is None
        else jax.device_put(initial, shardings)
    )
    start = jax.device_get(state)
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state, metrics, start


@pytest.fixture(scope="module")
def single_device_runs():
    dropless = _train(_train_cfg("dropless"), jax.devices()[:1])
    initial = dropless[3]  # both modes have the same parameters: initialise once
    return {"dropless": dropless,
            "capacity": _train(_train_cfg("capacity"), jax.devices()[:1], initial)}  # fmt: skip


@pytest.mark.parametrize(
    "dispatch, mesh",
    [
        ("dropless", dict(expert=8)),
        ("capacity", dict(expert=8, expert_dispatch="annotations")),
        ("dropless", dict(expert=2, fsdp=2, tensor=2)),
        ("capacity", dict(expert=2, fsdp=2, tensor=2, expert_dispatch="all_to_all")),
    ],
    ids=["ep8-dropless", "ep8-capacity-annotations", "ep2_fsdp2_tp2-dropless",
         "ep2_fsdp2_tp2-capacity-all_to_all"],
)  # fmt: skip
def test_expert_parallel_training_matches_single_device(dispatch, mesh, single_device_runs):
    ref_losses, ref_state, ref_metrics, initial = single_device_runs[dispatch]
    cfg = _train_cfg(dispatch, **mesh)
    losses, state, metrics, _ = _train(cfg, jax.devices(), initial)
    # float32 end to end; only the order of cross-device sums differs
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)),
                    jax.tree.leaves(jax.device_get(ref_state.params))):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    bias, ref_bias = (jax.device_get(s.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
                      for s in (state, ref_state))  # fmt: skip
    np.testing.assert_allclose(bias, ref_bias, atol=1e-7)
    assert np.abs(bias).max() > 0
    for k in ("moe_load_cv", "moe_dropped_frac", "moe_aux_loss", "moe_router_z_loss"):
        assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=1e-7), k
    if dispatch == "capacity":
        assert float(metrics["moe_dropped_frac"]) > 0  # capacity factor 1: some are dropped
    # the experts really are split: each device holds E / ep of them (and its fsdp / tensor
    # slice), and so do their Adam moments
    ep, fsdp, tp = mesh["expert"], mesh.get("fsdp", 1), mesh.get("tensor", 1)
    gate = state.params["moe_layers"]["moe"]["mlp"]["gate_proj"]  # [1, E, D, F]
    assert gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (1, 8 // ep, 32 // fsdp, 64 // tp)
    mu = state.opt_state[1][0].mu["moe_layers"]["moe"]["mlp"]["gate_proj"]
    assert mu.sharding == gate.sharding
    down = state.params["moe_layers"]["moe"]["mlp"]["down_proj"]
    assert down.addressable_shards[0].data.shape == (1, 8 // ep, 64 // tp, 32 // fsdp)


# ------------------------------------------------------------------ balancing


def _balance_run(rate: float, steps: int = 300):
    """A tiny sigmoid-routed MoE layer learning a regression task on skewed inputs (one input
    feature is a constant that the router's initial weights turn into a strong preference
    for the first experts), by SGD on the task loss alone, with the balancing bias moved
    every step at `rate`. Returns the per-step coefficient of variation of the expert loads."""
    e, d = 8, 16
    moe = MoEConfig(num_experts=e, experts_per_token=2, router_score="sigmoid",
                    bias_update_rate=max(rate, 1e-9))  # fmt: skip
    layer = _layer(moe, d=d, f=16, seed=7)
    router = np.array(layer.router[...])
    router[0] = np.linspace(2.0, -2.0, e)  # feature 0 is always 1: expert 0 first, 7 last
    layer.router[...] = jnp.asarray(router)
    layer.router_bias[...] = jnp.zeros(e)
    graphdef, params, bias_state = nnx.split(layer, nnx.Param, ...)
    target = jnp.asarray(np.random.default_rng(8).normal(0, 0.5, (d, d)), jnp.float32)

    @jax.jit
    def run(params, bias_state):
        def step(carry, key):
            params, bias_state = carry
            x = jax.random.normal(key, (4, 32, d)).at[..., 0].set(1.0)

            def loss(p):
                out, stats = nnx.merge(graphdef, p, bias_state)(x)
                return jnp.mean(jnp.square(out - x @ target)), stats["expert_counts"]

            (_, counts), g = jax.value_and_grad(loss, has_aux=True)(params)
            params = jax.tree.map(lambda p, g: p - 0.05 * g, params, g)
            bias_state = update_router_bias(bias_state, counts, rate)
            return (params, bias_state), jnp.std(counts) / jnp.mean(counts)

        keys = jax.random.split(jax.random.key(0), steps)
        return jax.lax.scan(step, (params, bias_state), keys)[1]

    return np.asarray(run(params, nnx.to_pure_dict(bias_state)))


def test_bias_balancing_reduces_load_imbalance():
    unbalanced, balanced = _balance_run(0.0), _balance_run(0.01)
    assert unbalanced[-100:].mean() > 1.0  # most assignments on two or three experts
    assert balanced[-100:].mean() < 0.3 * unbalanced[-100:].mean()
    assert balanced[-100:].mean() < 0.3
    # it is the bias that does it: with the same start, both runs begin equally skewed
    assert balanced[0] == pytest.approx(unbalanced[0])


# ------------------------------------------------------------------ train step, checkpoints


@pytest.fixture(scope="module")
def one_step(single_device_runs):
    """The single-device dropless run: (config, host state before, state after 2 steps, the
    last step's metrics, a batch)."""
    _, after, metrics, start = single_device_runs["dropless"]
    cfg = _train_cfg("dropless")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    batch = to_global(synthetic_batch(cfg), sharding.named(mesh, ("batch", "length")))
    return cfg, start.model_state, after, metrics, batch


def test_train_step_logs_moe_metrics_and_moves_the_bias_outside_the_optimizer(one_step):
    cfg, before, after, metrics, batch = one_step
    for k in ("moe_load_min", "moe_load_max", "moe_load_cv", "moe_dropped_frac",
              "moe_aux_loss", "moe_router_z_loss"):  # fmt: skip
        assert np.isfinite(float(metrics[k])), k
    assert 0 < float(metrics["moe_load_min"]) <= 1 / 8 <= float(metrics["moe_load_max"])
    assert float(metrics["moe_dropped_frac"]) == 0.0  # dropless
    # the bias moved by +-rate per step (or 0 where an expert had exactly the mean load) ...
    path = ("moe_layers", "moe", "mlp", "router_bias")
    delta = (
        np.asarray(after.model_state[path[0]][path[1]][path[2]][path[3]])
        - (before[path[0]][path[1]][path[2]][path[3]])
    )
    assert set(np.round(np.abs(delta) / 0.01, 5).ravel()) <= {0.0, 1.0, 2.0}
    assert np.abs(delta).max() > 0
    # ... and is no parameter: not in params, no optimizer moments, no weight decay
    assert "router_bias" not in str(jax.tree_util.tree_structure(after.params))
    adam = after.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(after.params)


def test_aux_and_router_z_losses_reach_the_objective(one_step):
    cfg, before, after, _, batch = one_step
    params = jax.device_get(after.params)
    graphdef = jaxllm.train.abstract_model(cfg.model)[0]

    @jax.jit
    def objective(aux_w, z_w):  # the weights traced: one compile for all three
        moe = dataclasses.replace(cfg.model.moe, aux_loss_weight=aux_w, router_z_loss_weight=z_w)
        return loss_fn(params, batch, graphdef, model_state=after.model_state, moe=moe)

    base, (_, _, count, sums) = objective(0.0, 0.0)
    with_aux, _ = objective(0.5, 0.0)
    with_z, _ = objective(0.0, 0.25)
    assert float(sums["aux_loss"] / count) == pytest.approx(1.0, abs=0.2)  # near balanced
    assert float(with_aux - base) == pytest.approx(0.5 * float(sums["aux_loss"]), rel=1e-4)
    assert float(with_z - base) == pytest.approx(0.25 * float(sums["router_z_loss"]), rel=1e-4)


def test_checkpoint_round_trips_the_balancing_bias(one_step, tmp_path):
    cfg, _, after, _, _ = one_step
    cfg = dataclasses.replace(cfg, run=config.RunConfig(dir=str(tmp_path)))
    config.dump(cfg, tmp_path / "config.yaml")
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", cfg.checkpoint)
    ckpt.save(after, data_state={}, config={}, tokenizer={})
    ckpt.close()
    assert (tmp_path / "checkpoints" / "2" / "model_state").is_dir()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), after
    )
    restored, _, step = checkpoint.Checkpointer(tmp_path / "checkpoints", cfg.checkpoint
                                                ).restore_latest(abstract)  # fmt: skip
    assert step == 2
    bias = jax.device_get(after.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
    got = jax.device_get(restored.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
    np.testing.assert_array_equal(got, bias)
    # inference gets it too: the loaded model routes with the trained bias
    model = jaxllm.load_model(tmp_path)
    np.testing.assert_array_equal(nnx.state(model, RouterBias)["moe_layers"]["moe"]["mlp"]
                                  ["router_bias"][...], bias)  # fmt: skip


# ------------------------------------------------------------------ presets


def _jaxllm(*args, devices=1):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "jaxllm", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _train_preset(preset, run_dir, *extra):
    proc = _jaxllm(
        "train", f"model={preset}", f"run.dir={run_dir}", "train.steps=4", "train.log_every=1",
        "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0",
        "train.global_batch_size=8", "data.seq_len=64", "data.max_files=40", *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"moe_load_min", "moe_load_max", "moe_load_cv", "moe_dropped_frac",
                "moe_aux_loss", "moe_router_z_loss"} <= set(r)  # fmt: skip
    assert rows[-1]["loss"] < rows[0]["loss"]
    return rows, proc


@pytest.mark.slow  # a 30 s CLI run; the bias checkpoint round trip is tested in-process above
def test_tiny_deepseek_preset_trains_with_the_cli(tmp_path):
    rows, _ = _train_preset("tiny_deepseek", tmp_path / "run")
    cfg = config.load(tmp_path / "run" / "config.yaml")
    assert cfg.model.moe.router_score == "sigmoid" and cfg.model.moe.num_shared_experts == 1
    assert (tmp_path / "run" / "checkpoints" / "4" / "model_state").is_dir()


@pytest.mark.slow
def test_tiny_mixtral_preset_trains_with_the_cli(tmp_path):
    rows, _ = _train_preset("tiny_mixtral", tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints" / "4" / "model_state").exists()


def _plan_preset(preset, *overrides):
    from jaxllm.plan import plan

    cfg = config.load(None, [f"model={preset}", "mesh=expert", "model.remat=full",
                             "train.global_batch_size=8", "data.seq_len=256", *overrides])  # fmt: skip
    return plan(cfg, jax.devices())


def test_mixtral_8x7b_plans_on_an_expert_parallel_mesh():
    r = _plan_preset("mixtral_8x7b", "model.moe.dispatch=capacity")
    assert r["params"] == 46_702_792_704  # Mixtral-8x7B's published count
    assert r["mesh"]["expert"] == 8
    rows = {row["name"]: row for row in r["param_rows"]}
    gate = rows["moe_layers/moe/mlp/gate_proj"]
    assert tuple(gate["spec"]) == (None, "expert", "fsdp", "tensor")
    assert gate["bytes_per_device"] == 32 * 4096 * 14336 * 4  # one expert per device
    assert r["collectives"]["all-to-all"]["count"] > 0  # tokens travel to their experts
    assert param_counts(config.load(None, ["model=mixtral_8x7b"]).model)["active"] == (
        12_879_925_248
    )


@pytest.mark.slow
def test_qwen3_30b_a3b_plans_on_an_expert_parallel_mesh():
    r = _plan_preset("qwen3_30b_a3b")
    assert r["params"] == 30_532_110_336  # the published count less q/k-norm scales (12,288)
    rows = {row["name"]: row for row in r["param_rows"]}
    assert rows["moe_layers/moe/mlp/up_proj"]["shape"] == (48, 128, 2048, 768)
    # dropless: tokens gathered over `expert`, partial outputs reduce-scattered back
    assert r["collectives"]["reduce-scatter"]["count"] > 0


@pytest.mark.slow
def test_deepseek_v3_plans_on_an_expert_parallel_mesh():
    r = _plan_preset("deepseek_v3")
    assert r["params"] == 671_026_404_352  # the routing biases are model state, not counted
    rows = {row["name"]: row for row in r["param_rows"]}
    assert rows["moe_layers/moe/mlp/gate_proj"]["shape"] == (58, 256, 7168, 2048)
    assert rows["layers/attn/q_b_proj"]["shape"] == (3, 1536, 128, 192)
    assert r["mesh"]["expert"] == 8


def test_plan_does_not_count_collectives_over_single_devices():
    # shard_map leaves all-reduces over mesh axes of size 1 in the program: they move nothing
    from jaxllm.plan import collectives

    hlo = """
  %a = f32[8,64]{1,0} all-reduce(%x), replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %b = f32[8,64]{1,0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %c = f32[8,64]{1,0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %d = f32[8,64]{1,0} all-reduce(%x), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_1'}, to_apply=%add
  %e = f32[8,64]{1,0} all-to-all(%x), replica_groups=[8,1]<=[8], dimensions={0}
"""
    assert collectives(hlo) == {"all-reduce": {"count": 2, "bytes": 2 * 8 * 64 * 4}}
