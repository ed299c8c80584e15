"""Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245); MHA (G = H) and MQA (G = 1)
are special cases. Multi-head Latent Attention (`MLAttention`, DeepSeek-V2/V3) shares the masks,
positions and output projection.

`dot_product_attention` is the single function the model calls for attention; `impl` picks the
implementation (`xla`: einsum reference with float32 softmax, the only one with ALiBi and with a
traced per-layer window; `flash`: the Pallas kernel; `cudnn`). Packed sequences are handled by
segment ids: a query attends only to keys of its own segment, so documents never see each other.
Segment id 0 marks padding: real tokens (ids >= 1) never see it, and a padding query sees only
padding (so no row is empty). Decoders are causal (query i sees keys j <= i); encoders
(`ModelConfig.kind=encoder`) pass `causal=False` and see their whole segment; a prefix LM adds
its prefix (xla only). Sliding windows, logit soft caps and a custom logit scale apply to every
implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import parallel
from jaxllm.kernels import flash_attention
from jaxllm.kernels.reference import attention_mask, masked_scores
from jaxllm.model import lora
from jaxllm.model.cudnn import cudnn_attention
from jaxllm.model.layers import make_norm, matmul, param
from jaxllm.model.mlp import _broadcast
from jaxllm.model.outputs import AttentionOutput
from jaxllm.model.positions import (
    alibi_slopes,
    apply_rope,
    local_rope_frequencies,
    rope_frequencies,
)
from jaxllm.sharding import constrain


def _xla_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, scale, soft_cap, bias_HxLxS):
    """Softmax over the masked float32 scores of `jaxllm.kernels.reference`; the probabilities
    are cast to v's dtype for the second matmul."""
    b, l, h, _ = q_BxLxHxK.shape
    g = k_BxSxGxK.shape[2]
    bias_1xGxRxLxS = None
    if bias_HxLxS is not None:
        bias_1xGxRxLxS = bias_HxLxS.reshape(1, g, h // g, *bias_HxLxS.shape[1:])
    scores_BxGxRxLxS, _ = masked_scores(
        q_BxLxHxK, k_BxSxGxK, mask_XxLxS, scale=scale, soft_cap=soft_cap, bias=bias_1xGxRxLxS
    )
    probs_BxGxRxLxS = jax.nn.softmax(scores_BxGxRxLxS, axis=-1).astype(v_BxSxGxK.dtype)
    out_BxLxGxRxV = jnp.einsum("bgrls,bsgv->blgrv", probs_BxGxRxLxS, v_BxSxGxK)
    return out_BxLxGxRxV.reshape(b, l, h, v_BxSxGxK.shape[-1])


def pad_values(v_BxSxGxV: jax.Array, width: int) -> jax.Array:
    """Values zero-padded to `width` channels: attention kernels take one head width for q, k
    and v, and the padded output channels are 0 (callers slice them off)."""
    return jnp.pad(v_BxSxGxV, [(0, 0)] * 3 + [(0, width - v_BxSxGxV.shape[-1])])


def resolve_impl(
    impl: str,
    alibi: bool = False,
    soft_cap: bool = False,
    dtype=None,
    head_dim: int | None = None,
    causal: bool = True,
) -> str:
    """`auto` -> the fastest implementation measured for the default backend (docs/benchmarks.md):
    on TPU the Pallas kernel; on a CUDA GPU, for bfloat16 / float16 with head dim 64 or 128,
    cuDNN's fused attention for causal self-attention (2-3x the Mosaic GPU kernel on an H100,
    packed documents included) and the kernel when a logit soft cap rules cuDNN out or the
    attention is bidirectional (the cases checked on the device), XLA otherwise; XLA on CPU.
    ALiBi always runs on XLA: the kernels take no additive bias."""
    if impl != "auto":
        return impl
    platform = jax.default_backend()
    if alibi or platform not in ("tpu", "gpu"):
        return "xla"
    if platform == "tpu":
        return "flash"
    if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    if head_dim is not None and head_dim not in (64, 128):
        return "xla"
    return "flash" if soft_cap or not causal else "cudnn"


def _flash(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, causal, scale, window, soft_cap):
    """The Pallas kernel, run per shard: a custom call cannot be split by the SPMD partitioner,
    so under a mesh it goes through `shard_map` over batch and heads."""
    interpret = jax.default_backend() == "cpu"

    def kernel(q, k, v, q_seg, kv_seg):
        seg = None if q_seg is None else (q_seg, kv_seg)
        return flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=seg,
            sm_scale=scale,
            sliding_window=window,
            soft_cap=soft_cap,
            interpret=interpret,
        )

    if q_seg_BxL is not None and kv_seg_BxS is None:
        kv_seg_BxS = q_seg_BxL
    return parallel.per_shard_attention(
        kernel, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS
    )


def _cudnn(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, q_seg_BxL, kv_seg_BxS, causal, scale, window, m):
    """cuDNN's fused attention per shard (`jaxllm.model.cudnn`), packed segments as offsets;
    the flash kernel when a row holds more than `m` segments."""

    def fallback(q, k, v, q_seg, kv_seg):
        return flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=(q_seg, kv_seg),
            sm_scale=scale,
            sliding_window=window,
        )

    def kernel(q, k, v, q_seg, kv_seg):
        return cudnn_attention(
            q,
            k,
            v,
            q_seg,
            kv_seg,
            causal=causal,
            scale=scale,
            sliding_window=window,
            max_segments=m,
            fallback=fallback,
        )

    if q_seg_BxL is not None and kv_seg_BxS is None:
        kv_seg_BxS = q_seg_BxL
    return parallel.per_shard_attention(
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
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    alibi_slopes_H: jax.Array | None = None,
    bias_HxLxS: jax.Array | None = None,
    impl: str = "xla",
    prefix_BxL: jax.Array | None = None,
    cudnn_max_segments: int = 32,
) -> jax.Array:
    """Softmax(cap(q k^T * scale) + alibi + mask) v, the layout of `jax.nn.dot_product_attention`.

    Causality is by index: query i sees keys j <= i (q and kv aligned, L == S); a sliding window
    w further limits it to i - w < j. `sliding_window` may be a traced int32 (0: no window) for
    `xla`, so scanned layers can differ; the kernels need a Python int. `soft_cap` c maps each
    scaled logit s to c * tanh(s / c); `alibi_slopes_H` adds -slope_h * (i - j) and
    `bias_HxLxS` any float32 bias (T5's relative positions), both xla only.
    `prefix_BxL` (a prefix LM; self-attention, xla only, so `auto` picks xla): where query and
    key are both 1 (the prefix of their segment) the key is visible even after the query, so the
    prefix attends bidirectionally and the tokens after it causally.
    """
    l, k = q_BxLxHxK.shape[1], q_BxLxHxK.shape[3]
    s = k_BxSxGxK.shape[1]
    scale = k**-0.5 if scale is None else scale
    bias = alibi_slopes_H is not None or bias_HxLxS is not None
    impl = resolve_impl(
        impl, bias or prefix_BxL is not None, soft_cap is not None, q_BxLxHxK.dtype, k, causal
    )
    if impl != "xla" and bias:
        raise ValueError(f"attention_impl={impl} takes no additive bias (ALiBi, T5); use xla")
    if impl != "xla" and prefix_BxL is not None:
        raise ValueError(f"attention_impl={impl} takes no prefix-LM mask; use xla")
    if impl != "xla" and v_BxSxGxK.shape[-1] != k:  # MLA: the kernels want one head width
        out = dot_product_attention(
            q_BxLxHxK,
            k_BxSxGxK,
            pad_values(v_BxSxGxK, k),
            q_segment_ids_BxL=q_segment_ids_BxL,
            kv_segment_ids_BxS=kv_segment_ids_BxS,
            causal=causal,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            impl=impl,
            cudnn_max_segments=cudnn_max_segments,
        )
        return out[..., : v_BxSxGxK.shape[-1]]
    if impl == "flash":
        return _flash(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            q_segment_ids_BxL,
            kv_segment_ids_BxS,
            causal,
            scale,
            sliding_window,
            soft_cap,
        )
    if impl == "cudnn":
        if soft_cap is not None:
            raise ValueError("attention_impl=cudnn has no logit soft cap; use flash or xla")
        return _cudnn(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            q_segment_ids_BxL,
            kv_segment_ids_BxS,
            causal,
            scale,
            sliding_window,
            cudnn_max_segments,
        )
    if impl != "xla":
        raise ValueError(f"unknown attention implementation {impl!r}")
    segment_ids = None
    if q_segment_ids_BxL is not None:
        kv_seg = q_segment_ids_BxL if kv_segment_ids_BxS is None else kv_segment_ids_BxS
        segment_ids = (q_segment_ids_BxL, kv_seg)
    q_idx_L, kv_idx_S = jnp.arange(l), jnp.arange(s)
    mask_XxLxS = attention_mask(
        q_idx_L, kv_idx_S, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids
    )
    if prefix_BxL is not None:  # prefix x prefix of one segment: visible both ways
        prefix_BxL = prefix_BxL.astype(bool)
        both_BxLxS = prefix_BxL[:, :, None] & prefix_BxL[:, None, :]
        if segment_ids is not None:
            both_BxLxS &= segment_ids[0][:, :, None] == segment_ids[1][:, None, :]
        mask_XxLxS = mask_XxLxS | both_BxLxS
    if alibi_slopes_H is not None:
        distance_LxS = jnp.abs(q_idx_L[:, None] - kv_idx_S[None, :]).astype(jnp.float32)
        alibi_HxLxS = -jnp.asarray(alibi_slopes_H, jnp.float32)[:, None, None] * distance_LxS[None]
        bias_HxLxS = alibi_HxLxS if bias_HxLxS is None else bias_HxLxS + alibi_HxLxS
    return _xla_attention(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_XxLxS, scale, soft_cap, bias_HxLxS)


class Attention(nnx.Module):
    """Projections (optional biases), optional QK-norm, positions (RoPE or ALiBi), attention
    with the layer's masks and caps, output projection."""

    def __init__(self, cfg, *, out_std: float, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self._init_common(cfg)
        pdt, init = jnp.dtype(cfg.param_dtype), jax.nn.initializers.normal(cfg.init_std)
        self.q_proj = param(rngs, init, (d, h, k), ("embed", "heads", "head_dim"), pdt)
        self.k_proj = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pdt)
        if cfg.attn_output_gate:  # Qwen3-Next: sigmoid(x W_gate) gates each head's output
            self.gate_proj = param(rngs, init, (d, h, k), ("embed", "heads", "head_dim"), pdt)
        self._init_out(cfg, k, out_std, rngs)
        zeros = jax.nn.initializers.zeros
        if cfg.qkv_bias:
            self.q_bias = param(rngs, zeros, (h, k), ("heads", "head_dim"), pdt)
            self.k_bias = param(rngs, zeros, (g, k), ("kv_heads", "head_dim"), pdt)
            self.v_bias = param(rngs, zeros, (g, k), ("kv_heads", "head_dim"), pdt)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, k, axes=("head_dim",))
            self.k_norm = make_norm(cfg, k, axes=("head_dim",))

    def _init_common(self, cfg):
        """What every attention variant has: masks, caps and positions."""
        self.dtype, self.impl = jnp.dtype(cfg.dtype), cfg.attention_impl
        self.cudnn_max_segments = cfg.cudnn_max_segments
        self.causal = cfg.causal  # False in an encoder: bidirectional within each segment
        self.fp8 = cfg.fp8
        self.position, self.window = cfg.position, cfg.sliding_window
        self.scale, self.soft_cap = cfg.attn_scale, cfg.attn_soft_cap
        if cfg.position == "rope":
            inv_freq, self.rope_scaling = rope_frequencies(cfg.rope, cfg.rope_dim, cfg.max_seq_len)
            self.inv_freq = tuple(float(x) for x in inv_freq)  # hashable: part of the graphdef
            self.rope_interleave = cfg.rope.interleave
            local = local_rope_frequencies(cfg.rope, cfg.rope_dim)
            self.local_inv_freq = None if local is None else tuple(float(x) for x in local)
        if cfg.position == "alibi":
            self.alibi = tuple(float(x) for x in alibi_slopes(cfg.num_heads))

    def _init_out(self, cfg, v_dim: int, out_std: float, rngs: nnx.Rngs):
        """The output projection from `v_dim`-wide heads (created after the input projections,
        which fixes the order parameters draw from the rng)."""
        pdt = jnp.dtype(cfg.param_dtype)
        self.o_proj = param(
            rngs,
            jax.nn.initializers.normal(out_std),
            (cfg.num_heads, v_dim, cfg.d_model),
            ("heads", "head_dim", "embed"),
            pdt,
        )
        if cfg.o_bias:
            self.o_bias = param(rngs, jax.nn.initializers.zeros, (cfg.d_model,), ("embed",), pdt)

    def _rope(self, x_BxLxHxK, positions_BxL, windowed=None):
        inv_freq, scaling = self._rope_frequencies(windowed)
        return apply_rope(x_BxLxHxK, positions_BxL, inv_freq, scaling, self.rope_interleave)

    def _rope_frequencies(self, windowed):
        """(inv_freq, attention factor) of this layer. With `local_inv_freq`, windowed layers
        use those (factor 1): every layer when `windowed` is None (there is a window, so all are
        windowed), else picked by the traced flag of the scanned layer."""
        if self.local_inv_freq is None:
            return self.inv_freq, self.rope_scaling
        if windowed is None:
            return self.local_inv_freq, 1.0
        inv_freq_K2 = jnp.where(
            windowed,
            jnp.asarray(self.local_inv_freq, jnp.float32),
            jnp.asarray(self.inv_freq, jnp.float32),
        )
        if self.rope_scaling == 1.0:
            return inv_freq_K2, 1.0
        return inv_freq_K2, jnp.where(windowed, jnp.float32(1.0), jnp.float32(self.rope_scaling))

    def _project(self, spec, x, name):
        y = matmul(spec, x, lora.kernel(self, f"{name}_proj"), self.dtype, fp8=self.fp8)
        bias = getattr(self, f"{name}_bias", None)
        return y if bias is None else y + _broadcast(bias[...].astype(self.dtype), y.ndim)

    def _masks(self, windowed):
        """Keyword arguments of the attention call for this layer: scale, cap, ALiBi, window
        (`windowed`: a traced bool of a scanned layer, or None when every layer is alike)."""
        window = self.window
        if window is not None and windowed is not None:
            window = jnp.where(windowed, jnp.int32(window), jnp.int32(0))
        alibi = None if self.position != "alibi" else jnp.asarray(self.alibi, jnp.float32)
        return dict(
            scale=self.scale, soft_cap=self.soft_cap, alibi_slopes_H=alibi, sliding_window=window
        )

    def _attend(self, q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, segment_ids_BxL, windowed, prefix_BxL=None):
        """`dot_product_attention` with this layer's masks. A kernel takes its window as a
        Python int, so a layer that is windowed or not by the scan index picks one of two
        kernel calls with `lax.cond`; XLA reads the traced window directly."""
        masks = self._masks(windowed)
        call = functools.partial(
            dot_product_attention,
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            q_segment_ids_BxL=segment_ids_BxL,
            causal=self.causal,
            impl=self.impl,
            prefix_BxL=prefix_BxL,
            cudnn_max_segments=self.cudnn_max_segments,
        )
        dynamic = self.window is not None and windowed is not None
        xla = resolve_impl(self.impl, self.position == "alibi" or prefix_BxL is not None) == "xla"
        if not dynamic or xla:
            return call(**masks)
        return jax.lax.cond(
            windowed,
            lambda: call(**{**masks, "sliding_window": self.window}),
            lambda: call(**{**masks, "sliding_window": None}),
        )

    def _attend_cache(self, q_BxQxHxK, cache, windowed, sm_scale=None):
        """A decode step's queries over the whole cache, with this layer's masks."""
        masks = self._masks(windowed)
        return cache.attend(
            q_BxQxHxK,
            sm_scale=masks["scale"] if sm_scale is None else sm_scale,
            soft_cap=self.soft_cap,
            sliding_window=masks["sliding_window"],
            alibi_slopes_H=masks["alibi_slopes_H"],
        )

    def _self_attention(
        self, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, windowed, prefix_BxL=None
    ):
        """Self-attention of a training / scoring pass (no cache): causal in a decoder,
        bidirectional over `prefix_BxL` (prefix LM)."""
        if parallel.ring_active():  # sequence-parallel: K/V blocks travel around the ring
            if prefix_BxL is not None:
                raise ValueError("ring attention takes no prefix-LM mask; use all_gather")
            width = v_BxLxGxV.shape[-1]
            out_BxLxHxK = parallel.ring_attention(
                q_BxLxHxK,
                k_BxLxGxK,
                pad_values(v_BxLxGxV, q_BxLxHxK.shape[-1]),
                segment_ids_BxL,
                impl=resolve_impl(self.impl),
                causal=self.causal,
            )
            return out_BxLxHxK[..., :width]
        # K/V all-gathered over the sequence shards (a no-op without them)
        k_BxLxGxK = constrain(k_BxLxGxK, ("batch", "act_kv_length", "act_heads", None))
        v_BxLxGxV = constrain(v_BxLxGxV, ("batch", "act_kv_length", "act_heads", None))
        return self._attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, windowed, prefix_BxL)

    def __call__(
        self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None, windowed=None, prefix_BxL=None
    ):
        """Training / scoring: self-attention over x (causal in a decoder; a prefix LM's
        `prefix_BxL` attends bidirectionally). With a `cache` (a
        `jaxllm.infer.kv_cache.CacheView`), the new keys/values are written into it first; a
        prefill then attends over its own tokens, a decode step over the whole cache. Returns an
        `AttentionOutput(out, cache)`; its cache is None without one. `windowed`: whether this layer uses the sliding
        window, when layers differ (a traced bool from the layer scan)."""
        q_BxLxHxK = self._project("bld,dhk->blhk", x_BxLxD, "q")
        k_BxLxGxK = self._project("bld,dgk->blgk", x_BxLxD, "k")
        v_BxLxGxK = self._project("bld,dgk->blgk", x_BxLxD, "v")
        if hasattr(self, "q_norm"):
            q_BxLxHxK, k_BxLxGxK = self.q_norm(q_BxLxHxK), self.k_norm(k_BxLxGxK)
        if self.position == "rope":
            q_BxLxHxK = self._rope(q_BxLxHxK, positions_BxL, windowed)
            k_BxLxGxK = self._rope(k_BxLxGxK, positions_BxL, windowed)
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "act_heads", None))
        if cache is not None:
            cache = cache.write(k_BxLxGxK, v_BxLxGxK)
            if cache.prefill:  # right-padded prompts: causality alone keeps padding unseen
                out_BxLxHxK = self._attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, None, windowed)
            else:
                out_BxLxHxK = self._attend_cache(q_BxLxHxK, cache, windowed)
            return AttentionOutput(self._out(self._gate(out_BxLxHxK, x_BxLxD)), cache)
        out_BxLxHxK = self._self_attention(
            q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, segment_ids_BxL, windowed, prefix_BxL
        )
        return AttentionOutput(self._out(self._gate(out_BxLxHxK, x_BxLxD)))

    def _gate(self, out_BxLxHxK, x_BxLxD):
        """The output gate of model.attn_output_gate (identity without it)."""
        if not hasattr(self, "gate_proj"):
            return out_BxLxHxK
        gate = jax.nn.sigmoid(self._project("bld,dhk->blhk", x_BxLxD, "gate").astype(jnp.float32))
        return (out_BxLxHxK.astype(jnp.float32) * gate).astype(out_BxLxHxK.dtype)

    def _out(self, out_BxLxHxV):
        out_BxLxD = matmul(
            "blhv,hvd->bld", out_BxLxHxV, lora.kernel(self, "o_proj"), self.dtype, fp8=self.fp8
        )
        if hasattr(self, "o_bias"):
            out_BxLxD = out_BxLxD + _broadcast(self.o_bias[...].astype(self.dtype), 3)
        return out_BxLxD
