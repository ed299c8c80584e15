"""Llama-style decoder (Touvron et al. 2023, arXiv:2302.13971): pre-RMSNorm blocks of GQA
attention with RoPE and a SwiGLU MLP, a final RMSNorm and an (optionally tied) LM head.

The N blocks are created stacked (every block parameter has a leading `layers` axis) and run
with `jax.lax.scan`, so compile time does not grow with depth and pipeline stages can later be
slices of the stack. Each block is optionally rematerialised (`ModelConfig.remat`).

With mixture-of-experts layers (`ModelConfig.moe`) there are two kinds of blocks: the first k
dense blocks form the stack `layers`, and the rest repeat a pattern of (moe_every - 1) dense
blocks and one MoE block, stacked as `moe_layers` (each element a `MoEGroup`) and scanned the
same way, so any "first k dense, then every n-th MoE" layout is one or two scans.
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
from jaxllm.model.moe import MoE
from jaxllm.sharding import constrain

REMAT_POLICIES = {
    "full": None,  # save nothing but the block input; recompute the block in the backward pass
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-norm attention and feed-forward (a SwiGLU, or with `moe=True` an MoE layer).
    Returns (x, stats): the MoE layer's routing statistics, {} for a dense block."""

    def __init__(self, cfg: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs):
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        norm = dict(eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        self.is_moe = moe
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, out_std=out_std, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        ffn = dict(init_std=cfg.init_std, out_std=out_std, dtype=dtype, param_dtype=pdt, rngs=rngs)
        if moe:
            self.mlp = MoE(cfg.d_model, cfg.resolved_expert_mlp_dim, cfg.moe, **ffn)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.mlp_dim, **ffn)

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
        x_BxLxD = x_BxLxD + self.attn(self.attn_norm(x_BxLxD), positions_BxL, segment_ids_BxL)
        if self.is_moe:
            y_BxLxD, stats = self.mlp(self.mlp_norm(x_BxLxD))
        else:
            y_BxLxD, stats = self.mlp(self.mlp_norm(x_BxLxD)), {}
        return constrain(x_BxLxD + y_BxLxD, ("batch", "length", "act_embed")), stats


def _stack(n: int, make, rngs: nnx.Rngs):
    """n modules `make(rngs)` created at once, every variable with a leading `layers` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(
        in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers", "axes": "layers"}
    )
    def stacked(rngs: nnx.Rngs):
        return make(rngs)

    return stacked(rngs)


def _body(graphdef, call, cfg: ModelConfig, remat: bool):
    """(x, module state) -> call(module, x), rematerialised per `cfg.remat`."""

    def body(x_BxLxD, state):
        return call(nnx.merge(graphdef, state), x_BxLxD)

    if remat and cfg.remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    return body


def _scan(stack, x_BxLxD, call, cfg: ModelConfig, remat: bool = True):
    """`call(module, x) -> (x, stats)` over the elements of a stacked module; returns x and the
    stats stacked along a leading axis."""
    graphdef, state = nnx.split(stack)
    body = _body(graphdef, call, cfg, remat)
    return jax.lax.scan(body, x_BxLxD, state, unroll=cfg.scan_unroll)


class MoEGroup(nnx.Module):
    """One repeat of the MoE layout: moe_every - 1 dense blocks (stacked), then an MoE block."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n_dense = cfg.moe.moe_every - 1
        self.dense = _stack(n_dense, lambda r: Block(cfg, rngs=r), rngs) if n_dense else None
        self.moe = Block(cfg, moe=True, rngs=rngs)


class Transformer(nnx.Module):
    """tokens [B, L] int -> logits [B, L, V] float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed = Embed(
            cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, dtype=dtype, param_dtype=pdt,
            rngs=rngs,
        )  # fmt: skip

        moe = cfg.moe
        n_dense = moe.first_dense_layers if moe.enabled else cfg.num_layers
        self.layers = _stack(n_dense, lambda r: Block(cfg, rngs=r), rngs) if n_dense else None
        if moe.enabled:
            groups = (cfg.num_layers - n_dense) // moe.moe_every
            self.moe_layers = _stack(groups, lambda r: MoEGroup(cfg, rngs=r), rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype, param_dtype=pdt)
        if not cfg.tie_embeddings:
            init = jax.nn.initializers.normal(cfg.init_std)
            self.lm_head = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)

    def __call__(self, tokens_BxL=None, *, positions_BxL=None, segment_ids_BxL=None,
                 embeddings_BxLxD=None, return_aux: bool = False):  # fmt: skip
        """Either tokens or input embeddings (for soft prompts, and gradient tests) go in.

        With `return_aux`, returns (logits, aux): for MoE models aux holds the mean
        `aux_loss` and `router_z_loss` over MoE layers, `expert_counts` [N_moe, E] and the
        number of `dropped` assignments; {} for dense models."""
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

        def block(module, x_BxLxD):
            return module(x_BxLxD, positions_BxL, segment_ids_BxL)

        def group(module, x_BxLxD):
            if module.dense is not None:
                x_BxLxD, _ = _scan(module.dense, x_BxLxD, block, self.cfg)
            graphdef, state = nnx.split(module.moe)
            return _body(graphdef, block, self.cfg, remat=True)(x_BxLxD, state)

        aux = {}
        if self.layers is not None:
            x_BxLxD, _ = _scan(self.layers, x_BxLxD, block, self.cfg)
        if self.cfg.moe.enabled:
            x_BxLxD, stats = _scan(self.moe_layers, x_BxLxD, group, self.cfg, remat=False)
            aux = {
                "aux_loss": jnp.mean(stats["aux_loss"]),
                "router_z_loss": jnp.mean(stats["router_z_loss"]),
                "expert_counts": stats["expert_counts"],
                "dropped": jnp.sum(stats["dropped"]),
            }

        x_BxLxD = self.final_norm(x_BxLxD)
        if self.cfg.tie_embeddings:
            logits_BxLxV = self.embed.attend(x_BxLxD)
        else:
            dtype = jnp.dtype(self.cfg.dtype)
            logits_BxLxV = matmul("bld,dv->blv", x_BxLxD, self.lm_head[...], dtype, jnp.float32)
        logits_BxLxV = constrain(logits_BxLxV, ("batch", "length", "act_vocab"))
        return (logits_BxLxV, aux) if return_aux else logits_BxLxV


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
