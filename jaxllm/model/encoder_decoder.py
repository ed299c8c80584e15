"""T5-style encoder–decoder (Raffel et al. 2020, arXiv:1910.10683): `model.kind=encoder_decoder`.

An encoder stack (bidirectional self-attention and MLP) reads the inputs; a decoder stack
(causal self-attention, cross-attention over the encoder output, MLP) predicts the targets. Both
stacks are pre-norm, stacked along a `layers` axis and scanned like `Transformer`, optionally
rematerialised, and share one token embedding. With `model.position=relative` each stack has one
T5 relative position bias table (`relative_position.py`: bidirectional in the encoder,
unidirectional in the decoder) whose bias every layer of the stack adds; cross-attention has no
position bias. T5 v1.0 is RMSNorm (T5's LayerNorm has no mean and no bias), ReLU MLPs and a head
tied to the embedding whose input is scaled by d_model**-0.5 (`model.scale_head_input`); v1.1 is
gated-GELU and an untied, unscaled head. T5 does not scale its logits (`model.attn_scale=1`).

Every attention runs through `dot_product_attention`: the encoder non-causal with segment ids
(0 marks padding), the decoder causal, cross-attention non-causal with decoder queries (L) over
encoder keys (S). A relative bias is XLA-only; cross-attention takes the flash kernel too.

Generation (`jaxllm.infer.seq2seq`): `encode` once; `cross_kv` projects the encoder output to
every decoder layer's keys and values once, into a `CacheView` (any cache dtype); each `decode`
step writes its keys and values into the self-attention cache and reads both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels.decode_attention.reference import (
    attend_partial,
    dequantize_cache,
    queries_from_rows,
    rows_from_queries,
)
from jaxllm.model import lora
from jaxllm.model.attention import dot_product_attention
from jaxllm.model.layers import Embed, make_norm, matmul, param
from jaxllm.model.mlp import MLP
from jaxllm.model.outputs import ModelOutput
from jaxllm.model.relative_position import RelativeBias
from jaxllm.model.remat import policy
from jaxllm.model.transformer import MODEL_KINDS
from jaxllm.sharding import constrain


def _dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def _stack(n: int, make, rngs: nnx.Rngs):
    """n modules `make(rngs)` created at once, every variable with a leading `layers` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(
        in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers", "axes": "layers"}
    )
    def stacked(rngs: nnx.Rngs):
        return make(rngs)

    return stacked(rngs)


class SeqAttention(nnx.Module):
    """Multi-head (or grouped-query) attention without rotary positions: self-attention (q, k, v
    from x) or cross-attention (k, v from the encoder output), no biases, as T5."""

    def __init__(self, cfg, *, out_std: float, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pdt, init = jnp.dtype(cfg.param_dtype), jax.nn.initializers.normal(cfg.init_std)
        self.dtype, self.impl, self.fp8 = jnp.dtype(cfg.dtype), cfg.attention_impl, cfg.fp8
        self.scale = cfg.attn_scale
        self.q_proj = param(rngs, init, (d, h, k), ("embed", "heads", "head_dim"), pdt)
        self.k_proj = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pdt)
        self.v_proj = param(rngs, init, (d, g, k), ("embed", "kv_heads", "head_dim"), pdt)
        out = jax.nn.initializers.normal(out_std)
        self.o_proj = param(rngs, out, (h, k, d), ("heads", "head_dim", "embed"), pdt)

    def _proj(self, spec, x, name):
        kernel = lora.kernel(self, f"{name}_proj")
        return matmul(spec, x, kernel, self.dtype, fp8=self.fp8)

    def kv(self, x_BxSxD):
        """(k, v) [B, S, G, K] of keys/values from x."""
        return self._proj("bsd,dgk->bsgk", x_BxSxD, "k"), self._proj("bsd,dgk->bsgk", x_BxSxD, "v")

    def out(self, o_BxLxHxK):
        o_proj = lora.kernel(self, "o_proj")
        return matmul("blhk,hkd->bld", o_BxLxHxK, o_proj, self.dtype, fp8=self.fp8)

    def __call__(self, x_BxLxD, kv_BxSxD, *, q_seg, kv_seg, causal, bias_HxLxS=None):
        q_BxLxHxK = self._proj("bld,dhk->blhk", x_BxLxD, "q")
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "act_heads", None))
        k_BxSxGxK, v_BxSxGxK = self.kv(kv_BxSxD)
        o_BxLxHxK = dot_product_attention(
            q_BxLxHxK,
            k_BxSxGxK,
            v_BxSxGxK,
            q_segment_ids_BxL=q_seg,
            kv_segment_ids_BxS=kv_seg,
            causal=causal,
            scale=self.scale,
            bias_HxLxS=bias_HxLxS,
            impl="xla" if bias_HxLxS is not None else self.impl,
        )
        return self.out(o_BxLxHxK)

    def decode_self(self, x_BxQxD, view, bias):
        """Cached self-attention of Q new tokens: written into `view`, then attended over
        every cached token up to each query (any cache dtype; `bias(q_pos, k_pos)` [B, H, Q,
        T] adds the relative positions, or None). Returns (out, view)."""
        q_BxQxHxK = self._proj("bld,dhk->blhk", x_BxQxD, "q")
        view = view.write(*self.kv(x_BxQxD))
        k_BxGxTxK, v_BxGxTxK = dequantize_cache(view.kv, view.lengths_B, layer=view.layer)
        b, nq, h, _ = q_BxQxHxK.shape
        g, t = k_BxGxTxK.shape[1], k_BxGxTxK.shape[2]
        q_pos_BxQ = view.lengths_B[:, None] - nq + jnp.arange(nq, dtype=jnp.int32)[None]
        k_pos_T = jnp.arange(t, dtype=jnp.int32)
        visible_BxQxT = k_pos_T[None, None, :] <= q_pos_BxQ[:, :, None]
        visible_BxMxT = jnp.tile(visible_BxQxT, (1, h // g, 1))
        bias_BxGxMxT = None
        if bias is not None:
            bias_BxHxQxT = bias(q_pos_BxQ, k_pos_T)
            bias_BxQxHxT = bias_BxHxQxT.transpose(0, 2, 1, 3)
            bias_BxGxMxT = rows_from_queries(bias_BxQxHxT, g)
        out_BxGxMxK, _ = attend_partial(
            rows_from_queries(q_BxQxHxK, g),
            k_BxGxTxK,
            v_BxGxTxK,
            visible_BxMxT,
            sm_scale=q_BxQxHxK.shape[-1] ** -0.5 if self.scale is None else self.scale,
            soft_cap=None,
            bias_BxGxMxT=bias_BxGxMxT,
        )
        o_BxQxHxK = queries_from_rows(out_BxGxMxK, nq).astype(self.dtype)
        return self.out(o_BxQxHxK), view


class EncoderBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        out_std = cfg.init_std
        self.dropout = cfg.dropout
        self.attn_norm = make_norm(cfg)
        self.attn = SeqAttention(cfg, out_std=out_std, rngs=rngs)
        self.mlp_norm = make_norm(cfg)
        self.mlp = _mlp(cfg, out_std, rngs)

    def __call__(self, x_BxSxD, seg_BxS, bias_HxSxS, key=None):
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        h = self.attn_norm(x_BxSxD)
        a = self.attn(h, h, q_seg=seg_BxS, kv_seg=seg_BxS, causal=False, bias_HxLxS=bias_HxSxS)
        x_BxSxD = x_BxSxD + _dropout(a, self.dropout, keys[0])
        x_BxSxD = x_BxSxD + _dropout(self.mlp(self.mlp_norm(x_BxSxD)), self.dropout, keys[1])
        return constrain(x_BxSxD, ("batch", "length", "act_embed"))


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        out_std = cfg.init_std
        self.dropout = cfg.dropout
        self.attn_norm = make_norm(cfg)
        self.attn = SeqAttention(cfg, out_std=out_std, rngs=rngs)
        self.cross_norm = make_norm(cfg)
        self.cross_attn = SeqAttention(cfg, out_std=out_std, rngs=rngs)
        self.mlp_norm = make_norm(cfg)
        self.mlp = _mlp(cfg, out_std, rngs)

    def __call__(self, x, enc_BxSxD, q_seg, kv_seg, bias, key=None, view=None, cross=None):
        """Training: `bias` is [H, L, L]; decoding (`view`, `cross`: the layer's cache views),
        `bias` is the callable of `SeqAttention.decode_self`. Returns (x, view)."""
        keys = (None,) * 3 if key is None else tuple(jax.random.split(key, 3))
        h = self.attn_norm(x)
        if view is None:
            a = self.attn(h, h, q_seg=q_seg, kv_seg=q_seg, causal=True, bias_HxLxS=bias)
        else:
            a, view = self.attn.decode_self(h, view, bias)
        x = x + _dropout(a, self.dropout, keys[0])
        h = self.cross_norm(x)
        if cross is None:
            c = self.cross_attn(h, enc_BxSxD, q_seg=q_seg, kv_seg=kv_seg, causal=False)
        else:
            q = self.cross_attn._proj("bld,dhk->blhk", h, "q")
            c = self.cross_attn.out(cross.attend(q, sm_scale=self.cross_attn.scale))
        x = x + _dropout(c, self.dropout, keys[1])
        x = x + _dropout(self.mlp(self.mlp_norm(x)), self.dropout, keys[2])
        return constrain(x, ("batch", "length", "act_embed")), view


def _mlp(cfg, out_std, rngs):
    return MLP(
        cfg.d_model,
        cfg.mlp_dim,
        cfg.mlp_activation,
        gelu_approximate=cfg.gelu_approximate,
        bias=cfg.mlp_bias,
        init_std=cfg.init_std,
        out_std=out_std,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        fp8=cfg.fp8,
        rngs=rngs,
    )


def _relative_bias(cfg, bidirectional: bool, rngs):
    return RelativeBias(
        cfg.num_heads,
        bidirectional=bidirectional,
        num_buckets=cfg.relative.num_buckets,
        max_distance=cfg.relative.max_distance,
        init_std=cfg.init_std,
        param_dtype=jnp.dtype(cfg.param_dtype),
        rngs=rngs,
    )


class EncoderDecoder(nnx.Module):
    """(input ids [B, S], decoder input ids [B, L]) -> decoder logits [B, L, V] (float32)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg.validate()  # a ModelConfig built in Python is checked here
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = Embed(
            cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=dtype, param_dtype=pdt,
            rngs=rngs,
        )  # fmt: skip
        relative = cfg.position == "relative"
        self.encoder_bias = _relative_bias(cfg, True, rngs) if relative else None
        self.encoder = _stack(cfg.num_layers, lambda r: EncoderBlock(cfg, rngs=r), rngs)
        self.encoder_norm = make_norm(cfg)
        self.decoder_bias = _relative_bias(cfg, False, rngs) if relative else None
        n_dec = cfg.resolved_decoder_layers
        self.decoder = _stack(n_dec, lambda r: DecoderBlock(cfg, rngs=r), rngs)
        self.final_norm = make_norm(cfg)
        if not cfg.tie_embeddings:
            init = jax.nn.initializers.normal(cfg.init_std)
            self.lm_head = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)

    def _remat(self, body, cache):
        if cache or self.cfg.remat in ("none", "auto"):  # auto: resolved before training
            return body
        return jax.checkpoint(body, policy=policy(self.cfg.remat), prevent_cse=False)

    def _keys(self, key, n):
        return None if key is None or self.cfg.dropout == 0 else jax.random.split(key, n)

    def encode(self, tokens_BxS, segment_ids_BxS=None, *, dropout_key=None) -> jax.Array:
        """The encoder output [B, S, D] (after its final norm). `segment_ids_BxS`: 0 marks
        padding (default: no padding)."""
        b, s = tokens_BxS.shape
        seg_BxS = jnp.ones((b, s), jnp.int32) if segment_ids_BxS is None else segment_ids_BxS
        key = jax.random.split(dropout_key)[0] if dropout_key is not None else None
        x = _dropout(self.embed(tokens_BxS), self.cfg.dropout, key)
        x = constrain(x, ("batch", "length", "act_embed"))
        pos_S = jnp.arange(s, dtype=jnp.int32)
        bias = None if self.encoder_bias is None else self.encoder_bias(pos_S, pos_S)
        graphdef, state = nnx.split(self.encoder)
        keys = self._keys(dropout_key, self.cfg.num_layers)

        def body(x, xs):
            st, k = xs
            return nnx.merge(graphdef, st)(x, seg_BxS, bias, k), None

        x, _ = jax.lax.scan(self._remat(body, False), x, (state, keys))
        return self.encoder_norm(x)

    def _head(self, x_BxLxD) -> jax.Array:
        cfg = self.cfg
        x_BxLxD = self.final_norm(x_BxLxD)
        if cfg.scale_head_input:  # T5 v1.0 (tied head)
            x_BxLxD = x_BxLxD * jnp.asarray(cfg.d_model**-0.5, x_BxLxD.dtype)
        if cfg.tie_embeddings:
            logits = self.embed.attend(x_BxLxD)
        else:
            head = lora.kernel(self, "lm_head")
            logits = matmul("bld,dv->blv", x_BxLxD, head, jnp.dtype(cfg.dtype), jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))

    def decode(
        self,
        decoder_tokens_BxL,
        encoded_BxSxD,
        segment_ids_BxS=None,
        *,
        cache=None,
        cross=None,
        dropout_key=None,
    ) -> ModelOutput:
        """Decoder logits [B, L, V]. Training: over the whole decoder input (causal). Decoding:
        `cache` (the self-attention `CacheView`, written here and returned) and `cross` (the
        `CacheView` of `cross_kv`) instead of the encoder output."""
        b, l = decoder_tokens_BxL.shape
        x = self.embed(decoder_tokens_BxL)
        if dropout_key is not None:
            x = _dropout(x, self.cfg.dropout, jax.random.split(dropout_key)[1])
        x = constrain(x, ("batch", "length", "act_embed"))
        n = self.cfg.resolved_decoder_layers
        q_seg = jnp.ones((b, l), jnp.int32)
        if cache is None:
            s = encoded_BxSxD.shape[1]
            kv_seg = jnp.ones((b, s), jnp.int32) if segment_ids_BxS is None else segment_ids_BxS
            pos_L = jnp.arange(l, dtype=jnp.int32)
            rel = self.decoder_bias
            bias = None if rel is None else rel(pos_L, pos_L)
        else:
            kv_seg, rel = None, self.decoder_bias
            bias = None if rel is None else jax.vmap(rel, in_axes=(0, None))
        graphdef, state = nnx.split(self.decoder)
        keys = self._keys(None if dropout_key is None else jax.random.fold_in(dropout_key, 1), n)

        def body(carry, xs):
            x, view = carry
            st, k, layer = xs
            block = nnx.merge(graphdef, st)
            if view is None:
                x, _ = block(x, encoded_BxSxD, q_seg, kv_seg, bias, k)
                return (x, None), None
            x, view = block(
                x, None, q_seg, None, bias, None, view.at_layer(layer), cross.at_layer(layer)
            )
            return (x, view), None

        layers = jnp.arange(n, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(
            self._remat(body, cache is not None), (x, cache), (state, keys, layers)
        )
        return ModelOutput(self._head(x), cache)

    def cross_kv(self, encoded_BxSxD, view):
        """Writes every decoder layer's cross-attention keys/values of the encoder output into
        `view` (a prefill `CacheView` over the encoder length, lengths = valid encoder
        tokens); returns it."""
        graphdef, state = nnx.split(self.decoder)

        def body(view, xs):
            st, layer = xs
            block = nnx.merge(graphdef, st)
            k, v = block.cross_attn.kv(encoded_BxSxD)
            return view.at_layer(layer).write(k, v), None

        layers = jnp.arange(self.cfg.resolved_decoder_layers, dtype=jnp.int32)
        view, _ = jax.lax.scan(body, view, (state, layers))
        return view

    def after_step(self, model_state: dict, stats: dict, keep: jax.Array):
        """No non-trained state (dense blocks): nothing changes after a train step."""
        return model_state, {}

    def __call__(
        self,
        input_ids_BxS,
        decoder_input_ids_BxL,
        *,
        segment_ids_BxS=None,
        dropout_key=None,
    ) -> ModelOutput:
        """Decoder logits of `decoder_input_ids` given the encoder's `input_ids` (0 in
        `segment_ids_BxS` marks encoder padding)."""
        encoded = self.encode(input_ids_BxS, segment_ids_BxS, dropout_key=dropout_key)
        return self.decode(decoder_input_ids_BxL, encoded, segment_ids_BxS, dropout_key=dropout_key)


MODEL_KINDS["encoder_decoder"] = EncoderDecoder
