"""W8A8 routed experts: a MoE layer whose routed and shared experts are W8A8 codes (int8 as
`--method smoothquant` stores them, E4M3 as `--method fp8 quantize.fp8_activations=true`)
computes, in every dispatch path (dropless ragged dots, capacity einsums; on one device, and
sharded over experts and hidden units by shard_map or by XLA), what a NumPy re-derivation
gives: each token's row quantized on its own scale, the integer (or E4M3) dot accumulated
exactly, rescaled by the row's scale times the expert's per-output-channel scale. The weight-only
computation of the routed experts (the float row times the decoded weight) is not that."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxllm import sharding
from jaxllm.config import MeshConfig, MoEConfig, PeftConfig
from jaxllm.model import coded, layers, lora, moe
from jaxllm.model import quantized_act as qa
from jaxllm.model import quantized_float as qf

D, F, E, K = 16, 24, 4, 2  # model width, expert width, experts, experts per token
NAMES = moe.EXPERT_WEIGHTS


def _coded_layer(dispatch: str, act: str, peft: PeftConfig | None = None):
    """A float32 MoE layer (one shared expert, capacity for every token; the adapters `peft`
    asks for, random) whose expert weights are coded as `act` ("int8" or "fp8")."""
    cfg = MoEConfig(
        num_experts=E,
        experts_per_token=K,
        num_shared_experts=1,
        dispatch=dispatch,
        capacity_factor=E / K,
    )
    f32 = dict(init_std=0.3, out_std=0.3, dtype=jnp.float32, param_dtype=jnp.float32)
    abstract = nnx.eval_shape(lambda: moe.MoE(D, F, cfg, **f32, rngs=nnx.Rngs(0)))
    if peft is not None:
        lora.attach(abstract, peft, jax.random.key(0))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), state)
    params = nnx.to_pure_dict(params)
    how = dict(kind="fp8" if act == "fp8" else "int8", act=act, threshold=6.0, n_in=1, n_out=1)
    for where in (params, params["shared"]):
        for name in NAMES:
            where[name] = coded.encode(where[name], **how)
    return nnx.merge(graphdef, params)


def _np_rows(x: np.ndarray, act: str):
    """Each row of float32 `x` on its own scale, as float64 codes and float32 scales."""
    amax = np.abs(x).max(-1, keepdims=True)
    top = np.float32(qf.FP8_MAX if act == "fp8" else qa.INT8_MAX)
    s = np.where(amax > 0, amax / top, np.float32(1.0)).astype(np.float32)
    if act == "fp8":
        return (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64), s
    return np.clip(np.round(x / s), -top, top).astype(np.float64), s


def _np_weight(t: coded.CodedTensor):
    """(codes as float64, float32 scales [..., out]) of a coded [.., in, out] weight."""
    codes = np.asarray(t.codes)
    if t.kind == "fp8":
        codes = codes.view(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float64), np.asarray(t.scales, np.float32)


def _np_matmul(x: np.ndarray, codes: np.ndarray, s_w: np.ndarray, act: str | None):
    """x [T, in] @ a coded [in, out] weight in float32: W8A8 (`act`: the row quantized, the
    dot exact in float64, then acc * (s_x * s_w) as the seam rounds) or weight-only (None)."""
    if act is None:
        return (x.astype(np.float64) @ (codes * s_w).astype(np.float32)).astype(np.float32)
    q, s_x = _np_rows(x, act)
    return (q @ codes).astype(np.float32) * (s_x * s_w[None, :])


def _np_swiglu(x, weights, act):
    gate, up, down = weights
    h = np.asarray(jax.nn.silu(_np_matmul(x, *gate, act))) * _np_matmul(x, *up, act)
    return _np_matmul(h, *down, act)


def _np_layer(layer: moe.MoE, x_BxLxD: np.ndarray, act: str, routed_act: str | None):
    """The layer's output re-derived in NumPy from its codes, with its own (JAX) routing: the
    shared expert in W8A8 as `act`, the routed ones as `routed_act` (None: weight-only)."""
    x_TxD = x_BxLxD.reshape(-1, D)
    r = moe.route(jnp.asarray(x_TxD @ np.asarray(layer.router[...]))[None], None, layer.cfg)
    expert_TxX, weight_TxX = (np.asarray(a)[0] for a in (r.expert_BxLxX, r.weight_BxLxX))
    stacks = [_np_weight(getattr(layer, n).get_value()) for n in NAMES]
    out = np.zeros(x_TxD.shape, np.float64)
    for t in range(x_TxD.shape[0]):
        for e, w in zip(expert_TxX[t], weight_TxX[t]):
            expert = [(codes[e], s[e]) for codes, s in stacks]
            out[t] += w * _np_swiglu(x_TxD[t : t + 1], expert, routed_act)[0]
    shared = [_np_weight(getattr(layer.shared, n).get_value()) for n in NAMES]
    return (out + _np_swiglu(x_TxD, shared, act)).reshape(x_BxLxD.shape)


def _run(layer: moe.MoE, x, mesh_axes: dict | None, expert_dispatch: str = "annotations"):
    if mesh_axes is None:
        return np.asarray(nnx.jit(lambda m, x: m(x).out)(layer, x))
    mesh_axes = dict(mesh_axes)
    dropless = mesh_axes.pop("dropless_dispatch", "all_gather")
    mesh = sharding.make_mesh(MeshConfig(data=1, **mesh_axes))
    parallel = sharding.Parallel(mesh, expert_dispatch=expert_dispatch, dropless_dispatch=dropless)
    with sharding.active(parallel):
        return np.asarray(nnx.jit(lambda m, x: m(x).out)(layer, x))


PATHS = {  # id -> (dispatch, mesh axes, capacity dispatch)
    "dropless": ("dropless", None, "annotations"),
    "capacity": ("capacity", None, "annotations"),
    # shard_map: experts over `expert`, hidden units over `tensor` (the down projection's
    # per-token scales then take their max over it)
    "dropless-expert4-tensor2": ("dropless", dict(expert=4, tensor=2), "annotations"),
    "dropless-ragged-expert4-tensor2": (
        "dropless",
        dict(expert=4, tensor=2, dropless_dispatch="ragged_all_to_all"),
        "annotations",
    ),
    "capacity-all_to_all-expert2-tensor2-fsdp2": (
        "capacity",
        dict(expert=2, tensor=2, fsdp=2),
        "all_to_all",
    ),
    "capacity-annotations-expert4-fsdp2": ("capacity", dict(expert=4, fsdp=2), "annotations"),
}


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("path", list(PATHS))
def test_routed_experts_compute_w8a8_in_every_dispatch_path(path, act):
    dispatch, mesh_axes, expert_dispatch = PATHS[path]
    layer = _coded_layer(dispatch, act)
    x = np.random.default_rng(1).normal(size=(8, 6, D)).astype(np.float32)
    x[..., 3] *= 8.0  # an outlier channel: per-token scales are then far from per-tensor ones
    got = _run(layer, jnp.asarray(x), mesh_axes, expert_dispatch)
    want = _np_layer(layer, x, act, act)
    tol = 2e-6 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=tol)
    # the routed experts' weight-only computation is far outside that tolerance
    weight_only = _np_layer(layer, x, act, None)
    assert np.abs(got - weight_only).max() > 100 * tol


def test_weight_only_llm_int8_and_adapted_experts_are_decoded():
    """W8A8 codes reach the dispatch as stored; weight-only codes (fp8, mxfp4), LLM.int8() and
    a W8A8 stack with an adapter (merged into the decoded weight) decoded."""
    layer = _coded_layer("dropless", "int8")
    assert all(coded.w8a8(moe.expert_weight(layer, n, jnp.float32)) for n in NAMES)
    adapted = _coded_layer("dropless", "int8", PeftConfig(method="lora", targets=("experts",)))
    got = moe.expert_weight(adapted, "up_proj", jnp.float32)
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(got, lora.dense(adapted, "up_proj", jnp.float32))
    w = jax.random.normal(jax.random.key(0), (E, 32, F))  # MXFP4 blocks of 32 inputs
    for kind, act in (("fp8", "none"), ("int8", "llm_int8"), ("mxfp4", "none")):
        t = coded.encode(w, kind=kind, act=act, threshold=6.0, n_in=1, n_out=1)
        layer.gate_proj.set_value(t)
        got = moe.expert_weight(layer, "gate_proj", jnp.float32)
        np.testing.assert_array_equal(got, coded.decode(t, jnp.float32))


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_ragged_matmul_is_per_expert_w8a8_and_passes_the_decoded_gradient(act):
    """`coded.ragged_matmul` is each group's seam matmul (`coded.matmul`) against its expert's
    codes, rows past the groups give zeros, and the gradient in x is the decoded weights'."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(0, 0.1, (E, D, F)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(11, D)), jnp.float32)
    sizes = jnp.asarray([3, 0, 5, 2], jnp.int32)  # an empty group; one row past the groups
    kind = "fp8" if act == "fp8" else "int8"
    t = coded.encode(w, kind=kind, act=act, threshold=6.0, n_in=1, n_out=1)
    got = layers.ragged_matmul(x, t, sizes, jnp.float32)
    start = np.cumsum([0, *np.asarray(sizes)])
    for e in range(E):
        rows = x[start[e] : start[e + 1]]
        one = jax.tree.map(lambda a: a[e], t)
        want = layers.matmul("td,df->tf", rows, one, jnp.float32)
        np.testing.assert_allclose(got[start[e] : start[e + 1]], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[start[-1] :], 0.0)
    deq = coded.decode(t, jnp.float32)
    loss = lambda x, f: jnp.sum(jnp.sin(f(x)))  # noqa: E731
    g = jax.grad(loss)(x, lambda x: layers.ragged_matmul(x, t, sizes, jnp.float32))
    y = layers.ragged_matmul(x, t, sizes, jnp.float32)
    want = jax.vjp(lambda x: jax.lax.ragged_dot(x, deq, sizes), x)[1](jnp.cos(y))[0]
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
