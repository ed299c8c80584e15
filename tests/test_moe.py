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
    np.testing.assert_array_equal(stats["expert_counts"], np.bincount(r.expert_BxLxX.ravel(), minlength=4))


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
    ],
)  # fmt: skip
def test_moe_config_mistakes(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        config.load(None, overrides)


def test_experts_must_split_over_the_expert_axis():
    cfg = config.load(None, ["model.moe.num_experts=6", "mesh=expert"])
    with pytest.raises(ConfigError, match="mesh.expert"):
        cfg.validate(8)
