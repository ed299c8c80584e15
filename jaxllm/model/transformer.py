"""Decoder-only transformer; by default Llama-style (Touvron et al. 2023, arXiv:2302.13971):
pre-RMSNorm blocks of GQA attention with RoPE and a SwiGLU MLP, a final RMSNorm and an
(optionally tied) LM head. `ModelConfig` knobs reach GPT-2 (learned positions, LayerNorm, GELU,
biases), Mistral / Qwen (sliding windows, qkv biases, QK-norm) and Gemma 2 (sandwich norms,
GeGLU, soft caps, alternating local/global layers, embeddings scaled by sqrt(D)).

The N blocks are created stacked (every block parameter has a leading `layers` axis) and run
with `jax.lax.scan`, so compile time does not grow with depth and pipeline stages can later be
slices of the stack. Each block is optionally rematerialised (`ModelConfig.remat`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model.attention import Attention
from jaxllm.model.layers import Embed, make_norm, matmul, param
from jaxllm.model.mlp import MLP
from jaxllm.sharding import constrain

REMAT_POLICIES = {
    "full": None,  # save nothing but the block input; recompute the block in the backward pass
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.placement, self.dropout = cfg.norm_placement, cfg.dropout
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, out_std=out_std, rngs=rngs)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg, out_std=out_std, rngs=rngs)
        if cfg.norm_placement == "sandwich":
            self.post_attn_norm = make_norm(cfg)
            self.post_mlp_norm = make_norm(cfg)

    def _residual(self, x_BxLxD, f, norm, post_norm, key):
        """One residual branch in the configured norm placement."""
        if self.placement == "post":
            return norm(x_BxLxD + _dropout(f(x_BxLxD), self.dropout, key))
        y_BxLxD = f(norm(x_BxLxD))
        if post_norm is not None:
            y_BxLxD = post_norm(y_BxLxD)
        return x_BxLxD + _dropout(y_BxLxD, self.dropout, key)

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None, *, windowed=None,
                 key=None):  # fmt: skip
        """`windowed`: whether this layer's attention is windowed (traced, from the scan) when
        layers differ; `key`: dropout rng (training only)."""
        keys = (None, None) if key is None else tuple(jax.random.split(key))

        def attn(h_BxLxD):
            nonlocal cache
            if cache is None:
                return self.attn(h_BxLxD, positions_BxL, segment_ids_BxL, windowed=windowed)
            out_BxLxD, cache = self.attn(h_BxLxD, positions_BxL, segment_ids_BxL, cache,
                                         windowed=windowed)  # fmt: skip
            return out_BxLxD

        post = self.placement == "sandwich"
        x_BxLxD = self._residual(x_BxLxD, attn, self.attn_norm,
                                 self.post_attn_norm if post else None, keys[0])  # fmt: skip
        x_BxLxD = self._residual(x_BxLxD, self.mlp, self.mlp_norm,
                                 self.post_mlp_norm if post else None, keys[1])  # fmt: skip
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "act_embed"))
        return x_BxLxD if cache is None else (x_BxLxD, cache)


class Transformer(nnx.Module):
    """tokens [B, L] int -> logits [B, L, V] float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = Embed(
            cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=dtype, param_dtype=pdt,
            rngs=rngs,
        )  # fmt: skip
        if cfg.position == "learned":
            init = jax.nn.initializers.normal(cfg.init_std)
            self.pos_embed = param(
                rngs, init, (cfg.max_seq_len, cfg.d_model), ("positions", "embed"), pdt
            )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(
            in_axes=0,
            out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: "layers", "axes": "layers"},
        )
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.layers = stacked_blocks(rngs)
        if cfg.norm_placement != "post":  # post-norm blocks already end on a norm
            self.final_norm = make_norm(cfg)
        if not cfg.tie_embeddings:
            init = jax.nn.initializers.normal(cfg.init_std)
            self.lm_head = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)

    def __call__(self, tokens_BxL=None, *, positions_BxL=None, segment_ids_BxL=None,
                 embeddings_BxLxD=None, cache=None, logits_at_BxQ=None, dropout_key=None):  # fmt: skip
        """Either tokens or input embeddings (for soft prompts, and gradient tests) go in.

        Generation passes a KV `cache` (`jaxllm.infer.kv_cache.CacheView`; the result is then
        `(logits, cache)`) and `logits_at_BxQ`, the positions along L whose logits it needs, so
        a long prefill never materialises [B, L, V] logits. `dropout_key` (training) turns on
        dropout when `cfg.dropout` > 0.
        """
        cfg = self.cfg
        if (tokens_BxL is None) == (embeddings_BxLxD is None):
            raise ValueError("pass exactly one of tokens_BxL and embeddings_BxLxD")
        if embeddings_BxLxD is None:
            embeddings_BxLxD = self.embed(tokens_BxL)
        b, l = embeddings_BxLxD.shape[:2]
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones((b, l), jnp.int32)
        dtype = jnp.dtype(cfg.dtype)
        x_BxLxD = embeddings_BxLxD.astype(dtype)
        if cfg.scale_embeddings:  # in the compute dtype, as Gemma does
            x_BxLxD = x_BxLxD * jnp.asarray(math.sqrt(cfg.d_model), dtype)
        if cfg.position == "learned":
            pos_BxLxD = jnp.take(self.pos_embed[...], positions_BxL, axis=0, mode="clip")
            x_BxLxD = x_BxLxD + pos_BxLxD.astype(dtype)
        keys = None
        if dropout_key is not None and cfg.dropout > 0:
            embed_key, layers_key = jax.random.split(dropout_key)
            x_BxLxD = _dropout(x_BxLxD, cfg.dropout, embed_key)
            keys = jax.random.split(layers_key, cfg.num_layers)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "act_embed"))

        # Per-layer inputs of the scan: parameters, and when layers differ their window flag
        # and dropout key; with a cache, the layer index.
        windows = cfg.layer_windows()
        per_layer = {
            "windowed": None if windows is None or cfg.global_every == 0
            else jnp.asarray(windows, jnp.int32) > 0,
            "key": keys,
        }  # fmt: skip
        block_def, stacked_state = nnx.split(self.layers)
        if cache is None:

            def body(x_BxLxD, xs):
                layer_state, extra = xs
                block = nnx.merge(block_def, layer_state)
                return block(x_BxLxD, positions_BxL, segment_ids_BxL, **extra), None

            if cfg.remat != "none":
                body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
            x_BxLxD, _ = jax.lax.scan(
                body, x_BxLxD, (stacked_state, per_layer), unroll=cfg.scan_unroll
            )
        else:  # the cache of all layers rides in the carry; each block updates its own layer

            def body(carry, xs):
                x_BxLxD, cache = carry
                layer_state, extra, layer = xs
                block = nnx.merge(block_def, layer_state)
                return block(
                    x_BxLxD, positions_BxL, segment_ids_BxL, cache.at_layer(layer), **extra
                ), None

            layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (x_BxLxD, cache), _ = jax.lax.scan(
                body, (x_BxLxD, cache), (stacked_state, per_layer, layers), unroll=cfg.scan_unroll
            )

        if logits_at_BxQ is not None:
            x_BxLxD = jnp.take_along_axis(x_BxLxD, logits_at_BxQ[:, :, None], axis=1)
        if cfg.norm_placement != "post":
            x_BxLxD = self.final_norm(x_BxLxD)
        if cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            logits_BxLxV = matmul("bld,dv->blv", x_BxLxD, self.lm_head[...], dtype, jnp.float32)
        if cfg.final_soft_cap is not None:
            cap = jnp.float32(cfg.final_soft_cap)
            logits_BxLxV = cap * jnp.tanh(logits_BxLxV / cap)
        logits_BxLxV = constrain(logits_BxLxV, ("batch", "length", "act_vocab"))
        return logits_BxLxV if cache is None else (logits_BxLxV, cache)


def build(cfg: ModelConfig, seed: int | jax.Array = 0) -> Transformer:
    """A model with freshly initialised parameters (on the default device)."""
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    return Transformer(cfg, rngs=nnx.Rngs(params=key))


def logical_axes(state) -> dict:
    """A model's (abstract) `nnx.State` -> nested dict of logical-axes tuples, like its params."""
    return {
        k: tuple(v.get_metadata()["axes"]) if isinstance(v, nnx.Variable) else logical_axes(v)
        for k, v in state.items()
    }
