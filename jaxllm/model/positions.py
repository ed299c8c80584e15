"""Position information: rotary embeddings with their context-extension variants, and ALiBi.

RoPE (Su et al. 2021, arXiv:2104.09864) rotates channel pairs (i, i + K/2) of queries and keys
by position * inv_freq[i], the "rotate half" layout of Hugging Face Llama checkpoints, so
imported q/k projections need no permutation. The frequencies are computed once on the host in
float32 exactly as Hugging Face's `ROPE_INIT_FUNCTIONS` do, so imported long-context models
(Llama 3.1 `llama3`, YaRN) match their reference logits:

- `linear`: position interpolation (Chen et al. 2023, arXiv:2306.15595), inv_freq / factor.
- `ntk`: "NTK-aware" scaling (bloc97, 2023): theta * factor^(K / (K - 2)), the static form.
- `dynamic`: dynamic NTK (emozilla, 2023; transformers' `dynamic` rope type): the base grows
  with the current length s once it passes the original context n,
  theta * (factor * s / n - (factor - 1))^(K / (K - 2)), recomputed on every forward pass
  (`dynamic_inv_freq`): s is a row's largest position + 1 (the row length of an unpacked
  training row), and in generation the sequence's length so far, so each decode step rotates
  its query and new key with the frequencies of its own length while the cached keys keep
  those they were written with, as transformers' `generate` does.
- `yarn`: YaRN (Peng et al. 2023, arXiv:2309.00071): a linear ramp over frequency between
  interpolation and extrapolation, and cos/sin multiplied by an attention factor.
- `llama3`: Llama 3.1's rule: long wavelengths interpolated, short ones kept, a smooth band.

`RopeConfig.local_theta` gives windowed layers their own base without scaling (Gemma 3: local
layers see a few thousand tokens, so only the global ones are stretched for long context).

`RopeConfig.interleave` pairs channels (2i, 2i + 1) instead (GPT-J; DeepSeek-V2/V3 checkpoints).

`RopeConfig.mrope_section` turns each frequency by one of three position rows (temporal,
height, width: multimodal RoPE of Qwen2-VL and later; `jaxllm.model.mrope`).

ALiBi (Press et al. 2022, arXiv:2108.12409) adds -slope_h * (i - j) to the logit of query i and
key j; slopes are the geometric sequence of the paper (interleaved for non-powers of two).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import RopeConfig


def rope_frequencies(
    rope: RopeConfig, dim: int, max_seq_len: int | None = None
) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [dim/2], attention factor multiplying cos and sin) of `rope` for heads
    whose `dim` channels it rotates. `max_seq_len` (the model's context) stands for
    `rope.original_max_len` when that is null (`llama3`, `yarn`)."""
    k = dim
    f32 = np.float32
    theta, factor = rope.theta, rope.factor
    if rope.scaling == "ntk":
        theta = theta * factor ** (k / (k - 2))
    exponents = np.arange(0, k, 2, dtype=np.int64).astype(f32) / f32(k)
    pos_freqs = np.power(f32(theta), exponents).astype(f32)
    inv_freq = (f32(1.0) / pos_freqs).astype(f32)
    original = rope.original_max_len or max_seq_len
    # `dynamic`: these are its frequencies up to the original context (`dynamic_inv_freq`)
    if rope.scaling in ("llama3", "yarn") and original is None:
        raise ValueError(f"RoPE scaling {rope.scaling} needs original_max_len or max_seq_len")
    scaling = 1.0
    if rope.scaling == "linear":
        inv_freq = (inv_freq / f32(factor)).astype(f32)
    elif rope.scaling == "llama3":
        low, high = rope.low_freq_factor, rope.high_freq_factor
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = (2 * math.pi / inv_freq).astype(f32)
        scaled = np.where(wavelen > low_wavelen, inv_freq / f32(factor), inv_freq).astype(f32)
        smooth = ((original / wavelen - low) / (high - low)).astype(f32)
        smoothed = ((1 - smooth) * scaled / f32(factor) + smooth * scaled).astype(f32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(f32)
    elif rope.scaling == "yarn":
        inv_freq, scaling = _yarn(rope, k, pos_freqs, original)
    return inv_freq, scaling


def dynamic_inv_freq(rope: RopeConfig, dim: int, original: int, seq_len_B: jax.Array) -> jax.Array:
    """inv_freq [B, dim/2] of dynamic NTK scaling for rows of current length `seq_len_B`, in
    float32 in the order of transformers' `_compute_dynamic_ntk_parameters`: the base is
    theta * ((factor * s / original) - (factor - 1)) ** (dim / (dim - 2)), with s at least
    `original` (so shorter rows keep the unscaled frequencies)."""
    s_B = jnp.maximum(seq_len_B, original).astype(jnp.float32)
    factor = jnp.float32(rope.factor)
    growth_B = (factor * s_B / jnp.float32(original) - (factor - 1)) ** jnp.float32(dim / (dim - 2))
    base_B = jnp.float32(rope.theta) * growth_B
    exponents_K2 = jnp.arange(0, dim, 2, dtype=jnp.int32).astype(jnp.float32) / jnp.float32(dim)
    return 1.0 / base_B[:, None] ** exponents_K2[None, :]


def local_rope_frequencies(rope: RopeConfig, dim: int) -> np.ndarray | None:
    """inv_freq float32 [dim/2] of windowed layers: base `rope.local_theta`, no scaling (their
    attention factor is 1); None when they share the global frequencies."""
    if rope.local_theta is None:
        return None
    local = dataclasses.replace(rope, theta=rope.local_theta, scaling="none", factor=1.0)
    return rope_frequencies(local, dim)[0]


def _yarn(
    rope: RopeConfig, k: int, pos_freqs: np.ndarray, original: int
) -> tuple[np.ndarray, float]:
    factor, theta = rope.factor, rope.theta
    f32 = np.float32

    def correction_dim(rotations: float) -> float:
        return (k * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, k - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(k // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation_weight = (1 - ramp).astype(f32)
    inv_extra = (f32(1.0) / pos_freqs).astype(f32)
    inv_inter = (f32(1.0) / (f32(factor) * pos_freqs)).astype(f32)
    inv_freq = (inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight).astype(
        f32
    )
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return inv_freq, float(attention)


def apply_rope(
    x_BxLxHxK: jax.Array,
    positions_BxL: jax.Array,
    inv_freq_K2: tuple[float, ...] | np.ndarray,
    scaling: float | jax.Array = 1.0,
    interleave: bool = False,
    mrope_rows_K2: tuple[int, ...] | np.ndarray | None = None,
) -> jax.Array:
    """Rotates channel pairs (i, i + K/2) by angle position * inv_freq[i], in float32; with
    `interleave`, the pairs (2i, 2i + 1) instead; with fewer frequencies than K / 2 (partial
    RoPE, `RopeConfig.partial_factor`) only the first 2 * K2 channels. `inv_freq_K2` and
    `scaling` may be traced (a scanned layer picking its frequencies); a [B, K/2] array gives
    each row its own frequencies (dynamic NTK). M-RoPE (`jaxllm.model.mrope`): positions
    [3, B, L] and `mrope_rows_K2`, the row whose position turns each frequency."""
    inv_freq = jnp.asarray(inv_freq_K2, jnp.float32)
    rot = 2 * inv_freq.shape[-1]
    if rot < x_BxLxHxK.shape[-1]:  # partial RoPE: the first `rot` channels turn, the rest pass
        x_rot = x_BxLxHxK[..., :rot]
        turned = apply_rope(x_rot, positions_BxL, inv_freq, scaling, interleave, mrope_rows_K2)
        return jnp.concatenate([turned, x_BxLxHxK[..., rot:]], axis=-1)
    inv_freq_BxK2 = inv_freq if inv_freq.ndim == 2 else inv_freq[None, :]
    if mrope_rows_K2 is None:
        pos_BxLxK2 = positions_BxL.astype(jnp.float32)[..., None]
    else:  # each frequency reads its own row of the [3, B, L] positions
        pos_K2xBxL = positions_BxL[np.asarray(mrope_rows_K2, np.int32)]
        pos_BxLxK2 = jnp.moveaxis(pos_K2xBxL, 0, -1).astype(jnp.float32)
    angle_BxLxK2 = pos_BxLxK2 * inv_freq_BxK2[:, None, :]
    sin = jnp.sin(angle_BxLxK2)[:, :, None, :]
    cos = jnp.cos(angle_BxLxK2)[:, :, None, :]
    if isinstance(scaling, jax.Array) or scaling != 1.0:
        sin, cos = sin * jnp.float32(scaling), cos * jnp.float32(scaling)
    x = x_BxLxHxK.astype(jnp.float32)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(x, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Per-head slopes [H] (float32): 2^(-8/n), its powers, for n the largest power of two <= H;
    the remaining heads take every other slope of the 2n sequence (as the paper's code)."""

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(n) + powers(2 * n)[0::2][: num_heads - n]
    return np.asarray(slopes, np.float32)
