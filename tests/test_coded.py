"""The float and weight-activation kinds of `jaxllm quantize` (`jaxllm.model.coded`): their
codes are those of the tested numerical cores (`quantized_float`, `quantized_act`, checked
against ml_dtypes / NumPy in test_quantize_kinds.py) on weights of any layout; the seam's W8A8,
W8A8-FP8 and LLM.int8() matmuls over general einsum specs equal the cores' 2-D matmuls;
SmoothQuant's scales are the core's `smooth`; the sizes are what each kind promises."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.compress import smoothquant
from jaxllm.model import coded, layers
from jaxllm.model import quantized_act as qa
from jaxllm.model import quantized_float as qf

SHAPES = {  # name -> (shape, contracted dims, output dims, matmul spec, x shape)
    "mlp": ((64, 96), 1, 1, "bld,df->blf", (2, 3, 64)),
    "q_proj": ((64, 4, 16), 1, 2, "bld,dhk->blhk", (2, 3, 64)),
    "o_proj": ((4, 16, 32), 2, 1, "blhk,hkd->bld", (2, 3, 4, 16)),
    "experts": ((3, 64, 32), 1, 1, None, None),
}


def _matrix(w, n_in, n_out):
    lead = w.ndim - n_in - n_out
    k = math.prod(w.shape[lead : lead + n_in])
    return w.reshape(*w.shape[:lead], k, -1)


@pytest.mark.parametrize("kind", ["fp8", "mxfp4", "int8"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_codes_are_the_cores_on_any_layout(kind, name):
    shape, n_in, n_out, _, _ = SHAPES[name]
    w = jax.random.normal(jax.random.key(0), shape) * 0.05
    t = coded.encode(w, kind=kind, act="none", threshold=6.0, n_in=n_in, n_out=n_out)
    assert t.shape == shape
    core = {
        "fp8": lambda m: qf.fp8_dequantize(*qf.fp8_quantize(m)),
        "mxfp4": lambda m: qf.mxfp4_dequantize(*qf.mxfp4_quantize(m)),
        "int8": lambda m: (lambda q, s: q.astype(jnp.float32) * s)(*qa.int8_quantize(m)),
    }[kind]
    m = _matrix(w, n_in, n_out)
    want = jax.vmap(core)(m) if m.ndim == 3 else core(m)
    np.testing.assert_array_equal(coded.decode(t, jnp.float32), want.reshape(shape))
    per_weight = {"fp8": 8, "mxfp4": 4, "int8": 8}[kind]
    assert t.codes.nbytes * 8 == w.size * per_weight
    n = math.prod(shape[len(shape) - n_out :])
    lead = math.prod(shape[: len(shape) - n_in - n_out])
    k = w.size // n // lead
    scale_bytes = lead * n * (k // 32 if kind == "mxfp4" else 4)
    assert t.scales.nbytes == scale_bytes
    ax = coded.axes(t, ("a", "b", "c")[: len(shape)])
    assert len(ax.codes) == t.codes.ndim and len(ax.scales) == t.scales.ndim


@pytest.mark.parametrize("act", ["int8", "fp8", "llm_int8"])
@pytest.mark.parametrize("name", ["mlp", "q_proj", "o_proj"])
def test_seam_matmul_is_the_cores(act, name):
    shape, n_in, n_out, spec, x_shape = SHAPES[name]
    w = jax.random.normal(jax.random.key(1), shape) * 0.05
    x = jax.random.normal(jax.random.key(2), x_shape)
    x = x.at[..., 0].multiply(10.0)  # an outlier feature for LLM.int8()
    kind = "fp8" if act == "fp8" else "int8"
    t = coded.encode(w, kind=kind, act=act, threshold=6.0, n_in=n_in, n_out=n_out)
    got = layers.matmul(spec, x, t, jnp.float32)
    k = math.prod(shape[:n_in])
    x2 = x.reshape(*x_shape[: len(x_shape) - n_in], k)
    if act == "fp8":
        q, s = qf.fp8_quantize(w.reshape(k, -1))
        want = qf.fp8_act_matmul(x2, q, s, jnp.float32)
    else:
        q, s = qa.int8_quantize(w.reshape(k, -1))
        if act == "int8":
            want = qa.w8a8_matmul(x2, q, s, jnp.float32)
        else:
            want = qa.llm_int8_matmul(x2, q, s, 6.0, jnp.float32)
    want = want.reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    exact = jnp.einsum(spec, x, w)
    assert float(jnp.max(jnp.abs(got - exact))) < 0.05 * float(jnp.max(jnp.abs(exact)))


def test_smoothquant_scales_are_the_cores():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(0, 0.05, (32, n)), jnp.float32) for n in (16, 8)]
    act = jnp.asarray(rng.uniform(0.1, 20, 32), jnp.float32)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, 32), jnp.float32)
    s = smoothquant.scales(act, ws, 0.5)
    smoothed, norm_s = qa.smooth(ws, act, norm, 0.5)
    np.testing.assert_allclose(norm / s, norm_s, rtol=1e-6)
    for w, want in zip(ws, smoothed):
        np.testing.assert_allclose(w * s[:, None], want, rtol=1e-6)


@pytest.mark.parametrize("act", ["int8", "fp8", "llm_int8"])
def test_w8a8_passes_the_decoded_weights_gradient(act):
    """The activations' gradient through a W8A8 matmul is that of the decoded weight (straight
    through the rounding), so LoRA trains on such a base."""
    shape, n_in, n_out, spec, x_shape = SHAPES["o_proj"]
    w = jax.random.normal(jax.random.key(1), shape) * 0.05
    x = jax.random.normal(jax.random.key(2), x_shape)
    kind = "fp8" if act == "fp8" else "int8"
    t = coded.encode(w, kind=kind, act=act, threshold=6.0, n_in=n_in, n_out=n_out)
    got = jax.grad(lambda x: jnp.sum(jnp.sin(layers.matmul(spec, x, t, jnp.float32))))(x)
    deq = coded.decode(t, jnp.float32)
    y = layers.matmul(spec, x, t, jnp.float32)
    want = jax.vjp(lambda x: jnp.einsum(spec, x, deq), x)[1](jnp.cos(y))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
