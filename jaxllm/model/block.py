"""A transformer block (`Block`: attention and feed-forward residual branches in the configured
norm placement), the MoE layout's repeating group (`MoEGroup`) and `stack`, which creates n
blocks at once along a leading `layers` axis for the layer scan of `jaxllm.model.transformer`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.model import bottleneck, lora
from jaxllm.model.layers import make_norm
from jaxllm.model.mla import make_attention
from jaxllm.model.mlp import MLP
from jaxllm.model.moe import MoE
from jaxllm.sharding import constrain


def apply_dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


class Block(nnx.Module):
    """Attention and feed-forward residual branches in the configured norm placement; the
    feed-forward is the configured MLP, or with `moe=True` an MoE layer.

    Returns (x, cache, stats): the updated cache (None without one) and the MoE layer's
    routing statistics ({} for a dense block)."""

    # the sublayers whose outputs get bottleneck adapters (peft.method=adapter)
    ADAPTER_SITES = ("attn", "mlp")

    def __init__(
        self, cfg: ModelConfig, *, moe: bool = False, linear: bool = False, rngs: nnx.Rngs
    ):
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.placement, self.dropout, self.is_moe = cfg.norm_placement, cfg.dropout, moe
        self.attn_norm = make_norm(cfg)
        self.attn = make_attention(cfg, out_std=out_std, rngs=rngs, linear=linear)
        self.mlp_norm = make_norm(cfg)
        dtype, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        if moe:
            self.mlp = MoE(
                cfg.d_model,
                cfg.resolved_expert_mlp_dim,
                cfg.moe,
                init_std=cfg.init_std,
                out_std=out_std,
                dtype=dtype,
                param_dtype=pdt,
                fp8=cfg.fp8,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(
                cfg.d_model,
                cfg.mlp_dim,
                cfg.mlp_activation,
                gelu_approximate=cfg.gelu_approximate,
                bias=cfg.mlp_bias,
                init_std=cfg.init_std,
                out_std=out_std,
                dtype=dtype,
                param_dtype=pdt,
                fp8=cfg.fp8,
                rngs=rngs,
            )
        if cfg.norm_placement == "sandwich":
            self.post_attn_norm = make_norm(cfg)
            self.post_mlp_norm = make_norm(cfg)

    def _residual(self, x_BxLxD, f, norm, post_norm, key):
        """One residual branch in the configured norm placement."""
        if self.placement == "post":
            return norm(x_BxLxD + apply_dropout(f(x_BxLxD), self.dropout, key))
        y_BxLxD = f(norm(x_BxLxD))
        if post_norm is not None:
            y_BxLxD = post_norm(y_BxLxD)
        return x_BxLxD + apply_dropout(y_BxLxD, self.dropout, key)

    def __call__(
        self,
        x_BxLxD,
        positions_BxL,
        segment_ids_BxL,
        cache=None,
        *,
        windowed=None,
        key=None,
        prefix_BxL=None,
    ):
        """`windowed`: whether this layer's attention is windowed (traced, from the scan) when
        layers differ; `key`: dropout rng (training only); `prefix_BxL`: a prefix LM's
        bidirectional prefix (see `dot_product_attention`)."""
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        lora_key = None if key is None else jax.random.fold_in(key, 0x10AA)
        stats = {}

        def attn(h_BxLxD):
            nonlocal cache
            h_BxLxD = _gathered(h_BxLxD)
            out_BxLxD, cache = self.attn(
                h_BxLxD, positions_BxL, segment_ids_BxL, cache, windowed, prefix_BxL
            )
            return bottleneck.apply(self, "attn", out_BxLxD)

        def mlp(h_BxLxD):
            nonlocal stats
            if self.is_moe:  # a dense MLP gathers its own input (or rings it: collective matmul)
                h_BxLxD = _gathered(h_BxLxD)
            if not self.is_moe:
                return bottleneck.apply(self, "mlp", self.mlp(h_BxLxD))
            y_BxLxD, stats = self.mlp(h_BxLxD)
            return bottleneck.apply(self, "mlp", y_BxLxD)

        post = self.placement == "sandwich"
        with lora.dropout_keys(lora_key):  # the adapters' input dropout (peft.dropout)
            x_BxLxD = self._residual(
                x_BxLxD, attn, self.attn_norm, self.post_attn_norm if post else None, keys[0]
            )
            x_BxLxD = constrain(x_BxLxD, ("batch", "res_length", "act_embed"))
            x_BxLxD = self._residual(
                x_BxLxD, mlp, self.mlp_norm, self.post_mlp_norm if post else None, keys[1]
            )
        return constrain(x_BxLxD, ("batch", "res_length", "act_embed")), cache, stats


def _gathered(h_BxLxD):
    """A branch's normed input whole on the sequence over `tensor` (split over `sequence`
    only): with mesh.tensor_sequence_parallel the all-gather Megatron-SP puts before the
    column-parallel matmuls, which XLA would otherwise trade for gathering their weights."""
    return constrain(h_BxLxD, ("batch", "length", "act_embed"))


def stack(n: int, make, rngs: nnx.Rngs):
    """n modules `make(rngs)` created at once, every variable with a leading `layers` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(
        in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers", "axes": "layers"}
    )
    def stacked(rngs: nnx.Rngs):
        return make(rngs)

    return stacked(rngs)


class HybridGroup(nnx.Module):
    """One repeat of model.layer_pattern: its blocks in order (`block_0`, `block_1`, ...), each
    with linear or softmax attention as the pattern says; every one MoE when model.moe is on."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kinds = tuple(cfg.layer_pattern)
        for i, kind in enumerate(self.kinds):
            block = Block(cfg, moe=cfg.moe.enabled, linear=kind == "linear", rngs=rngs)
            setattr(self, f"block_{i}", block)


class MoEGroup(nnx.Module):
    """One repeat of the MoE layout: moe_every - 1 dense blocks (stacked), then an MoE block."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        n_dense = cfg.moe.moe_every - 1
        self.dense = stack(n_dense, lambda r: Block(cfg, rngs=r), rngs) if n_dense else None
        self.moe = Block(cfg, moe=True, rngs=rngs)
