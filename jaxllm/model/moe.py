"""Mixture-of-experts feed-forward layer: a router picks top-k of E SwiGLU experts per token.

Routing (Shazeer et al. 2017, arXiv:1701.06538; GShard, arXiv:2006.16668) is computed in
float32: softmax scores (Mixtral, arXiv:2401.04088; Qwen) or per-expert sigmoid scores
(DeepSeek-V3, arXiv:2412.19437), top-k selection, optionally renormalised top-k weights.
Shared experts that every token passes through (DeepSeekMoE, arXiv:2401.06066) are one SwiGLU
of their summed width.

Two ways to run the experts:

- `dropless` (MegaBlocks, arXiv:2211.15841): each device sorts its (token, choice) assignments
  by expert and runs the experts as grouped matmuls (`jax.lax.ragged_dot`); nothing is dropped.
  With experts split over devices, tokens are all-gathered over the expert axis, every device
  runs its own experts on the assignments that chose them, and the partial outputs are
  reduce-scattered back (the static-shape "all-gather dispatcher"), or (`moe_ragged`) each
  token goes by a ragged all-to-all only to the devices of its chosen experts and back.
- `capacity` (GShard / Switch, arXiv:2101.03961): each sequence fills buffers of C slots per
  expert [E, C, D]; first choices of the sequence take slots before second choices, then by
  position, and assignments past C are dropped (counted). Buffers reach the devices holding
  their experts by an all-to-all (explicit, or left to XLA by sharding constraints).

Load balancing: the Switch auxiliary loss E * sum_e f_e * P_e (f_e: fraction of assignments to
expert e, P_e: mean router probability of e; 1 when balanced), the router z-loss (ST-MoE,
arXiv:2202.08906), and auxiliary-loss-free balancing (Wang et al. 2024, arXiv:2408.15664, used
by DeepSeek-V3): a per-expert bias added to the scores for the top-k choice only, moved by the
train step against the sign of each expert's load error (`update_router_bias`). Group-limited
routing (DeepSeek-V2/V3) restricts each token's top-k to its best few groups of experts.

gpt-oss (OpenAI 2025): a trained bias on the router logits (`router_logit_bias`), biases on every
expert projection (`expert_bias`; the gate / up biases ride as one more input row of ones, the
down bias is mixed by the combine weights) and the clamped SwiGLU (`moe_experts`).

Quantized experts: W8A8 codes (`coded.w8a8`) reach the dispatch as stored, whose matmuls quantize
each token's row (int8 / E4M3 ragged dots or the seam's einsums); other codes are decoded first.

Placement is not decided here: `jaxllm.parallel` runs the per-device functions of
`moe_experts` under `shard_map` and hands them the mesh axis names. `moe_experts.dense_reference`
runs every expert on every token and is what the layer is tested against.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm import parallel
from jaxllm.config import MoEConfig
from jaxllm.model import lora, tap
from jaxllm.model.layers import param
from jaxllm.model.mlp import MLP
from jaxllm.model.moe_experts import (
    EXPERT_WEIGHTS,
    capacity_experts_local,
    dropless_experts_local,
    expert_activation,
    expert_mlp,
    expert_weight,
    record_experts,
)
from jaxllm.model.moe_ragged import ragged_experts_local
from jaxllm.model.outputs import MoEOutput
from jaxllm.sharding import constrain


class RouterBias(nnx.Variable):
    """Per-expert balancing bias of auxiliary-loss-free routing. Not an `nnx.Param`: no
    gradient or optimizer touches it; the train step moves it (`update_router_bias`) and keeps
    it in `TrainState.model_state`."""


class Routing(NamedTuple):
    expert_BxLxX: jax.Array  # int32: the chosen experts of each token
    weight_BxLxX: jax.Array  # float32: their combine weights
    counts_E: jax.Array  # float32: assignments per expert (the load)
    aux_loss: jax.Array  # Switch load-balancing loss, 1 when balanced
    z_loss: jax.Array  # mean logsumexp(logits)^2


def route(logits_BxLxE: jax.Array, bias_E: jax.Array | None, cfg: MoEConfig) -> Routing:
    """Top-k routing from float32 router logits; `bias_E` (if any) steers only the choice."""
    e, x = cfg.num_experts, cfg.experts_per_token
    logits_BxLxE = logits_BxLxE.astype(jnp.float32)
    if cfg.router_score == "softmax":
        scores_BxLxE = jax.nn.softmax(logits_BxLxE, axis=-1)
        probs_BxLxE = scores_BxLxE
    else:
        scores_BxLxE = jax.nn.sigmoid(logits_BxLxE)
        probs_BxLxE = scores_BxLxE / jnp.sum(scores_BxLxE, axis=-1, keepdims=True)
    choice_BxLxE = scores_BxLxE
    if bias_E is not None:
        choice_BxLxE = scores_BxLxE + jax.lax.stop_gradient(bias_E).astype(jnp.float32)[None, None]
    if cfg.groups_per_token < cfg.num_groups:
        choice_BxLxE = limit_to_groups(
            choice_BxLxE, cfg.num_groups, cfg.groups_per_token, cfg.group_score
        )
    _, expert_BxLxX = jax.lax.top_k(choice_BxLxE, x)
    weight_BxLxX = jnp.take_along_axis(scores_BxLxE, expert_BxLxX, axis=-1)
    if cfg.normalize_top_k:
        weight_BxLxX = weight_BxLxX / jnp.sum(weight_BxLxX, axis=-1, keepdims=True)
    weight_BxLxX = weight_BxLxX * cfg.route_scale
    counts_E = jnp.sum(jax.nn.one_hot(expert_BxLxX, e, dtype=jnp.float32), axis=(0, 1, 2))
    fraction_E = counts_E / (counts_E.sum())
    aux_loss = e * jnp.sum(fraction_E * jnp.mean(probs_BxLxE, axis=(0, 1)))
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxE, axis=-1)))
    return Routing(expert_BxLxX.astype(jnp.int32), weight_BxLxX, counts_E, aux_loss, z_loss)


def limit_to_groups(
    choice_BxLxE: jax.Array, num_groups: int, keep: int, group_score: str = "top2_sum"
) -> jax.Array:
    """Group-limited routing (DeepSeek-V2/V3, `n_group` / `topk_group`): the E experts form
    `num_groups` groups of consecutive experts, each ranked per token by the sum of its two
    highest choice scores (`top2_sum`, DeepSeek-V3; its highest when a group holds one expert)
    or by its highest (`max`, DeepSeek-V2); the experts outside the best `keep` groups get
    -inf, so the top-k that follows picks only from those groups (with experts grouped per
    device, a token's assignments reach at most `keep` devices)."""
    b, l, e = choice_BxLxE.shape
    size = e // num_groups
    top = 1 if group_score == "max" else min(2, size)
    best_BxLxGxT, _ = jax.lax.top_k(choice_BxLxE.reshape(b, l, num_groups, size), top)
    _, group_BxLxK = jax.lax.top_k(jnp.sum(best_BxLxGxT, axis=-1), keep)
    kept_BxLxG = jnp.sum(jax.nn.one_hot(group_BxLxK, num_groups, dtype=jnp.int32), axis=-2) > 0
    kept_BxLxE = jnp.repeat(kept_BxLxG, size, axis=-1)
    return jnp.where(kept_BxLxE, choice_BxLxE, -jnp.inf)


def capacity(cfg: MoEConfig, seq_len: int) -> int:
    """Slots per expert and sequence: ceil(capacity_factor * k * L / E), at most L (a token
    picks an expert at most once)."""
    c = math.ceil(cfg.capacity_factor * cfg.experts_per_token * seq_len / cfg.num_experts)
    return max(1, min(c, seq_len))


def capacity_slots(expert_BxLxX: jax.Array, num_experts: int, cap: int):
    """(slot_BxLxX, keep_BxLxX): each assignment's row in its sequence's [E * C] buffer, in
    GShard's priority order (all first choices by position, then all second choices, ...);
    an assignment past its expert's C slots is dropped and gets the out-of-range slot E * C."""
    b, l, x = expert_BxLxX.shape
    expert_BxXL = jnp.swapaxes(expert_BxLxX, 1, 2).reshape(b, x * l)
    onehot_BxXLxE = jax.nn.one_hot(expert_BxXL, num_experts, dtype=jnp.int32)
    position_BxXL = jnp.sum((jnp.cumsum(onehot_BxXLxE, axis=1) - 1) * onehot_BxXLxE, axis=-1)
    position_BxLxX = jnp.swapaxes(position_BxXL.reshape(b, x, l), 1, 2)
    keep_BxLxX = position_BxLxX < cap
    slot_BxLxX = jnp.where(keep_BxLxX, expert_BxLxX * cap + position_BxLxX, num_experts * cap)
    return slot_BxLxX, keep_BxLxX


def with_input_bias(layer, x_BxLxD, gate_ExDxF, up_ExDxF, dtype):
    """(x with a column of ones [B, L, D + 1], gate and up with their bias as row D), so that
    the experts' x W + b is one matmul in either dispatch. The stacks are dense here (codes
    decoded)."""
    ones_BxLx1 = jnp.ones((*x_BxLxD.shape[:2], 1), x_BxLxD.dtype)
    x_BxLxD1 = jnp.concatenate([x_BxLxD, ones_BxLx1], axis=-1)

    def extend(w_ExDxF, name):
        if not isinstance(w_ExDxF, jax.Array):
            w_ExDxF = lora.dense(layer, name.replace("bias", "proj"), dtype)
        bias_Ex1xF = getattr(layer, name)[...].astype(w_ExDxF.dtype)[:, None, :]
        return jnp.concatenate([w_ExDxF, bias_Ex1xF], axis=1)

    return x_BxLxD1, extend(gate_ExDxF, "gate_bias"), extend(up_ExDxF, "up_bias")


def combine_weights(routing: Routing, num_experts: int, keep_BxLxX=None) -> jax.Array:
    """Routing -> [B, L, E] weights of every expert (zero for unchosen or dropped ones)."""
    weight_BxLxX = routing.weight_BxLxX
    if keep_BxLxX is not None:
        weight_BxLxX = jnp.where(keep_BxLxX, weight_BxLxX, 0.0)
    onehot_BxLxXxE = jax.nn.one_hot(routing.expert_BxLxX, num_experts, dtype=jnp.float32)
    return jnp.einsum("blx,blxe->ble", weight_BxLxX, onehot_BxLxXxE)


class MoE(nnx.Module):
    """x [B, L, D] -> (y [B, L, D], stats): routed experts plus optional shared experts.

    `stats` holds this layer's `aux_loss`, `router_z_loss`, `expert_counts` [E] (assignments
    per expert) and `dropped` (assignments over capacity), all float32.
    """

    def __init__(
        self,
        d_model: int,
        expert_mlp_dim: int,
        cfg: MoEConfig,
        *,
        init_std,
        out_std,
        dtype,
        param_dtype,
        fp8: str | None = None,
        rngs: nnx.Rngs,
    ):
        self.cfg, self.dtype, self.fp8 = cfg, dtype, fp8
        normal = jax.nn.initializers.normal
        d, f, e = d_model, expert_mlp_dim, cfg.num_experts
        self.router = param(rngs, normal(init_std), (d, e), ("embed", "router_expert"), param_dtype)
        self.router_bias = (
            RouterBias(jnp.zeros((e,), jnp.float32), axes=("router_expert",))
            if cfg.has_router_bias
            else None
        )
        zeros = jax.nn.initializers.zeros
        if cfg.router_logit_bias:  # gpt-oss: trained, added to the logits themselves
            self.router_logit_bias = param(rngs, zeros, (e,), ("router_expert",), param_dtype)
        self.gate_proj = param(
            rngs, normal(init_std), (e, d, f), ("expert", "embed", "mlp"), param_dtype
        )
        self.up_proj = param(
            rngs, normal(init_std), (e, d, f), ("expert", "embed", "mlp"), param_dtype
        )
        self.down_proj = param(
            rngs, normal(out_std), (e, f, d), ("expert", "mlp", "embed"), param_dtype
        )
        if cfg.expert_bias:
            self.gate_bias = param(rngs, zeros, (e, f), ("expert", "mlp"), param_dtype)
            self.up_bias = param(rngs, zeros, (e, f), ("expert", "mlp"), param_dtype)
            self.down_bias = param(rngs, zeros, (e, d), ("expert", "embed"), param_dtype)
        # One SwiGLU as wide as all shared experts together (or shared_mlp_dim).
        n_shared, shared_f = (
            cfg.num_shared_experts,
            cfg.shared_mlp_dim or cfg.num_shared_experts * f,
        )
        opts = dict(
            init_std=init_std, out_std=out_std, dtype=dtype, param_dtype=param_dtype, fp8=fp8
        )
        self.shared = MLP(d, shared_f, "swiglu", **opts, rngs=rngs) if n_shared else None
        if cfg.shared_expert_gate:  # Qwen3-Next: sigmoid(x w) scales the shared output
            self.shared_gate = param(rngs, normal(init_std), (d, 1), ("embed", None), param_dtype)

    def __call__(self, x_BxLxD: jax.Array):
        cfg, dtype = self.cfg, self.dtype
        e = cfg.num_experts
        b, l, d = x_BxLxD.shape
        logits_BxLxE = jnp.einsum(
            "bld,de->ble", x_BxLxD.astype(jnp.float32), self.router[...].astype(jnp.float32)
        )
        if cfg.router_logit_bias:
            logits_BxLxE = (
                logits_BxLxE + self.router_logit_bias[...].astype(jnp.float32)[None, None]
            )
        bias_E = None if self.router_bias is None else self.router_bias[...]
        r = route(logits_BxLxE, bias_E, cfg)
        gate, up, down = (expert_weight(self, n, dtype) for n in EXPERT_WEIGHTS)
        act = expert_activation(cfg)
        if (recorder := tap.active()) is not None:  # calibration
            record_experts(recorder, self, x_BxLxD, combine_weights(r, e), act)
        x_in_BxLxD = x_BxLxD
        if cfg.expert_bias:  # x W + b = [x, 1] [W; b]: the dispatch stays as it is
            x_BxLxD, gate, up = with_input_bias(self, x_BxLxD, gate, up, dtype)
        d_in = x_BxLxD.shape[-1]
        dropped = jnp.zeros((), jnp.float32)
        if cfg.dispatch == "dropless":
            fn = functools.partial(dropless_experts_local, dtype=dtype, fp8=self.fp8, act=act)
            if parallel.dropless_ragged_active():  # each token only to its experts' devices
                fn = functools.partial(
                    ragged_experts_local,
                    dtype=dtype,
                    fp8=self.fp8,
                    act=act,
                    groups=(cfg.num_groups, cfg.groups_per_token),
                )
            out_BxLxD = parallel.per_shard_dropless(
                fn, x_BxLxD, r.expert_BxLxX, r.weight_BxLxX, gate, up, down
            )
        else:
            cap = capacity(cfg, l)
            slot_BxLxX, keep_BxLxX = capacity_slots(r.expert_BxLxX, e, cap)
            dropped = jnp.sum(1.0 - keep_BxLxX.astype(jnp.float32))

            def fill(x_LxD, slot_LxX):  # each sequence's tokens into its expert buffers
                rows_LxXxD = jnp.broadcast_to(x_LxD[:, None], (*slot_LxX.shape, d_in))
                return jnp.zeros((e * cap, d_in), dtype).at[slot_LxX].add(rows_LxXxD, mode="drop")

            buf = jax.vmap(fill)(x_BxLxD.astype(dtype), slot_BxLxX)
            buf_BxExCxD = buf.reshape(b, e, cap, d_in)
            if parallel.expert_all_to_all_active():
                fn = functools.partial(capacity_experts_local, dtype=dtype, fp8=self.fp8, act=act)
                y_BxExCxD = parallel.per_shard_all_to_all(fn, buf_BxExCxD, gate, up, down)
            else:  # sharding constraints: filled where the tokens are, XLA moves them over
                buf_BxExCxD = constrain(buf_BxExCxD, ("batch", None, None, "act_embed"))
                buf_BxExCxD = constrain(buf_BxExCxD, ("expert_group", "expert", None, "act_embed"))
                y_BxExCxD = expert_mlp(buf_BxExCxD, gate, up, down, dtype, self.fp8, act=act)
                y_BxExCxD = constrain(y_BxExCxD, ("expert_group", "expert", None, "act_embed"))
            y_BxExCxD = constrain(y_BxExCxD, ("batch", None, None, "act_embed"))
            y_BxLxXxD = jax.vmap(lambda y, s: y.at[s].get(mode="fill", fill_value=0))(
                y_BxExCxD.reshape(b, e * cap, d), slot_BxLxX
            )
            weight_BxLxX = jnp.where(keep_BxLxX, r.weight_BxLxX, 0.0).astype(dtype)
            out_BxLxD = jnp.einsum(
                "blx,blxd->bld", weight_BxLxX, y_BxLxXxD, preferred_element_type=jnp.float32
            ).astype(dtype)
        if cfg.expert_bias:  # sum_x w_x b_down(e_x), zero for dropped assignments
            keep = None if cfg.dispatch == "dropless" else keep_BxLxX
            combine_BxLxE = combine_weights(r, e, keep)
            bias_BxLxD = jnp.einsum(
                "ble,ed->bld", combine_BxLxE, self.down_bias[...].astype(jnp.float32)
            )
            out_BxLxD = (out_BxLxD.astype(jnp.float32) + bias_BxLxD).astype(dtype)
        if self.shared is not None:
            shared_BxLxD = self.shared(x_in_BxLxD)
            if hasattr(self, "shared_gate"):
                gate = jnp.einsum(
                    "bld,do->blo", x_in_BxLxD, self.shared_gate[...].astype(x_in_BxLxD.dtype)
                )
                shared_BxLxD = (jax.nn.sigmoid(gate.astype(jnp.float32)) * shared_BxLxD).astype(
                    dtype
                )
            out_BxLxD = out_BxLxD + shared_BxLxD
        stats = {
            "aux_loss": r.aux_loss,
            "router_z_loss": r.z_loss,
            "expert_counts": r.counts_E,
            "dropped": dropped,
        }
        return MoEOutput(out_BxLxD, stats)


def combine_layer_stats(stats) -> dict:
    """The MoE layers' stacked stats (one entry per MoE layer) -> the model's aux output: mean
    `aux_loss` and `router_z_loss` over layers, `expert_counts` [N_moe, E], total `dropped`."""
    return {
        "aux_loss": jnp.mean(stats["aux_loss"]),
        "router_z_loss": jnp.mean(stats["router_z_loss"]),
        "expert_counts": stats["expert_counts"],
        "dropped": jnp.sum(stats["dropped"]),
    }


def objective_terms(cfg: MoEConfig, aux: dict, count: jax.Array):
    """(loss term, metric sums, stats) of a model's MoE aux output for an objective over
    `count` tokens: the balancing and router z-losses, weighted by the token count so that
    gradient accumulation averages them, and the expert loads for `after_step`."""
    aux_sum, z_sum = aux["aux_loss"] * count, aux["router_z_loss"] * count
    term = cfg.aux_loss_weight * aux_sum
    term += cfg.router_z_loss_weight * z_sum
    metrics = {"moe_aux_loss": aux_sum, "moe_router_z_loss": z_sum}
    stats = {"expert_counts": aux["expert_counts"], "dropped": aux["dropped"]}
    return term, metrics, stats


def after_step(cfg: MoEConfig, model_state, stats: dict, keep: jax.Array):
    """(new model state, load metrics) after a train step from its summed `stats`: the
    router biases move by the step's expert loads (`bias_update_rate` > 0) where `keep`
    (the step was finite) holds."""
    metrics = load_metrics(stats["expert_counts"], stats["dropped"])
    if cfg.bias_update_rate > 0:
        new = update_router_bias(model_state, stats["expert_counts"], cfg.bias_update_rate)
        model_state = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, model_state)
    return model_state, metrics


def update_router_bias(model_state, expert_counts_NxE: jax.Array, rate: float):
    """Auxiliary-loss-free balancing step on the stacked router biases [N, E] of a model's
    non-trained state: b_e += rate * sign(mean load - load_e), so an overloaded expert becomes
    less likely to be chosen and an idle one more likely."""

    def step(path, leaf):
        if getattr(path[-1], "key", None) != "router_bias":
            return leaf
        error_NxE = jnp.mean(expert_counts_NxE, axis=-1, keepdims=True) - expert_counts_NxE
        return leaf + rate * jnp.sign(error_NxE).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(step, model_state)


def load_metrics(expert_counts_NxE: jax.Array, dropped: jax.Array) -> dict:
    """Per-step balance numbers over the N MoE layers: the smallest and largest fraction of
    assignments any expert got in any layer (1/E when balanced), the coefficient of variation
    of the per-expert load (mean over layers; 0 when balanced), and the dropped fraction."""
    total_N1 = jnp.maximum(jnp.sum(expert_counts_NxE, axis=-1, keepdims=True), 1.0)
    fraction_NxE = expert_counts_NxE / total_N1
    mean_N = jnp.mean(fraction_NxE, axis=-1)
    cv_N = jnp.std(fraction_NxE, axis=-1) / mean_N
    return {
        "moe_load_min": jnp.min(fraction_NxE),
        "moe_load_max": jnp.max(fraction_NxE),
        "moe_load_cv": jnp.mean(cv_N),
        "moe_dropped_frac": dropped / jnp.maximum(jnp.sum(expert_counts_NxE), 1.0),
    }
