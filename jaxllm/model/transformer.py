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

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL, segment_ids_BxL)
        x_BxLxD = x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))
        return constrain(x_BxLxD, ("batch", "length", "act_embed"))


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
                 embeddings_BxLxD=None):  # fmt: skip
        """Either tokens or input embeddings (for soft prompts, and gradient tests) go in."""
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

        def body(x_BxLxD, layer_state):
            block = nnx.merge(block_def, layer_state)
            return block(x_BxLxD, positions_BxL, segment_ids_BxL), None

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        x_BxLxD, _ = jax.lax.scan(body, x_BxLxD, stacked_state, unroll=self.cfg.scan_unroll)

        x_BxLxD = self.final_norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            dtype = jnp.dtype(self.cfg.dtype)
            logits_BxLxV = matmul("bld,dv->blv", x_BxLxD, self.lm_head[...], dtype, jnp.float32)
        return constrain(logits_BxLxV, ("batch", "length", "act_vocab"))


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
