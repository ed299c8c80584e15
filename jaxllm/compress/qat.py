"""Quantization-aware training (`train.qat.*`): the weights `jaxllm quantize` would take (the
attention, MLP, expert and MLA projections; not the embeddings, norms, router or LM head) are
rounded to the chosen kind in every forward pass of training and evaluation, and the gradient
passes through the rounding unchanged (the straight-through estimator, Bengio et al. 2013):

    W_used = W - stop_gradient(W) + stop_gradient(Q(W))   (exactly Q(W) in the forward pass)

so the float weights train while the loss sees the quantized model. Q is the quantize-then-
dequantize of the same code `jaxllm quantize` writes: int8 / int4 are RTN's grid
(`quantized.quantize`, `train.qat.group_size` and `symmetric` as `quantize.*`), fp8 and mxfp4
`coded`'s; so `jaxllm quantize --method rtn` (or fp8, mxfp4) of a QAT run with the same settings
computes what its QAT evaluation did. NVFP4 (NVIDIA's 4-bit float: E2M1 values, an E4M3 scale
per 16 input channels, one float32 scale per weight so the block scales fit E4M3) has no stored
kind in jaxllm yet: it trains and evaluates fake-quantized only.

`train.qat.activations` (int8 or fp8) also rounds those weights' inputs per token, as the
weight-activation kinds do at run time (`jaxllm.model.fake_quant`); `jaxllm quantize --method
fp8 quantize.fp8_activations=true` of a run trained with weights and activations fp8 computes
what its QAT evaluation did.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp

from jaxllm.compress import weights
from jaxllm.compress.weights import path_of
from jaxllm.config import ConfigError
from jaxllm.config.train import QATConfig
from jaxllm.model import coded, quantized
from jaxllm.model import quantized_float as qf
from jaxllm.model.fake_quant import FakeQuantKernel

NV_BLOCK = 16
# the weights QAT rounds: those `jaxllm quantize` takes by default
_CHOSEN = types.SimpleNamespace(enabled=True, head=False, skip=())


def nvfp4(w):
    """NVFP4 quantize-dequantize of w [K, N] in float32: per output, blocks of 16 inputs share
    an E4M3 scale of their max|w| / 6 relative to the weight's float32 scale max|W| / (448 * 6);
    values rounded to E2M1 (nearest, ties to even, saturating at 6)."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w))
    g = jnp.where(amax > 0, amax / (qf.FP8_MAX * 6.0), 1.0)
    b = w.reshape(k // NV_BLOCK, NV_BLOCK, n)
    block = jnp.max(jnp.abs(b), axis=1, keepdims=True) / 6.0
    scale = (block / g).astype(jnp.float8_e4m3fn).astype(jnp.float32) * g
    v = jnp.where(scale > 0, b / jnp.where(scale > 0, scale, 1.0), 0.0)
    mag = jnp.asarray(qf.E2M1_GRID)[qf.e2m1_index(v).astype(jnp.int32)]
    return (jnp.where(jnp.signbit(v), -mag, mag) * scale).reshape(k, n)


def fake(w, cfg: QATConfig, *, n_in: int, n_out: int):
    """Q(w) in float32 (module docstring): w [*lead, *in, *out]."""
    kind = cfg.weights
    if kind in ("int8", "int4"):
        t = quantized.quantize(
            w,
            bits=8 if kind == "int8" else 4,
            group=cfg.group_size,
            symmetric=cfg.symmetric,
            n_in=n_in,
            n_out=n_out,
        )
        return quantized.dequantize(t, jnp.float32)
    if kind in ("fp8", "mxfp4"):
        t = coded.encode(w, kind=kind, act="none", threshold=0.0, n_in=n_in, n_out=n_out)
        return coded.decode(t, jnp.float32)
    shape = w.shape
    lead = len(shape) - n_in - n_out
    k = math.prod(shape[lead : lead + n_in])
    fn = nvfp4
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn(w.reshape(*shape[:lead], k, -1)).reshape(shape)


def chosen(abstract, axes) -> dict[str, tuple[int, int]]:
    """{path: (n_in, n_out)} of the weights QAT rounds."""
    return {p: d for p, (_, *d) in weights.chosen(abstract, axes, _CHOSEN).items()}


def check(abstract, axes, cfg: QATConfig) -> None:
    """ConfigError naming the first weight the kind cannot take (a group size or block that
    does not divide its input channels)."""
    for path, (leaf, n_in, n_out) in weights.chosen(abstract, axes, _CHOSEN).items():
        lead = len(leaf.shape) - n_in - n_out
        k = math.prod(leaf.shape[lead : lead + n_in])
        block = {"mxfp4": qf.MX_BLOCK, "nvfp4": NV_BLOCK}.get(cfg.weights, cfg.group_size)
        if block and k % block:
            what = "train.qat.group_size" if cfg.weights in ("int8", "int4") else cfg.weights
            raise ConfigError(
                f"train.qat.weights={cfg.weights}: {what} needs the input channels in blocks of "
                f"{block}, and {path} has {k}; choose another kind or group size."
            )


def transform(abstract, axes, cfg: QATConfig):
    """params -> params with the chosen weights fake-quantized, gradients straight through,
    and with `train.qat.activations` wrapped in a `FakeQuantKernel` (their inputs rounded at
    the matmul seam); None when QAT is off."""
    if not cfg.enabled:
        return None
    check(abstract, axes, cfg)
    which = chosen(abstract, axes)

    def apply(params):
        def one(keys, w):
            d = which.get(path_of(keys))
            if d is None:
                return w
            if cfg.weights != "none":
                q = fake(w, cfg, n_in=d[0], n_out=d[1]).astype(w.dtype)
                w = w - jax.lax.stop_gradient(w) + jax.lax.stop_gradient(q)  # exactly q
            if cfg.activations != "none":
                w = FakeQuantKernel(w, cfg.activations)
            return w

        return jax.tree_util.tree_map_with_path(one, params)

    return apply
