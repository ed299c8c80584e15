"""FP8 matmuls (`model.matmul_dtype=float8`): closeness to bfloat16 forward and backward, the
e5m2 rounding of output gradients, f8 dots in the CUDA lowering, and config errors.

Tolerances (relative L2 error against the same model in bfloat16): e4m3 keeps 3 mantissa bits
(rounding <= 2^-4 of a value) and e5m2 keeps 2 (<= 2^-3). One fp8 matmul is measured at ~3%
(forward) and ~6% (gradients); the tiny model's logits at ~6% (MoE ~11%: a perturbed router
logit can flip an expert choice) and its parameter gradients at 7-16%, as errors of several
matmuls and of the e5m2 gradients of two layers add up. The bounds leave room over these
measured values; a lost cast gives 0, a doubled or unscaled one gives far more."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lowering import lower

from jaxllm import config
from jaxllm.config import ConfigError, MLAConfig, MoEConfig
from jaxllm.model import build, layers
from jaxllm.model.fp8 import E5M2, quantize

REPO = Path(__file__).resolve().parent.parent
MOE = MoEConfig(num_experts=4, experts_per_token=2)
VARIANTS = {
    "dense": {},
    "mla": dict(
        mla=MLAConfig(
            kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
        )
    ),
    "moe_dropless": dict(moe=dataclasses.replace(MOE, dispatch="dropless")),
    "moe_capacity": dict(moe=dataclasses.replace(MOE, dispatch="capacity", capacity_factor=2.0)),
}


def _relerr(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _pair(**overrides):
    """The same tiny model (same seed, same weights) with bfloat16 and with fp8 matmuls."""
    cfg = tiny_model(dtype="bfloat16", init_std=0.1, **overrides)
    fp8 = dataclasses.replace(cfg, matmul_dtype="float8")
    return build(cfg, seed=0), build(fp8, seed=0)


def _tokens(b=2, l=16):
    return jax.random.randint(jax.random.key(1), (b, l), 0, 64)


def _jit(fn, model):
    """`fn(model)` compiled once (eager NNX calls are slow)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s: fn(nnx.merge(graphdef, s)))(state)


def _loss(model, tokens):
    logits = model(tokens[:, :-1]).logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@pytest.mark.parametrize(
    "variant",
    # MLA's projections are the dense model's matmuls with other shapes: ~15 s, -m slow
    [pytest.param(v, marks=pytest.mark.slow) if v == "mla" else v for v in VARIANTS],
)
def test_fp8_model_output_close_to_bf16(variant):
    bf16, fp8 = _pair(**VARIANTS[variant])
    tokens = _tokens()
    ref, out = (_jit(lambda m: m(tokens).logits, m) for m in (bf16, fp8))
    err = _relerr(out, ref)
    assert 0 < err < (0.2 if variant.startswith("moe") else 0.1), err  # 0: fp8 not taken


def test_fp8_model_gradients_close_to_bf16():
    bf16, fp8 = _pair()
    tokens = _tokens()

    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p: _loss(nnx.merge(graphdef, p, rest), tokens)  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    ref, got = nnx.to_flat_state(grads(bf16)), dict(nnx.to_flat_state(grads(fp8)))
    for path, g_ref in ref:
        g = got[path][...]
        assert np.all(np.isfinite(g)), path
        assert _relerr(g, g_ref[...]) < 0.25, (path, _relerr(g, g_ref[...]))


@pytest.mark.parametrize("kind", ["einsum", "ragged"])
def test_fp8_matmul_gradients_close_to_bf16(kind):
    """Both operands' gradients of one fp8 matmul (the MoE grouped one included)."""
    x_AxD = jax.random.normal(jax.random.key(2), (16, 32))
    w_ExDxF = jax.random.normal(jax.random.key(3), (2, 32, 8)) * 0.02
    sizes_E = jnp.array([5, 11], jnp.int32)

    def f(x, w, fp8):
        if kind == "ragged":
            y = layers.ragged_matmul(x, w, sizes_E, jnp.bfloat16, fp8=fp8)
        else:
            y = layers.matmul("ad,edf->eaf", x, w, jnp.bfloat16, fp8=fp8)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    ref = jax.grad(f, argnums=(0, 1))(x_AxD, w_ExDxF, False)
    got = jax.grad(f, argnums=(0, 1))(x_AxD, w_ExDxF, True)
    for g, g_ref in zip(got, ref, strict=True):
        assert g.dtype == g_ref.dtype and 0 < _relerr(g, g_ref) < 0.1


def test_fp8_grouped_gradients_under_shard_map_sum_over_the_mesh():
    """Dropless experts run the grouped matmul per device under shard_map, the rows split over
    `data` and the kernel's hidden units over `tensor`: the kernel's gradient sums every data
    shard's, the rows' every tensor shard's, as they do without fp8."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    x_AxD = jax.random.normal(jax.random.key(2), (32, 16))
    w_ExDxF = jax.random.normal(jax.random.key(3), (2, 16, 8)) * 0.1
    sizes_NxE = jnp.array([[3, 5], [8, 0], [1, 7], [4, 4]], jnp.int32)  # per data shard
    rows, per_row = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, None, "tensor"))
    x_AxD, sizes_NxE = jax.device_put(x_AxD, rows), jax.device_put(sizes_NxE, rows)
    w_ExDxF = jax.device_put(w_ExDxF, per_row)

    def f(x, w, fp8):
        local = lambda x, w, s: layers.ragged_matmul(x, w, s[0], jnp.float32, fp8=fp8)  # noqa: E731
        y = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("data"), P(None, None, "tensor"), P("data")),
            out_specs=P("data", "tensor"),
        )(x, w, sizes_NxE)
        return jnp.sum(jnp.sin(y))

    grads = jax.jit(jax.grad(f, argnums=(0, 1)), static_argnums=2)
    ref, got = grads(x_AxD, w_ExDxF, None), grads(x_AxD, w_ExDxF, "current")
    for g, g_ref in zip(got, ref, strict=True):
        assert 0 < _relerr(g, g_ref) < 0.1  # a missing sum: 1/2 or 1/4 of it, far off


def test_fp8_input_gradient_is_the_e5m2_output_gradient():
    """Through an identity kernel (exact in e4m3) the input gradient is the output gradient
    rounded to e5m2 at its power-of-two scale, and not the bfloat16 one."""
    x_LxD = jax.random.normal(jax.random.key(0), (8, 16))
    g_LxD = jax.random.normal(jax.random.key(1), (8, 16))

    def f(x):
        y = layers.matmul("ld,df->lf", x, jnp.eye(16), jnp.float32, fp8="current")
        return jnp.sum(y * g_LxD)

    q, scale = quantize(g_LxD, E5M2)
    assert q.dtype == E5M2
    dx = jax.grad(f)(x_LxD)
    np.testing.assert_array_equal(dx, q.astype(jnp.float32) * scale)
    assert not np.array_equal(dx, g_LxD)


def test_fp8_grouped_kernel_gradient_is_a_ragged_f8_dot():
    """The MoE experts' kernel gradient: per group, x^T g on the e4m3 inputs and the e5m2
    output gradient, accumulated in float32 (and lowered as a ragged dot of f8 operands)."""
    x_AxD = jax.random.normal(jax.random.key(4), (12, 16))
    w_ExDxF = jax.random.normal(jax.random.key(5), (3, 16, 8)) * 0.1
    g_AxF = jax.random.normal(jax.random.key(6), (12, 8))
    sizes_E = jnp.array([5, 0, 7], jnp.int32)

    def f(x, w):
        y = layers.ragged_matmul(x, w, sizes_E, jnp.float32, fp8="current")
        return jnp.sum(y * g_AxF)

    qx, sx = quantize(x_AxD, jnp.float8_e4m3fn)
    qg, sg = quantize(g_AxF, E5M2)
    qx, qg = np.asarray(qx.astype(jnp.float32)), np.asarray(qg.astype(jnp.float32))
    bounds = np.cumsum([0, *np.asarray(sizes_E)])
    want = np.stack([qx[a:b].T @ qg[a:b] for a, b in zip(bounds[:-1], bounds[1:])]) * (sx * sg)
    dw = jax.grad(f, argnums=1)(x_AxD, w_ExDxF)
    np.testing.assert_allclose(dw, want, rtol=1e-5, atol=1e-6)
    step = jax.value_and_grad(f, argnums=(0, 1))
    hlo = lower(step, x_AxD, w_ExDxF, platform="cuda").as_text()
    ragged = [ln for ln in hlo.splitlines() if "ragged_dot" in ln and "->" in ln]
    assert len(ragged) == 3, hlo  # forward, input gradient, kernel gradient
    assert all("f8E" in ln.split("->")[0] and "xf32>" in ln.split("->")[-1] for ln in ragged)


def test_quantize_uses_the_fp8_range_without_overflow():
    x = jnp.array([3e-3, -1.7e-3, 2.5e-4, 0.0])
    for fp8_dtype in (jnp.float8_e4m3fn, E5M2):
        q, scale = quantize(x, fp8_dtype)
        top = float(jnp.finfo(fp8_dtype).max)
        assert top / 2 < float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= top
        assert float(jnp.log2(scale)) == int(jnp.log2(scale))  # a power of two: exact rescale
    q, _ = quantize(jnp.zeros(4), jnp.float8_e4m3fn)
    assert np.all(q.astype(jnp.float32) == 0)


def _dots(hlo: str, dtype: str) -> list[str]:
    """Lines of `hlo` with a dot whose operand types include `dtype` (as StableHLO spells it)."""
    return [ln for ln in hlo.splitlines() if re.search(r"dot_general|\bdot\b", ln) and dtype in ln]


def test_fp8_train_step_lowers_to_f8_dots_for_cuda():
    _, model = _pair()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = _tokens()

    def step(p):  # forward and backward, as in the train step
        return jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p, rest), tokens))(p)

    hlo = lower(step, params, platform="cuda").as_text()
    fwd = [ln for ln in _dots(hlo, "f8E4M3FN") if ln.count("f8E4M3FN") >= 2]
    bwd = _dots(hlo, "f8E5M2")
    # per layer: q, k, v, o, gate, up, down forward; two backward dots each
    assert len(fwd) >= 7, hlo
    assert len(bwd) >= 14, hlo
    assert all("xf32>" in ln.split("->")[-1] for ln in fwd + bwd)  # float32 accumulation


def test_bf16_default_lowers_without_f8():
    bf16, _ = _pair()
    graphdef, params, rest = nnx.split(bf16, nnx.Param, ...)
    hlo = lower(lambda p: nnx.merge(graphdef, p, rest)(_tokens()).logits, params, platform="cuda")
    assert "f8E4M3FN" not in hlo.as_text()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.matmul_dtype=int8"], "model.matmul_dtype must be null"),
        (["model.matmul_dtype=float32"], "model.matmul_dtype must be null"),
        (["model.dtype=float32", "model.matmul_dtype=bfloat16"], "model.dtype=float32"),
    ],
)
def test_matmul_dtype_errors_are_one_line(overrides, message, monkeypatch):
    monkeypatch.chdir(REPO)  # the default run's presets are found under ./configs
    with pytest.raises(ConfigError) as e:
        config.load(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_matmul_dtype_accepts_float8_and_the_compute_dtype(monkeypatch):
    monkeypatch.chdir(REPO)
    assert config.load(None, ["model.matmul_dtype=float8"]).model.fp8
    cfg = config.load(None, ["model.matmul_dtype=bfloat16"]).model
    assert not cfg.fp8 and cfg.dtype == "bfloat16"
