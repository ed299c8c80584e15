"""Linear-attention token mixers behind the attention seam of `Block`: Gated DeltaNet (Yang,
Kautz & Hatamizadeh 2024, arXiv:2412.06464) as Qwen3-Next uses it (Hugging Face
`Qwen3NextGatedDeltaNet`; fla-org/flash-linear-attention's `GatedDeltaNet` layer).

Letters: G the query/key heads (linear_attention.num_k_heads), H the value heads, K and V their
widths, W the convolution taps, C = 2 G K + H V the convolved channels. Per token:

    q, k, v = silu(causal_conv(x W_q)), silu(causal_conv(x W_k)), silu(causal_conv(x W_v))
    beta = sigmoid(x W_b),  g = -exp(A_log) softplus(x W_a + dt_bias)          (per value head)
    o = gated_delta_rule(q, k, v, g, beta)                                      (`delta_rule`)
    out = (rmsnorm(o) * norm_scale * silu(x W_z)) W_out

The state (H heads of [K, V], float32) and the last W - 1 convolution inputs are all a layer
carries between tokens: generation keeps them (`jaxllm.infer.linear_state`) instead of a KV
cache, so its memory does not grow with the context.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model import delta_rule, lora
from jaxllm.model.layers import matmul, param
from jaxllm.model.outputs import AttentionOutput
from jaxllm.sharding import constrain


def _uniform(bound: float):
    def init(key, shape, dtype):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _a_log_init(key, shape, dtype):
    """log A with A ~ U(1, 16) (Mamba-2's range): decays exp(-A softplus(.)) from mild to fast."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def document_starts(segment_ids_BxL) -> jax.Array:
    """True where a token's segment id differs from the previous token's (the first token
    included): the state and the convolution window restart there."""
    prev_BxL = jnp.pad(segment_ids_BxL[:, :-1], [(0, 0), (1, 0)], constant_values=-1)
    return segment_ids_BxL != prev_BxL


def _last_inputs(x_BxLxNxW, lengths_B, tail_BxTxC):
    """The convolution tail [B, T, N * W] of right-padded rows: each row's last T inputs
    before its length, the previous `tail_BxTxC` standing before x (a row of length 0 keeps
    it)."""
    b, l = x_BxLxNxW.shape[:2]
    x_BxLxC = x_BxLxNxW.reshape(b, l, -1)
    padded_BxSxC = jnp.concatenate([tail_BxTxC.astype(x_BxLxC.dtype), x_BxLxC], axis=1)
    idx_BxT = lengths_B[:, None] + jnp.arange(tail_BxTxC.shape[1])[None]
    return jnp.take_along_axis(padded_BxSxC, idx_BxT[..., None], axis=1)


class GatedDeltaNet(nnx.Module):
    """x [B, L, D] -> AttentionOutput(out [B, L, D], cache): chunked form without a cache, in
    a prefill, or in a decode step of several tokens (the engine's prefill chunks, from the
    carried state); recurrent form in one-token decode steps."""

    fp8_exempt = ("a_proj", "b_proj")  # float32 gate logits, never fp8 (no amax history)

    def __init__(self, cfg, *, out_std: float, rngs: nnx.Rngs):
        la, d = cfg.linear_attention, cfg.d_model
        g, h, kd, vd, w = (
            la.num_k_heads,
            la.num_v_heads,
            la.k_head_dim,
            la.v_head_dim,
            la.conv_kernel,
        )
        self.dtype, self.fp8, self.chunk = jnp.dtype(cfg.dtype), cfg.fp8, la.chunk_size
        self.eps = cfg.norm_eps
        pdt, init = jnp.dtype(cfg.param_dtype), jax.nn.initializers.normal(cfg.init_std)
        self.q_proj = param(rngs, init, (d, g, kd), ("embed", "kv_heads", "head_dim"), pdt)
        self.k_proj = param(rngs, init, (d, g, kd), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = param(rngs, init, (d, h, vd), ("embed", "heads", "head_dim"), pdt)
        self.z_proj = param(rngs, init, (d, h, vd), ("embed", "heads", "head_dim"), pdt)
        self.b_proj = param(rngs, init, (d, h), ("embed", "heads"), pdt)
        self.a_proj = param(rngs, init, (d, h), ("embed", "heads"), pdt)
        conv = _uniform(1 / math.sqrt(w))  # PyTorch's Conv1d default for a depthwise filter
        self.conv_q = param(rngs, conv, (w, g, kd), (None, "kv_heads", "head_dim"), pdt)
        self.conv_k = param(rngs, conv, (w, g, kd), (None, "kv_heads", "head_dim"), pdt)
        self.conv_v = param(rngs, conv, (w, h, vd), (None, "heads", "head_dim"), pdt)
        self.A_log = param(rngs, _a_log_init, (h,), ("heads",), pdt)
        self.dt_bias = param(rngs, jax.nn.initializers.ones, (h,), ("heads",), pdt)
        self.norm_scale = param(rngs, jax.nn.initializers.ones, (vd,), ("head_dim",), pdt)
        self.out_proj = param(
            rngs,
            jax.nn.initializers.normal(out_std),
            (h, vd, d),
            ("heads", "head_dim", "embed"),
            pdt,
        )

    def _proj(self, spec, x, name):
        return matmul(spec, x, lora.kernel(self, name), self.dtype, fp8=self.fp8)

    def _conv(self, x_BxLxGxK, name, reset_BxL, tail_BxTxC):
        b, l, heads, width = x_BxLxGxK.shape
        w_WxC = getattr(self, name)[...].reshape(-1, heads * width)
        out_BxLxC, tail = delta_rule.causal_conv(
            x_BxLxGxK.reshape(b, l, heads * width), w_WxC, reset_BxL, tail_BxTxC
        )
        return out_BxLxC.reshape(b, l, heads, width), tail

    def __call__(
        self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None, windowed=None, prefix_BxL=None
    ):
        """`cache`: a `CacheView` with a linear state (generation); positions, `windowed` and
        `prefix_BxL` mean nothing to a recurrence (it is causal by construction)."""
        del positions_BxL, windowed, prefix_BxL
        q_BxLxGxK = self._proj("bld,dgk->blgk", x_BxLxD, "q_proj")
        k_BxLxGxK = self._proj("bld,dgk->blgk", x_BxLxD, "k_proj")
        v_BxLxHxV = self._proj("bld,dhv->blhv", x_BxLxD, "v_proj")
        z_BxLxHxV = self._proj("bld,dhv->blhv", x_BxLxD, "z_proj")
        b_BxLxH = matmul("bld,dh->blh", x_BxLxD, self.b_proj[...], self.dtype, jnp.float32)
        a_BxLxH = matmul("bld,dh->blh", x_BxLxD, self.a_proj[...], self.dtype, jnp.float32)
        beta_BxLxH = jax.nn.sigmoid(b_BxLxH)
        a_1x1xH = -jnp.exp(self.A_log[...].astype(jnp.float32))[None, None]
        dt_bias_1x1xH = self.dt_bias[...].astype(jnp.float32)[None, None]
        g_BxLxH = a_1x1xH * jax.nn.softplus(a_BxLxH + dt_bias_1x1xH)

        real_B = None  # real tokens per right-padded row (None: all)
        if cache is None:
            reset_BxL, tails, state = document_starts(segment_ids_BxL), (None,) * 3, None
        else:
            reset_BxL, tails, state = None, cache.linear_tails(), cache.linear_state()
            real_B = cache.lengths_B if cache.prefill else cache.real_B
        if real_B is not None:  # right-padded rows (prompts, the engine's chunks): padding
            # neither decays nor writes the state, and each row's tail ends at its last token
            l = x_BxLxD.shape[1]
            valid_BxLx1 = (jnp.arange(l)[None] < real_B[:, None])[..., None]
            beta_BxLxH = jnp.where(valid_BxLx1, beta_BxLxH, 0.0)
            g_BxLxH = jnp.where(valid_BxLx1, g_BxLxH, 0.0)
            raw = (q_BxLxGxK, k_BxLxGxK, v_BxLxHxV)
        q_BxLxGxK, tail_q = self._conv(q_BxLxGxK, "conv_q", reset_BxL, tails[0])
        k_BxLxGxK, tail_k = self._conv(k_BxLxGxK, "conv_k", reset_BxL, tails[1])
        v_BxLxHxV, tail_v = self._conv(v_BxLxHxV, "conv_v", reset_BxL, tails[2])
        new_tails = (tail_q, tail_k, tail_v)
        if real_B is not None:
            new_tails = tuple(_last_inputs(x, real_B, t) for x, t in zip(raw, tails))
        q_BxLxGxK = constrain(q_BxLxGxK, ("batch", "length", "act_heads", None))
        k_BxLxGxK = constrain(k_BxLxGxK, ("batch", "length", "act_heads", None))
        v_BxLxHxV = constrain(v_BxLxHxV, ("batch", "length", "act_heads", None))

        args = (q_BxLxGxK, k_BxLxGxK, v_BxLxHxV, g_BxLxH, beta_BxLxH, state, reset_BxL)
        if cache is not None and not cache.prefill and x_BxLxD.shape[1] == 1:
            o_BxLxHxV, state = delta_rule.recurrent(*args)
        else:
            o_BxLxHxV, state = delta_rule.chunked(*args, chunk=self.chunk)
        if cache is not None:
            cache = cache.write_linear(state, new_tails)
        out_BxLxD = self._out(o_BxLxHxV, z_BxLxHxV)
        return AttentionOutput(out_BxLxD, cache)

    def _out(self, o_BxLxHxV, z_BxLxHxV):
        """Gated RMSNorm per head (normalise, scale, then multiply by silu(z); float32), then
        the output projection."""
        o = o_BxLxHxV.astype(jnp.float32)
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
        o = o * self.norm_scale[...].astype(jnp.float32)[None, None, None]
        o = o * jax.nn.silu(z_BxLxHxV.astype(jnp.float32))
        return matmul(
            "blhv,hvd->bld",
            o.astype(self.dtype),
            lora.kernel(self, "out_proj"),
            self.dtype,
            fp8=self.fp8,
        )
