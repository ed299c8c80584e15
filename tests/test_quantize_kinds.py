"""FP8 and MXFP4 weight codes (jaxllm/model/quantized_float.py) against NumPy re-derivations
of the FP8 cast and the OCP MX rules; the W8A8 and LLM.int8() matmuls and SmoothQuant's
smoothing (jaxllm/model/quantized_act.py) against NumPy references of the same operands."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.model import quantized_act as qa
from jaxllm.model import quantized_float as qf


def _w(k=64, n=8, seed=0):
    return np.random.default_rng(seed).normal(size=(k, n)).astype(np.float32)


def test_fp8_codes_match_ml_dtypes_cast():
    w = _w()
    w[:, 3] = 0.0
    q, s = qf.fp8_quantize(jnp.asarray(w))
    amax = np.abs(w).max(0)
    s_ref = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=2e-7)  # XLA: amax * (1 / 448)
    s_ref = np.asarray(s)
    q_ref = (w / s_ref).astype(ml_dtypes.float8_e4m3fn)
    assert q.dtype == jnp.float8_e4m3fn
    assert (np.asarray(q).view(np.uint8) == q_ref.view(np.uint8)).all()
    assert np.abs(np.asarray(q, np.float32)).max() == 448.0
    back = np.asarray(qf.fp8_dequantize(q, s))
    np.testing.assert_allclose(back, q_ref.astype(np.float32) * s_ref, rtol=1e-6)
    assert np.abs(back - w).max() <= amax.max() / 448.0 * 32  # E4M3: 3 mantissa bits


def _e2m1_ref(v):
    """Nearest E2M1 grid index of |v|, ties to the even index, saturating: by distances."""
    a = np.minimum(np.abs(v), 6.0)
    d = np.abs(a[..., None] - qf.E2M1_GRID)
    best = d.min(-1, keepdims=True)
    tied = np.isclose(d, best, rtol=0, atol=1e-12)
    even = tied & (np.arange(8) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))


def test_e2m1_rounding_ties_to_even_and_saturates():
    v = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 7.0, 100.0, -2.5, -0.2])
    idx = np.asarray(qf.e2m1_index(jnp.asarray(v, jnp.float32)))
    assert list(idx) == [0, 2, 2, 4, 4, 6, 6, 1, 7, 7, 7, 4, 0]
    r = np.random.default_rng(1).uniform(-8, 8, 4096).astype(np.float32)
    assert (np.asarray(qf.e2m1_index(jnp.asarray(r))) == _e2m1_ref(r)).all()


def test_mxfp4_known_bit_patterns():
    w = np.zeros((64, 2), np.float32)
    w[:4, 0] = [6.0, -0.5, 1.5, -6.0]  # absmax 6: e = floor(log2 6) - 2 = 0, byte 127
    w[32:36, 0] = [0.75, 3.0, 24.0, -1.0]  # absmax 24: e = 4 - 2 = 2, X = 4
    codes, scales = qf.mxfp4_quantize(jnp.asarray(w))
    codes, scales = np.asarray(codes), np.asarray(scales)
    assert codes.shape == (32, 2) and scales.shape == (2, 2)
    assert list(scales[:, 0]) == [127, 129]
    assert list(scales[:, 1]) == [0, 0]  # all-zero blocks: e = -127
    # 6 -> 0b0111, -0.5 -> 0b1001; 1.5 -> 0b0011, -6 -> 0b1111 (first code low nibble)
    assert codes[0, 0] == 0x97 and codes[1, 0] == 0xF3
    # 0.75/4 = 0.1875 -> 0 (below 0.25); 3/4 = 0.75 -> tie 0.5|1 -> 1 (0b0010); 24/4 = 6 -> 0b0111;
    # -1/4 = -0.25 -> tie 0|0.5 -> -0 (0b1000)
    assert codes[16, 0] == 0x20 and codes[17, 0] == 0x87
    back = np.asarray(qf.mxfp4_dequantize(jnp.asarray(codes), jnp.asarray(scales)))
    assert list(back[:4, 0]) == [6.0, -0.5, 1.5, -6.0]
    assert list(back[32:36, 0]) == [0.0, 4.0, 24.0, 0.0]


def _mxfp4_ref(w):
    k, n = w.shape
    b = w.reshape(k // 32, 32, n)
    amax = np.abs(b).max(1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    x = np.exp2(e)[:, None, :]
    v = b / x
    mag = qf.E2M1_GRID[_e2m1_ref(v)]
    return (np.where(v < 0, -mag, mag) * x).reshape(k, n), (e + 127).astype(np.uint8)


def test_mxfp4_random_matches_reference_and_bits():
    w = _w(k=128, n=16, seed=2) * np.exp2(np.random.default_rng(3).integers(-6, 6, (1, 16)))
    codes, scales = qf.mxfp4_quantize(jnp.asarray(w))
    ref, s_ref = _mxfp4_ref(w)
    assert (np.asarray(scales) == s_ref).all()
    back = np.asarray(qf.mxfp4_dequantize(codes, scales))
    np.testing.assert_array_equal(back, ref.astype(np.float32))
    bits = 8 * (codes.size * codes.dtype.itemsize + scales.size) / w.size
    assert math.isclose(bits, 4.25)


def test_fp8_act_matmul_is_the_float32_dot_of_the_e4m3_operands():
    w, x = _w(64, 16, seed=9), np.random.default_rng(10).normal(size=(3, 4, 64)).astype(np.float32)
    x[0, 0] = 0.0
    q_w, s_w = qf.fp8_quantize(jnp.asarray(w))
    y = np.asarray(qf.fp8_act_matmul(jnp.asarray(x), q_w, s_w))
    amax = np.abs(x).max(-1, keepdims=True)
    s_x = np.where(amax > 0, amax / np.float32(448.0), 1.0).astype(np.float32)
    q_x = (x / s_x).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ref = (q_x @ np.asarray(q_w).astype(np.float64)) * s_x * np.asarray(s_w)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    assert (y[0, 0] == 0).all()
    assert np.abs(y - x @ w).max() < 0.1 * np.abs(x @ w).max()


# W8A8 / LLM.int8() / SmoothQuant (jaxllm/model/quantized_act.py)


def _int8_ref(a, axis):
    amax = np.abs(a).max(axis, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127.0), 1.0).astype(np.float32)
    return np.clip(np.round(a / s), -127, 127).astype(np.int8), s


def test_w8a8_matmul_is_the_int32_dot_of_the_same_codes():
    w, x = _w(64, 16, seed=4), _w(6, 64, seed=5) * 3
    q_w, s_w = qa.int8_quantize(jnp.asarray(w))
    qr, sr = _int8_ref(w, 0)
    assert (np.asarray(q_w) == qr).all()
    np.testing.assert_allclose(np.asarray(s_w), sr, rtol=2e-7)
    y = np.asarray(qa.w8a8_matmul(jnp.asarray(x), q_w, s_w))
    q_x, s_x = (np.asarray(a) for a in qa.int8_quantize(jnp.asarray(x), axis=-1))
    assert (np.abs(q_x.astype(np.int32) - _int8_ref(x, -1)[0]) <= 1).all()
    acc = q_x.astype(np.int32) @ np.asarray(q_w).astype(np.int32)
    np.testing.assert_array_equal(y, acc.astype(np.float32) * s_x * np.asarray(s_w))
    assert np.abs(y - x @ w).max() < 0.05 * np.abs(x @ w).max()


def test_llm_int8_outlier_features_go_through_16_bits():
    w, x = _w(64, 16, seed=6), np.random.default_rng(7).normal(size=(2, 5, 64)).astype(np.float32)
    x[1, 3, [5, 40]] = [60.0, -9.0]  # two outlier features, one token each
    q_w, s_w = qa.int8_quantize(jnp.asarray(w))
    y = np.asarray(qa.llm_int8_matmul(jnp.asarray(x), q_w, s_w, threshold=6.0))
    m = np.zeros(64, bool)
    m[[5, 40]] = True
    w_dq = np.asarray(q_w).astype(np.float32) * np.asarray(s_w)
    reg = np.asarray(qa.w8a8_matmul(jnp.asarray(np.where(m, 0, x)), q_w, s_w))
    np.testing.assert_allclose(y, reg + np.where(m, x, 0) @ w_dq, rtol=1e-5, atol=1e-5)
    plain = np.asarray(qa.w8a8_matmul(jnp.asarray(x), q_w, s_w))
    ref = x @ w
    assert np.abs(y - ref).max() < 0.5 * np.abs(plain - ref).max()  # the outliers hurt int8


def test_smooth_matches_numpy_and_keeps_the_product():
    rng = np.random.default_rng(8)
    ws = [rng.normal(size=(32, n)).astype(np.float32) for n in (16, 8)]
    x = rng.normal(size=(10, 32)).astype(np.float32) * np.exp2(rng.integers(-3, 5, 32))
    g = rng.uniform(0.5, 1.5, 32).astype(np.float32)
    amax = np.abs(x * g).max(0)
    out, g2 = qa.smooth([jnp.asarray(w) for w in ws], jnp.asarray(amax), jnp.asarray(g), 0.5)
    wmax = np.maximum(np.abs(ws[0]).max(1), np.abs(ws[1]).max(1))
    s = np.sqrt(amax) / np.sqrt(wmax)
    np.testing.assert_allclose(np.asarray(g2), g / s, rtol=1e-5)
    for w, o in zip(ws, out):
        np.testing.assert_allclose(np.asarray(o), w * s[:, None], rtol=1e-5)
        np.testing.assert_allclose(
            (x * np.asarray(g2)) @ np.asarray(o), (x * g) @ w, rtol=1e-4, atol=1e-4
        )
    smoothed_amax = np.abs(x * np.asarray(g2)).max(0)
    assert smoothed_amax.max() / smoothed_amax.min() < amax.max() / amax.min()
