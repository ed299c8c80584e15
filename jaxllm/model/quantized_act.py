"""Weight-activation int8 matmuls: W8A8 (the kind SmoothQuant runs) and LLM.int8().

A weight [K, N] (K contracted, N output channels) is stored as int8 codes with one float32
scale per output channel, s_w[n] = max_k |W_kn| / 127, q_w = round(W / s_w) (bitsandbytes'
row-wise absmax over its [N, K] layout). At run time each token's activation row is quantized
the same way, s_x[t] = max_k |X_tk| / 127, and the matmul is an int8 x int8 dot accumulated in
int32, rescaled:

    Y_tn = s_x[t] * s_w[n] * sum_k q_x[t, k] q_w[k, n].

LLM.int8() (Dettmers et al. 2022, arXiv:2208.07339) takes out the outlier feature dimensions,
the input features k where any |X_tk| > threshold (6.0 in the paper), and computes them in 16
bits against the dequantized weight rows; the rest go through the int8 dot:

    Y = W8A8(X * (1 - m)) + (X * m) @ (q_w * s_w),   m_k = [max_t |X_tk| > threshold].

The mask keeps shapes static (no gather of the outlier columns).

SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) moves quantization difficulty from the
activations to the weights before W8A8: with per-input-channel s_j = max|X_j|^alpha /
max|W_j|^(1 - alpha) (alpha 0.5 in the paper), X W = (X / s)(s W); the division folds into
the preceding norm's weight (`smooth`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127.0


def int8_quantize(w: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """(int8 codes, float32 scales) of `w`, one scale per slice along `axis` (the scales keep
    `axis` as a dim of 1): s = max |w| / 127 over `axis`, q = round(w / s). A zero slice
    gets s = 1."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axis, keepdims=True)
    s = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(w / s), -INT8_MAX, INT8_MAX).astype(jnp.int8), s


def w8a8_matmul(x: jax.Array, q_w: jax.Array, s_w: jax.Array, dtype=None) -> jax.Array:
    """Y = s_x s_w (q_x @ q_w) for activations `x` [..., K], int8 weight codes `q_w` [K, N] and
    their scales `s_w` [1, N]; the tokens quantized per row here, the dot in int32."""
    q_x, s_x = int8_quantize(x, axis=-1)
    acc = jnp.einsum("...k,kn->...n", q_x, q_w, preferred_element_type=jnp.int32)
    s_w = s_w.reshape((1,) * (acc.ndim - 1) + s_w.shape[-1:])
    return (acc.astype(jnp.float32) * s_x * s_w).astype(dtype or x.dtype)


def llm_int8_matmul(
    x: jax.Array, q_w: jax.Array, s_w: jax.Array, threshold: float = 6.0, dtype=None
) -> jax.Array:
    """LLM.int8()'s decomposition (module docstring): the outlier input features of `x` (any
    |x| > `threshold` over all tokens) against the dequantized weight rows in x's dtype, the
    rest through `w8a8_matmul`."""
    lead = tuple(range(x.ndim - 1))
    m = jnp.max(jnp.abs(x), axis=lead, keepdims=True) > threshold
    regular = w8a8_matmul(jnp.where(m, 0, x), q_w, s_w, jnp.float32)
    w = (q_w.astype(jnp.float32) * s_w).astype(x.dtype)
    outlier = jnp.einsum("...k,kn->...n", jnp.where(m, x, 0), w, preferred_element_type=jnp.float32)
    return (regular + outlier).astype(dtype or x.dtype)


def smooth(w_list, act_absmax: jax.Array, norm_weight: jax.Array, alpha: float = 0.5):
    """SmoothQuant's migration for the weights [K, N_i] of `w_list` that read one norm's
    output: s_j = max|X_j|^alpha / max_i,n |W_i[j, n]|^(1 - alpha) from the calibration
    `act_absmax` [K], both maxima floored at 1e-5 (the reference code floors max|W| and s:
    they differ only for a channel no calibration row reaches). Returns
    ([s[:, None] * W_i], norm_weight / s): the same products, X W = (X / s)(s W)."""
    a = jnp.maximum(act_absmax.astype(jnp.float32), 1e-5)
    wmax = jnp.max(jnp.stack([jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1) for w in w_list]), 0)
    s = a**alpha / jnp.maximum(wmax, 1e-5) ** (1 - alpha)
    smoothed = [(w.astype(jnp.float32) * s[:, None]).astype(w.dtype) for w in w_list]
    return smoothed, (norm_weight.astype(jnp.float32) / s).astype(norm_weight.dtype)
