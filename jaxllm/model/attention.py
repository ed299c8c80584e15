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
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import parallel
from jaxllm.model import gaussian, lora
from jaxllm.model.dot_product import dot_product_attention, pad_values, resolve_impl
from jaxllm.model.layers import make_norm, matmul, param
from jaxllm.model.mlp import _broadcast
from jaxllm.model.mrope import mrope_rows
from jaxllm.model.outputs import AttentionOutput
from jaxllm.model.positions import (
    alibi_slopes,
    apply_rope,
    dynamic_inv_freq,
    local_rope_frequencies,
    rope_frequencies,
)
from jaxllm.sharding import constrain


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
        if cfg.attention_sinks:  # one logit per query head in the softmax denominator
            self.sinks = param(rngs, zeros, (h,), ("heads",), pdt)
        if self.gaussian and cfg.gaussian_sigma_learned:  # log sigma: sigma stays positive
            log_sigma = jax.nn.initializers.constant(math.log(cfg.gaussian_sigma))
            self.gaussian_log_sigma = param(rngs, log_sigma, (h,), ("heads",), pdt)

    def _init_common(self, cfg):
        """What every attention variant has: masks, caps and positions."""
        self.dtype, self.impl = jnp.dtype(cfg.dtype), cfg.attention_impl
        if cfg.attention_kernel == "gaussian":  # auto: the kernels compute no Gaussian logits
            self.impl = "xla"
        self.cudnn_max_segments = cfg.cudnn_max_segments
        self.causal = cfg.causal  # False in an encoder: bidirectional within each segment
        self.fp8 = cfg.fp8
        self.position, self.window = cfg.position, cfg.sliding_window
        self.scale, self.soft_cap = cfg.attn_scale, cfg.attn_soft_cap
        self.gaussian = cfg.attention_kernel == "gaussian"  # `jaxllm.model.gaussian`
        self.gaussian_sigma, self.num_heads = cfg.gaussian_sigma, cfg.num_heads
        if cfg.position == "rope":
            inv_freq, self.rope_scaling = rope_frequencies(cfg.rope, cfg.rope_dim, cfg.max_seq_len)
            self.inv_freq = tuple(float(x) for x in inv_freq)  # hashable: part of the graphdef
            self.rope_interleave = cfg.rope.interleave
            section = cfg.rope.mrope_section  # M-RoPE: the position row of each frequency
            rows = None if section is None else mrope_rows(section, cfg.rope.mrope_interleaved)
            self.mrope_rows = None if rows is None else tuple(int(r) for r in rows)
            local = local_rope_frequencies(cfg.rope, cfg.rope_dim)
            self.local_inv_freq = None if local is None else tuple(float(x) for x in local)
            self.rope_dynamic = None  # dynamic NTK: (rope, dim, original context), per pass
            if cfg.rope.scaling == "dynamic":
                original = cfg.rope.original_max_len or cfg.max_seq_len
                self.rope_dynamic = (cfg.rope, cfg.rope_dim, original)
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

    def _rope(self, x_BxLxHxK, positions_BxL, windowed=None, seq_len_B=None):
        """`positions_BxL`: [B, L], or with M-RoPE [3, B, L] (temporal, height, width), where
        [B, L] stands for three equal rows (text)."""
        rows = self.mrope_rows
        if rows is not None and positions_BxL.ndim == 2:
            positions_BxL = jnp.broadcast_to(positions_BxL, (3, *positions_BxL.shape))
        inv_freq, scaling = self._rope_frequencies(windowed, positions_BxL, seq_len_B)
        interleave = self.rope_interleave
        return apply_rope(x_BxLxHxK, positions_BxL, inv_freq, scaling, interleave, rows)

    def _rope_frequencies(self, windowed, positions_BxL=None, seq_len_B=None):
        """(inv_freq, attention factor) of this layer. With `local_inv_freq`, windowed layers
        use those (factor 1): every layer when `windowed` is None (there is a window, so all are
        windowed), else picked by the traced flag of the scanned layer. Dynamic NTK gives each
        row frequencies [B, K/2] of its current length: `seq_len_B` (a prefill's prompt
        lengths), else the row's largest position + 1 (transformers takes the largest over the
        batch; the same for one sequence or rows of equal length)."""
        inv_freq = self.inv_freq
        if self.rope_dynamic is not None:
            if seq_len_B is None:
                seq_len_B = jnp.max(positions_BxL, axis=1) + 1
            inv_freq = dynamic_inv_freq(*self.rope_dynamic, seq_len_B)
        if self.local_inv_freq is None:
            return inv_freq, self.rope_scaling
        if windowed is None:
            return self.local_inv_freq, 1.0
        inv_freq = jnp.asarray(inv_freq, jnp.float32)
        local = jnp.broadcast_to(jnp.asarray(self.local_inv_freq, jnp.float32), inv_freq.shape)
        inv_freq_K2 = jnp.where(windowed, local, inv_freq)
        if self.rope_scaling == 1.0:
            return inv_freq_K2, 1.0
        return inv_freq_K2, jnp.where(windowed, jnp.float32(1.0), jnp.float32(self.rope_scaling))

    def _project(self, spec, x, name):
        y = matmul(spec, x, lora.kernel(self, f"{name}_proj"), self.dtype, fp8=self.fp8)
        bias = getattr(self, f"{name}_bias", None)
        return y if bias is None else y + _broadcast(bias[...].astype(self.dtype), y.ndim)

    def _masks(self, windowed, heads=None):
        """Keyword arguments of the attention call for this layer: scale, cap, ALiBi, window
        (`windowed`: a traced bool of a scanned layer, or None when every layer is alike);
        `heads` replaces the per-head ones (a device's slice of ALiBi slopes and sinks)."""
        window = self.window
        if window is not None and windowed is not None:
            window = jnp.where(windowed, jnp.int32(window), jnp.int32(0))
        alibi = None if self.position != "alibi" else jnp.asarray(self.alibi, jnp.float32)
        scale = 1.0 if self.gaussian else self.scale  # Gaussian: folded into the queries
        sinks = getattr(self, "sinks", None)
        head_masks = dict(
            alibi_slopes_H=alibi,
            sinks_H=None if sinks is None else sinks[...].astype(jnp.float32),
        )
        return dict(
            scale=scale,
            soft_cap=self.soft_cap,
            sliding_window=window,
            **(head_masks if heads is None else heads),
        )

    def _attend(
        self,
        q_BxLxHxK,
        k_BxSxGxK,
        v_BxSxGxK,
        segment_ids_BxL,
        windowed,
        prefix_BxL=None,
        heads=None,
    ):
        """`dot_product_attention` with this layer's masks (`heads`: see `_masks`). A kernel
        takes its window as a Python int, so a layer that is windowed or not by the scan index
        picks one of two kernel calls with `lax.cond`; XLA reads the traced window directly."""
        masks = self._masks(windowed, heads)
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
            sinks_H=masks["sinks_H"],
        )

    def _self_attention(
        self, q_BxLxHxK, k_BxLxGxK, v_BxLxGxV, segment_ids_BxL, windowed, prefix_BxL=None
    ):
        """Self-attention of a training / scoring pass (no cache): causal in a decoder,
        bidirectional over `prefix_BxL` (prefix LM)."""
        usp = parallel.usp_active()  # Ulysses in groups, the ring across them
        if usp or parallel.ring_active():  # sequence-parallel: K/V blocks travel around the ring
            if self.gaussian:
                raise ValueError("ring attention has no Gaussian kernel; use all_gather or ulysses")
            if prefix_BxL is not None or hasattr(self, "sinks"):
                raise ValueError(
                    "ring attention takes no prefix-LM mask or sinks; use all_gather or ulysses"
                )
            width = v_BxLxGxV.shape[-1]
            out_BxLxHxK = (parallel.usp_attention if usp else parallel.ring_attention)(
                q_BxLxHxK,
                k_BxLxGxK,
                pad_values(v_BxLxGxV, q_BxLxHxK.shape[-1]),
                segment_ids_BxL,
                impl=resolve_impl(self.impl),
                causal=self.causal,
            )
            return out_BxLxHxK[..., :width]
        if parallel.ulysses_active():  # sequence-parallel: all-to-alls to whole-sequence heads
            masks = self._masks(None)
            heads = {name: masks[name] for name in ("alibi_slopes_H", "sinks_H")}

            def local(q, k, v, tokens, heads, windowed):
                return self._attend(q, k, v, tokens[0], windowed, tokens[1], heads)

            return parallel.ulysses_attention(
                local,
                q_BxLxHxK,
                k_BxLxGxK,
                v_BxLxGxV,
                (segment_ids_BxL, prefix_BxL),
                heads,
                windowed,
                impl=resolve_impl(self.impl, self.position == "alibi" or prefix_BxL is not None),
            )
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
            # a prefill's right-padded rows: their length is the prompt's, not the padded one
            seq_len_B = cache.lengths_B if cache is not None and cache.prefill else None
            q_BxLxHxK = self._rope(q_BxLxHxK, positions_BxL, windowed, seq_len_B)
            k_BxLxGxK = self._rope(k_BxLxGxK, positions_BxL, windowed, seq_len_B)
        if self.gaussian:  # K + 1 channels whose dot products are the Gaussian logits
            q_BxLxHxK, k_BxLxGxK = gaussian.augment(q_BxLxHxK, k_BxLxGxK, self._sigma_H())
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "act_heads", None))
        if cache is not None:  # one width for cached keys and values: v zero-padded
            cache = cache.write(k_BxLxGxK, pad_values(v_BxLxGxK, k_BxLxGxK.shape[-1]))
            if cache.prefill:  # right-padded prompts: causality alone keeps padding unseen
                out_BxLxHxK = self._attend(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, None, windowed)
            else:
                out_BxLxHxK = self._attend_cache(q_BxLxHxK, cache, windowed)
                out_BxLxHxK = out_BxLxHxK[..., : v_BxLxGxK.shape[-1]]
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

    def _sigma_H(self):
        """The Gaussian kernel's sigma per head [H] (float32), learned or fixed."""
        if hasattr(self, "gaussian_log_sigma"):
            return jnp.exp(self.gaussian_log_sigma[...].astype(jnp.float32))
        return jnp.full((self.num_heads,), self.gaussian_sigma, jnp.float32)

    def _out(self, out_BxLxHxV):
        # heads over `tensor` (and so its gradient in the backward pass: under Megatron-SP an
        # all-gather of the residual's gradient, not an all-to-all of this one)
        out_BxLxHxV = constrain(out_BxLxHxV, ("batch", "length", "act_heads", None))
        out_BxLxD = matmul(
            "blhv,hvd->bld", out_BxLxHxV, lora.kernel(self, "o_proj"), self.dtype, fp8=self.fp8
        )
        if hasattr(self, "o_bias"):
            out_BxLxD = out_BxLxD + _broadcast(self.o_bias[...].astype(self.dtype), 3)
        return out_BxLxD
