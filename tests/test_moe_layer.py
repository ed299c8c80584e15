"""The mixture-of-experts layer: against a dense every-expert reference (forward and gradients,
both dispatch modes), capacity dropping, layer layouts with their parameter and FLOP counts, and
auxiliary-loss-free balancing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

import jaxllm
from jaxllm.config import MoEConfig
from jaxllm.metrics import flops_per_token, param_counts
from jaxllm.model import build
from jaxllm.model.moe import (
    MoE,
    capacity,
    combine_weights,
    route,
    update_router_bias,
)
from jaxllm.model.moe_reference import dense_reference


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
        lambda: MoE(
            d,
            f,
            moe,
            init_std=0.3,
            out_std=0.3,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            rngs=nnx.Rngs(0),
        )
    )
    return _random_init(abstract, seed)


def _reference(layer: MoE, x_BxLxD, keep_BxLxX=None):
    """Every expert on every token, weighted by the layer's own routing (and the shared
    experts); `keep_BxLxX` zeroes dropped assignments."""
    cfg = layer.cfg
    logits = jnp.einsum("bld,de->ble", x_BxLxD, layer.router[...])
    bias = None if layer.router_bias is None else layer.router_bias[...]
    r = route(logits, bias, cfg)
    combine_BxLxE = combine_weights(r, cfg.num_experts, keep_BxLxX)
    out = dense_reference(
        x_BxLxD,
        combine_BxLxE,
        layer.gate_proj[...],
        layer.up_proj[...],
        layer.down_proj[...],
        jnp.float32,
    )
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
    "softmax_top1_unnormalized": MoEConfig(
        num_experts=4, experts_per_token=1, normalize_top_k=False
    ),
    "sigmoid_shared_bias": MoEConfig(
        num_experts=8,
        experts_per_token=3,
        router_score="sigmoid",
        num_shared_experts=2,
        route_scale=2.5,
        bias_update_rate=0.1,
    ),
    "sigmoid_groups_frozen_bias": MoEConfig(
        num_experts=8,
        experts_per_token=2,
        router_score="sigmoid",
        num_shared_experts=1,
        route_scale=2.5,
        num_groups=4,
        groups_per_token=2,
        router_bias=True,
    ),
}


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_layer_equals_dense_reference_forward_and_gradients(router, dispatch):
    # capacity_factor = E / k gives C = L slots: room for every token, so nothing is dropped
    moe = ROUTERS[router]
    moe = dataclasses.replace(
        moe, dispatch=dispatch, capacity_factor=moe.num_experts / moe.experts_per_token
    )
    layer = _layer(moe)
    rng = np.random.default_rng(1)
    x, cot = (jnp.asarray(rng.normal(size=(3, 10, 16)), jnp.float32) for _ in range(2))
    out, grads = _value_and_grads(lambda m, x: m(x).out, layer, x, cot)
    ref_out, ref_grads = _value_and_grads(_reference, layer, x, cot)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    assert float(nnx.jit(lambda m, x: m(x).stats["dropped"])(layer, x)) == 0.0
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


def test_layer_layouts_param_counts_and_flops():
    moe = MoEConfig(
        num_experts=4,
        experts_per_token=2,
        first_dense_layers=1,
        moe_every=2,
        num_shared_experts=1,
        expert_mlp_dim=16,
    )
    cfg = tiny_model(num_layers=5, moe=moe)
    model = nnx.eval_shape(lambda: build(cfg))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # 1 leading dense block, then 2 x (dense, MoE)
    assert params["layers"]["mlp"]["gate_proj"].shape == (1, 32, 64)
    assert params["moe_layers"]["dense"]["mlp"]["gate_proj"].shape == (2, 1, 32, 64)
    assert params["moe_layers"]["moe"]["mlp"]["gate_proj"].shape == (2, 4, 32, 16)
    assert params["moe_layers"]["moe"]["mlp"]["shared"]["up_proj"].shape == (2, 32, 16)
    out = nnx.jit(lambda m, t: m(t))(_random_init(model, std=0.05), jnp.ones((2, 8), jnp.int32))
    logits, aux = out.logits, out.aux
    assert out.cache is None and out.values is None
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


# ------------------------------------------------------------------ balancing


def _balance_run(rate: float, steps: int = 300):
    """A tiny sigmoid-routed MoE layer learning a regression task on skewed inputs (one input
    feature is a constant that the router's initial weights turn into a strong preference
    for the first experts), by SGD on the task loss alone, with the balancing bias moved
    every step at `rate`. Returns the per-step coefficient of variation of the expert loads."""
    e, d = 8, 16
    moe = MoEConfig(
        num_experts=e, experts_per_token=2, router_score="sigmoid", bias_update_rate=max(rate, 1e-9)
    )
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
