"""Attention sinks (gpt-oss: a learned logit per query head in the softmax denominator only):
the eager formula of transformers' `GptOssAttention` (concatenate the sink logit, softmax, drop
its column) against the model's XLA path, the flash kernel (interpret mode, forward and
gradients in q, k, v and the sinks), the decode kernel over contiguous and paged caches, their
lowering for TPU and CUDA, and the refusals (cuDNN, ring attention)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_inputs import inputs as _inputs
from attention_inputs import packed_ids as _packed_ids
from conftest import tiny_model
from flax import nnx
from jaxllm.kernels import BlockSizes, flash_attention, flash_attention_reference
from jaxllm.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    quantize_cache,
)
from lowering import lower
from test_decode_attention import LENGTHS, _build
from test_flash_attention_lowering import LOWERINGS

from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.model.attention import dot_product_attention
from jaxllm.model.transformer import build

f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731


def _eager(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, sinks_H, *, window=None):
    """transformers' `eager_attention_forward` of GptOss in numpy float64: causal (and
    windowed) logits, the sink as one more column, softmax, the column dropped."""
    q, k, v = (np.asarray(x, np.float64) for x in (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK))
    b, l, h, d = q.shape
    r = h // k.shape[2]
    k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
    logits_BxHxLxS = np.einsum("blhd,bshd->bhls", q, k) * d**-0.5
    i, j = np.arange(l)[:, None], np.arange(k.shape[1])[None, :]
    visible = j <= i if window is None else (j <= i) & (i - window < j)
    logits_BxHxLxS = np.where(visible, logits_BxHxLxS, -np.inf)
    sinks = np.broadcast_to(np.asarray(sinks_H, np.float64)[None, :, None, None], (b, h, l, 1))
    both = np.concatenate([logits_BxHxLxS, sinks], axis=-1)
    probs = np.exp(both - both.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bhls,bshd->blhd", probs, v)


def load_error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        config.load(None, list(overrides))
    return str(e.value)


def _sinks(h, seed=3):
    return 2.0 * jax.random.normal(jax.random.key(seed), (h,), jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "flash"])
@pytest.mark.parametrize("window", [None, 4])
def test_model_attention_matches_eager_formula(impl, window):
    q, k, v, _ = _inputs(2, 11, 11, 6, 2, 16, jnp.float32)
    sinks = _sinks(6)
    out = dot_product_attention(q, k, v, sliding_window=window, sinks_H=sinks, impl=impl)
    np.testing.assert_allclose(f32(out), _eager(q, k, v, sinks, window=window), atol=2e-5)
    plain = dot_product_attention(q, k, v, sliding_window=window, impl=impl)
    assert np.abs(f32(out) - f32(plain)).max() > 1e-2  # the sinks took weight


def test_model_with_windowed_layers_is_the_same_on_flash_and_xla():
    """A scanned model whose layers alternate window / full (the kernel's window picked per
    layer with `lax.cond`) gives the same logits and sink gradients with flash and xla."""
    cfg = tiny_model(attention_sinks=True, sliding_window=4, global_every=2, num_layers=2)
    model = build(cfg, seed=0)
    sinks = model.layers.attn.sinks
    sinks[...] = jax.random.normal(jax.random.key(1), sinks[...].shape)
    tokens = jax.random.randint(jax.random.key(2), (2, 11), 0, cfg.vocab_size)

    def loss_and_grad(impl):
        m = build(dataclasses.replace(cfg, attention_impl=impl), seed=0)
        nnx.update(m, nnx.state(model))

        def loss(m):
            return jnp.mean(m(tokens).logits ** 2)

        return nnx.value_and_grad(loss)(m)

    (l_x, g_x), (l_f, g_f) = loss_and_grad("xla"), loss_and_grad("flash")
    np.testing.assert_allclose(float(l_f), float(l_x), rtol=1e-5)
    gx, gf = g_x.layers.attn.sinks[...], g_f.layers.attn.sinks[...]
    np.testing.assert_allclose(f32(gf), f32(gx), atol=1e-6, rtol=1e-4)
    assert np.abs(f32(gx)).min() > 0


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True),
        dict(causal=True, segments=True, sliding_window=20, soft_cap=10.0),
    ],
    ids=["causal", "all_masks"],
)
def test_flash_kernel_matches_reference_with_gradients(kw):
    """Forward and gradients (q, k, v, sinks) of the interpreted kernels, whose backward sees
    the sink only through the lse cotangent, against the reference's explicit sink column."""
    kw = dict(kw)
    b, l, h, g, d = 2, 70, 4, 2, 32
    q, k, v, do = _inputs(b, l, l, h, g, d, jnp.float32, seed=1)
    if kw.pop("segments", False):
        kw["segment_ids"] = _packed_ids(b, l, [0, 30, 52])
    sinks = _sinks(h)
    bs = BlockSizes(32, 32)

    def kern(q, k, v, s):
        return flash_attention(q, k, v, sinks=s, block_sizes=bs, interpret=True, **kw)

    def ref(q, k, v, s):
        return flash_attention_reference(q, k, v, sinks=s, **kw)

    def vjp(fn):
        out, pull = jax.vjp(fn, q, k, v, sinks)
        return out, pull(do)

    out, grads = jax.jit(lambda: vjp(kern))()
    out_r, grads_r = vjp(ref)
    np.testing.assert_allclose(f32(out), f32(out_r), atol=2e-5)
    for got, want in zip(grads, grads_r):
        np.testing.assert_allclose(f32(got), f32(want), atol=5e-5)
    assert np.abs(f32(grads[3])).min() > 0  # every head's sink gets a gradient


@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_kernel_matches_reference(backend, paged):
    """The kernel merges the sink as one more split; the reference adds it to the
    denominator. Ragged lengths with a length-0 row (which stays 0) and NaN-poisoned tails."""
    cache, layer = _build("float32", 2, 2, paged, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    q = jax.random.normal(jax.random.key(7), (len(LENGTHS), 2, 4, 64), jnp.float32)
    sinks = _sinks(4)
    kw = dict(layer=layer, sinks_H=sinks)
    out = decode_attention(
        q, cache, lengths, block_kv=32, num_splits=2, interpret=True, backend=backend, **kw
    )
    ref = decode_attention_reference(q, cache, lengths, **kw)
    np.testing.assert_allclose(f32(out), f32(ref), atol=2e-5)
    np.testing.assert_array_equal(f32(out)[0], 0.0)
    plain = decode_attention_reference(q, cache, lengths, layer=layer)
    assert np.abs(f32(ref) - f32(plain)).max() > 1e-2


def test_decode_reference_matches_eager_formula():
    """A decode query at the last position over a full float32 cache is the last row of
    causal attention with sinks."""
    b, t, h, g, d = 2, 9, 4, 2, 16
    q, k, v, _ = _inputs(b, t, t, h, g, d, jnp.float32, seed=5)
    cache = quantize_cache(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), "float32")
    sinks = _sinks(h)
    out = decode_attention_reference(q[:, -1:], cache, jnp.full((b,), t, jnp.int32), sinks_H=sinks)
    np.testing.assert_allclose(f32(out), _eager(q, k, v, sinks)[:, -1:], atol=2e-5)


@pytest.mark.parametrize("platform,backend,target", LOWERINGS, ids=[p for p, *_ in LOWERINGS])
def test_kernels_with_sinks_lower(platform, backend, target):
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)

    def loss(q, k, v, s):
        out = flash_attention(q, k, v, causal=True, sinks=s, backend=backend)
        return out.astype(jnp.float32).sum()

    text = lower(jax.grad(loss, argnums=(0, 1, 2, 3)), q, kv, kv, sinks, platform=platform)
    assert text.as_text().count(target) == 3  # forward, dq, dk / dv
    cache, _ = _build("bfloat16", 2, None, False, jnp.bfloat16, d=128)
    qd = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)

    def decode(q, cache, lengths, s):
        return decode_attention(q, cache, lengths, sinks_H=s, backend=backend)

    text = lower(decode, qd, cache, lengths, sinks, platform=platform).as_text()
    assert text.count(target) == 1


def test_mosaic_gpu_kernels_with_sinks_lower_for_cuda():
    """Hopper's kernels: the sink's gradient reaches them through the lse cotangent (1 forward,
    3 in value_and_grad: forward, dq, dk / dv)."""
    q = jax.ShapeDtypeStruct((2, 256, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)

    def fwd(q, k, v, s):
        return flash_attention(q, k, v, causal=True, sinks=s, backend="mosaic_gpu")

    def loss(q, k, v, s):
        return fwd(q, k, v, s).astype(jnp.float32).sum()

    grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    for fn, calls in ((fwd, 1), (grads, 3)):
        text = lower(fn, q, kv, kv, sinks, platform="cuda").as_text()
        assert text.count("mosaic_gpu_v2") == calls


def test_backends_without_sinks_are_refused():
    assert "model.attention_sinks needs model.attention_impl" in load_error(
        "model.attention_sinks=true", "model.attention_impl=cudnn"
    )
    assert "model.attention_sinks" in load_error(
        "model.attention_sinks=true", "mesh.sequence_attention=ring"
    )
    with pytest.raises(ValueError, match="cudnn"):
        q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
        dot_product_attention(q, k, v, sinks_H=_sinks(2), impl="cudnn")
    mla = ["model.mla.kv_lora_rank=16", "model.num_kv_heads=4"]
    assert "not of MLA" in load_error("model.attention_sinks=true", *mla)
    assert config.load(None, ["model.attention_sinks=true"]).model.attention_sinks
    with pytest.raises(ConfigError):
        config.load(None, ["model.attention_sinks=maybe"])
