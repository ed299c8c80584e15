"""Llama-style decoder (Touvron et al. 2023, arXiv:2302.13971): pre-RMSNorm blocks of GQA
attention with RoPE and a SwiGLU MLP, a final RMSNorm and an (optionally tied) LM head.

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
from jaxllm.model.layers import Embed, RMSNorm, matmul, param
from jaxllm.model.mlp import SwiGLU
from jaxllm.sharding import constrain

REMAT_POLICIES = {
    "full": None,  # save nothing but the block input; recompute the block in the backward pass
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, out_std=out_std, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        self.mlp = SwiGLU(
            cfg.d_model, cfg.mlp_dim, init_std=cfg.init_std, out_std=out_std,
            dtype=dtype, param_dtype=pdt, rngs=rngs,
        )  # fmt: skip

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None):
        h_BxLxD = self.attn_norm(x_BxLxD)
        if cache is None:
            x_BxLxD = x_BxLxD + self.attn(h_BxLxD, positions_BxL, segment_ids_BxL)
        else:
            attn_BxLxD, cache = self.attn(h_BxLxD, positions_BxL, segment_ids_BxL, cache)
            x_BxLxD = x_BxLxD + attn_BxLxD
        x_BxLxD = x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))
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

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(
            in_axes=0,
            out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: "layers", "axes": "layers"},
        )
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.layers = stacked_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        if not cfg.tie_embeddings:
            init = jax.nn.initializers.normal(cfg.init_std)
            self.lm_head = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)

    def __call__(self, tokens_BxL=None, *, positions_BxL=None, segment_ids_BxL=None,
                 embeddings_BxLxD=None, cache=None, logits_at_BxQ=None):  # fmt: skip
        """Either tokens or input embeddings (for soft prompts, and gradient tests) go in.

        Generation passes a KV `cache` (`jaxllm.infer.kv_cache.CacheView`; the result is then
        `(logits, cache)`) and `logits_at_BxQ`, the positions along L whose logits it needs, so
        a long prefill never materialises [B, L, V] logits.
        """
        if (tokens_BxL is None) == (embeddings_BxLxD is None):
            raise ValueError("pass exactly one of tokens_BxL and embeddings_BxLxD")
        if embeddings_BxLxD is None:
            embeddings_BxLxD = self.embed(tokens_BxL)
        b, l = embeddings_BxLxD.shape[:2]
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones((b, l), jnp.int32)
        x_BxLxD = embeddings_BxLxD.astype(jnp.dtype(self.cfg.dtype))
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "act_embed"))

        block_def, stacked_state = nnx.split(self.layers)
        if cache is None:

            def body(x_BxLxD, layer_state):
                block = nnx.merge(block_def, layer_state)
                return block(x_BxLxD, positions_BxL, segment_ids_BxL), None

            if self.cfg.remat != "none":
                body = jax.checkpoint(
                    body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False
                )
            x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, stacked_state, unroll=self.cfg.scan_unroll)
        else:  # the cache of all layers rides in the carry; each block updates its own layer

            def body(carry, xs):
                x_BxLxD, cache = carry
                layer_state, layer = xs
                block = nnx.merge(block_def, layer_state)
                return block(x_BxLxD, positions_BxL, segment_ids_BxL, cache.at_layer(layer)), None

            layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
            (x_BxLxD, cache), _ = jax.lax.scan(
                body, (x_BxLxD, cache), (stacked_state, layers), unroll=self.cfg.scan_unroll
            )

        if logits_at_BxQ is not None:
            x_BxLxD = jnp.take_along_axis(x_BxLxD, logits_at_BxQ[:, :, None], axis=1)
        x_BxLxD = self.final_norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            dtype = jnp.dtype(self.cfg.dtype)
            logits_BxLxV = matmul("bld,dv->blv", x_BxLxD, self.lm_head[...], dtype, jnp.float32)
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
