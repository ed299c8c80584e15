"""Multi-head Latent Attention (DeepSeek-V2/V3, arXiv:2405.04434), built on `Attention`'s masks,
positions and output projection, and `make_attention`, which picks it or the standard layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.model import fp8_delayed, lora
from jaxllm.model.attention import Attention
from jaxllm.model.layers import make_norm, matmul, param
from jaxllm.model.linear_attention import GatedDeltaNet
from jaxllm.model.outputs import AttentionOutput
from jaxllm.sharding import constrain


class MLAttention(Attention):
    """Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434, section 2.1; DeepSeek-V3).

    Letters: R the kv latent (mla.kv_lora_rank), C the query latent (mla.q_lora_rank), N the
    per-head no-position width (qk_nope_head_dim), E the RoPE width (qk_rope_head_dim), V the
    value width. Per token, `kv_a_proj` gives [c (R) ; k_rope (E)]; c is normalised and
    `kv_b_proj` [R, H, N + V] expands it to each head's key part and value. Queries are
    [q_nope (N) ; q_rope (E)] per head, through a normalised C-wide latent when q_lora_rank > 0.
    The fused projections keep the checkpoint layout of DeepSeek models.

    Training and prefill expand every head (a plain multi-head attention with head width N + E
    for q/k and V for v). Generation caches [c ; rope(k_rope)] (R + E values per token and
    layer, one "kv head") and a decode step attends in latent space: q_nope is multiplied by
    W_uk (the key half of kv_b_proj), so q.k = [q_nope W_uk^T ; q_rope] . [c ; k_rope]; the
    attention output over c is multiplied by W_uv per head afterwards (the "absorbed" form).
    """

    def __init__(self, cfg, *, out_std: float, rngs: nnx.Rngs):
        a, d, h = cfg.mla, cfg.d_model, cfg.num_heads
        self._init_common(cfg)
        self.nope, self.rank = a.qk_nope_head_dim, a.kv_lora_rank
        if self.scale is None:  # decode attends over latent-width queries: name the scale
            self.scale = a.qk_head_dim**-0.5
        pdt, init = jnp.dtype(cfg.param_dtype), jax.nn.initializers.normal(cfg.init_std)
        if a.q_lora_rank:
            self.q_a_proj = param(rngs, init, (d, a.q_lora_rank), ("embed", "q_lora"), pdt)
            self.q_a_norm = make_norm(cfg, a.q_lora_rank, axes=("q_lora",))
            self.q_b_proj = param(
                rngs, init, (a.q_lora_rank, h, a.qk_head_dim), ("q_lora", "heads", "head_dim"), pdt
            )
        else:
            self.q_proj = param(
                rngs, init, (d, h, a.qk_head_dim), ("embed", "heads", "head_dim"), pdt
            )
        self.kv_a_proj = param(
            rngs, init, (d, a.kv_lora_rank + a.qk_rope_head_dim), ("embed", "kv_lora"), pdt
        )
        self.kv_a_norm = make_norm(cfg, a.kv_lora_rank, axes=("kv_lora",))
        self.kv_b_proj = param(
            rngs,
            init,
            (a.kv_lora_rank, h, a.qk_nope_head_dim + a.v_head_dim),
            ("kv_lora", "heads", "head_dim"),
            pdt,
        )
        self._init_out(cfg, a.v_head_dim, out_std, rngs)

    def _queries(self, x_BxLxD, positions_BxL, windowed=None):
        """(q_nope [B, L, H, N], roped q_rope [B, L, H, E])."""
        if hasattr(self, "q_a_proj"):
            c_BxLxC = self.q_a_norm(
                matmul(
                    "bld,dc->blc", x_BxLxD, lora.kernel(self, "q_a_proj"), self.dtype, fp8=self.fp8
                )
            )
            q_BxLxHxK = matmul(
                "blc,chk->blhk", c_BxLxC, lora.kernel(self, "q_b_proj"), self.dtype, fp8=self.fp8
            )
        else:
            q_BxLxHxK = matmul(
                "bld,dhk->blhk", x_BxLxD, lora.kernel(self, "q_proj"), self.dtype, fp8=self.fp8
            )
        q_BxLxHxK = constrain(q_BxLxHxK, ("batch", "length", "act_heads", None))
        q_rope_BxLxHxE = self._rope(q_BxLxHxK[..., self.nope :], positions_BxL, windowed)
        return q_BxLxHxK[..., : self.nope], q_rope_BxLxHxE

    def _latent(self, x_BxLxD, positions_BxL, windowed=None):
        """What a token caches: [normalised c ; roped k_rope] as one kv head [B, L, 1, R + E]."""
        a_BxLxA = matmul(
            "bld,da->bla", x_BxLxD, lora.kernel(self, "kv_a_proj"), self.dtype, fp8=self.fp8
        )
        c_BxLxR = self.kv_a_norm(a_BxLxA[..., : self.rank])
        k_rope_BxLx1xE = self._rope(a_BxLxA[:, :, None, self.rank :], positions_BxL, windowed)
        return jnp.concatenate([c_BxLxR[:, :, None], k_rope_BxLx1xE], axis=-1)

    def __call__(
        self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None, windowed=None, prefix_BxL=None
    ):
        """As `Attention.__call__`; the cache holds the latent (`_latent`)."""
        q_nope_BxLxHxN, q_rope_BxLxHxE = self._queries(x_BxLxD, positions_BxL, windowed)
        latent_BxLx1xA = self._latent(x_BxLxD, positions_BxL, windowed)
        w_BxRxHxNV = lora.dense(self, "kv_b_proj", self.dtype)
        if cache is not None:
            cache = cache.write(latent_BxLx1xA, None)
            if not cache.prefill:
                q_lat_BxQxHxR = matmul(
                    "bqhn,rhn->bqhr",
                    q_nope_BxLxHxN,
                    w_BxRxHxNV[..., : self.nope],
                    self.dtype,
                    fp8=self.fp8,
                )
                q_BxQxHxA = jnp.concatenate([q_lat_BxQxHxR, q_rope_BxLxHxE], axis=-1)
                out_BxQxHxR = self._attend_cache(q_BxQxHxA, cache, windowed, self.scale)
                out_BxQxHxV = matmul(
                    "bqhr,rhv->bqhv",
                    out_BxQxHxR,
                    w_BxRxHxNV[..., self.nope :],
                    self.dtype,
                    fp8=self.fp8,
                )
                return AttentionOutput(self._out(out_BxQxHxV), cache)
        c_BxLxR, k_rope_BxLx1xE = (
            latent_BxLx1xA[:, :, 0, : self.rank],
            latent_BxLx1xA[..., self.rank :],
        )
        w_kv = fp8_delayed.wrap(self, "kv_b_proj", w_BxRxHxNV)  # its history, if delayed
        kv_BxLxHxNV = matmul("blr,rhk->blhk", c_BxLxR, w_kv, self.dtype, fp8=self.fp8)
        h = kv_BxLxHxNV.shape[2]
        k_BxLxHxK = jnp.concatenate(
            [
                kv_BxLxHxNV[..., : self.nope],
                jnp.broadcast_to(
                    k_rope_BxLx1xE, (*k_rope_BxLx1xE.shape[:2], h, k_rope_BxLx1xE.shape[-1])
                ),
            ],
            axis=-1,
        )
        v_BxLxHxV = kv_BxLxHxNV[..., self.nope :]
        q_BxLxHxK = jnp.concatenate([q_nope_BxLxHxN, q_rope_BxLxHxE], axis=-1)
        if cache is not None:  # prefill: attend over its own tokens, expanded
            out_BxLxHxV = self._attend(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, None, windowed)
            return AttentionOutput(self._out(out_BxLxHxV), cache)
        out_BxLxHxV = self._self_attention(
            q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, segment_ids_BxL, windowed, prefix_BxL
        )
        return AttentionOutput(self._out(out_BxLxHxV))


def make_attention(cfg, *, out_std: float, rngs: nnx.Rngs, linear: bool = False) -> Attention:
    """The configured attention: with `linear`, the linear-attention layer of
    model.linear_attention; MLA when model.mla is on; else MHA / GQA / MQA."""
    if linear:
        return GatedDeltaNet(cfg, out_std=out_std, rngs=rngs)
    cls = MLAttention if cfg.mla.enabled else Attention
    return cls(cfg, out_std=out_std, rngs=rngs)
