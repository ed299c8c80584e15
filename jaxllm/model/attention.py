"""Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245); MHA (G = H) and MQA (G = 1)
are special cases.

`dot_product_attention` is the single function the model calls for attention; `impl` picks the
implementation (`xla`: einsum reference with float32 softmax). Packed sequences are handled by
segment ids: a query attends only to keys of its own segment, so documents never see each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import sharding
from jaxllm.model.layers import apply_rope, matmul, param
from jaxllm.sharding import constrain


def _xla_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_BxLxS, scale):
    b, l, h, k = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(b, l, g, h // g, k)
    scores_BxGxRxLxS = jnp.einsum(
        "blgrk,bsgk->bgrls", q_BxLxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32
    )
    scores_BxGxRxLxS = jnp.where(
        mask_BxLxS[:, None, None], scores_BxGxRxLxS * scale, jnp.finfo(jnp.float32).min
    )
    probs_BxGxRxLxS = jax.nn.softmax(scores_BxGxRxLxS, axis=-1).astype(v_BxSxGxK.dtype)
    out_BxLxGxRxK = jnp.einsum("bgrls,bsgk->blgrk", probs_BxGxRxLxS, v_BxSxGxK)
    return out_BxLxGxRxK.reshape(b, l, h, k)


def resolve_impl(impl: str) -> str:
    """`auto` -> the implementation for the default backend: the Pallas kernel on TPU, XLA
    elsewhere (on GPU the kernel's Pallas backend is Triton, deprecated in new jax; the choice
    between cudnn and a kernel waits for the GPU benchmark)."""
    if impl != "auto":
        return impl
    return "flash" if jax.default_backend() == "tpu" else "xla"


def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, causal, scale):
    """The Pallas kernel, run per shard: a custom call cannot be split by the SPMD partitioner,
    so under a mesh it goes through `shard_map` over batch and heads."""
    from jaxllm.kernels import flash_attention

    interpret = jax.default_backend() == "cpu"

    def kernel(q, k, v, q_seg, kv_seg):
        seg = None if q_seg is None else (q_seg, kv_seg)
        return flash_attention(
            q, k, v, causal=causal, segment_ids=seg, sm_scale=scale, interpret=interpret
        )

    if q_seg_BxL is not None and kv_seg_BxS is None:
        kv_seg_BxS = q_seg_BxL
    return sharding.per_shard_attention(
        kernel, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS
    )


def dot_product_attention(
    q_BxLxHxK: jax.Array,
    k_BxSxGxK: jax.Array,
    v_BxSxGxK: jax.Array,
    *,
    q_segment_ids_BxL: jax.Array | None = None,
    kv_segment_ids_BxS: jax.Array | None = None,
    causal: bool = True,
    scale: float | None = None,
    impl: str = "xla",
) -> jax.Array:
    """Softmax(q k^T * scale + mask) v with the layout of `jax.nn.dot_product_attention`.

    Causality is by index: query i sees keys j <= i (q and kv aligned, L == S).
    """
    b, l, _, k = q_BxLxHxK.shape
    s = k_BxSxGxK.shape[1]
    scale = k**-0.5 if scale is None else scale
    impl = resolve_impl(impl)
    if impl == "flash":
        return _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_segment_ids_BxL, kv_segment_ids_BxS,
                      causal, scale)  # fmt: skip
    if impl == "cudnn":
        if q_segment_ids_BxL is not None:
            raise ValueError("attention_impl=cudnn does not take packed segment ids; use flash")
        return jax.nn.dot_product_attention(
            q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, scale=scale, is_causal=causal, implementation="cudnn"
        )
    mask_BxLxS = jnp.ones((b, l, s), dtype=bool)
    if causal:
        mask_BxLxS &= (jnp.arange(l)[:, None] >= jnp.arange(s)[None, :])[None]
    if q_segment_ids_BxL is not None:
        kv_seg = q_segment_ids_BxL if kv_segment_ids_BxS is None else kv_segment_ids_BxS
        mask_BxLxS &= q_segment_ids_BxL[:, :, None] == kv_seg[:, None, :]
    if impl == "xla":
        return _xla_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_BxLxS, scale)
    raise ValueError(f"unknown attention implementation {impl!r}")


class Attention(nnx.Module):
    def __init__(self, cfg, *, out_std: float, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.dtype, self.impl, self.theta = jnp.dtype(cfg.dtype), cfg.attention_impl, cfg.rope_theta
        pdt = jnp.dtype(cfg.param_dtype)
        init, out_init = (
            jax.nn.initializers.normal(cfg.init_std),
            jax.nn.initializers.normal(out_std),
        )
        self.q_proj = param(rngs, init, (d, h, k), ("embed", "heads", "head_dim"), pdt)
        self.k_proj = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pdt)
        self.o_proj = param(rngs, out_init, (h, k, d), ("heads", "head_dim", "embed"), pdt)

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None):
        """Training / scoring: causal self-attention over x. With a `cache` (a
        `jaxllm.infer.kv_cache.CacheView`), the new keys/values are written into it first; a
        prefill then attends over its own tokens, a decode step over the whole cache. Returns
        (out, cache) when a cache is passed."""
        q_BxLxHxK = matmul("bld,dhk->blhk", x_BxLxD, self.q_proj[...], self.dtype)
        k_BxLxGxK = matmul("bld,dgk->blgk", x_BxLxD, self.k_proj[...], self.dtype)
        v_BxLxGxK = matmul("bld,dgk->blgk", x_BxLxD, self.v_proj[...], self.dtype)
        q_BxLxHxK = apply_rope(q_BxLxHxK, positions_BxL, self.theta)
        k_BxLxGxK = apply_rope(k_BxLxGxK, positions_BxL, self.theta)
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "act_heads", None))
        if cache is not None:
            cache = cache.write(k_BxLxGxK, v_BxLxGxK)
            if cache.prefill:  # right-padded prompts: causality alone keeps padding unseen
                out_BxLxHxK = dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, impl=self.impl)
            else:
                out_BxLxHxK = cache.attend(q_BxLxHxK)
            return matmul("blhk,hkd->bld", out_BxLxHxK, self.o_proj[...], self.dtype), cache
        if sharding.ring_active():  # sequence-parallel: K/V blocks travel around the ring
            out_BxLxHxK = sharding.ring_attention(
                q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, impl=resolve_impl(self.impl)
            )
        else:  # K/V all-gathered over the sequence shards (a no-op without them)
            k_BxLxGxK = constrain(k_BxLxGxK, ("batch", "act_kv_length", "act_heads", None))
            v_BxLxGxK = constrain(v_BxLxGxK, ("batch", "act_kv_length", "act_heads", None))
            out_BxLxHxK = dot_product_attention(
                q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, q_segment_ids_BxL=segment_ids_BxL, impl=self.impl
            )
        return matmul("blhk,hkd->bld", out_BxLxHxK, self.o_proj[...], self.dtype)
