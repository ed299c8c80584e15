"""The `model.moe` subsection: mixture-of-experts layers (`MoEConfig`) and the checks of its keys
against the rest of the model (`validate_moe`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxllm.config.errors import fail as _fail


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (`jaxllm.model.moe`); num_experts=0 is a dense model.

    Which blocks are MoE: the first `first_dense_layers` blocks are dense, and of the rest every
    `moe_every`-th is MoE (the others dense), so blocks k+n-1, k+2n-1, ... (0-based) for
    k = first_dense_layers, n = moe_every.
    """

    num_experts: int = 0
    """E: routed experts per MoE layer; 0 makes every block dense."""
    experts_per_token: int = 2
    """Top-k: routed experts each token is sent to."""
    expert_mlp_dim: int | None = None
    """Hidden width of each expert's SwiGLU; null means model.mlp_dim."""
    num_shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek / Qwen style),
    run as one SwiGLU of width num_shared_experts * expert_mlp_dim."""
    shared_mlp_dim: int | None = None
    """Width of the shared experts' one SwiGLU; null means num_shared_experts * expert_mlp_dim
    (Qwen3-Next: shared_expert_intermediate_size)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(x w_gate), w_gate [D, 1]
    (Qwen2-MoE, Qwen3-Next: `shared_expert_gate`); needs num_shared_experts > 0."""
    first_dense_layers: int = 0
    """Leading blocks kept dense (DeepSeek-V3 keeps 3)."""
    moe_every: int = 1
    """Of the blocks after those, every this-many-th is MoE (2: alternate dense and MoE)."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores from the float32 logits: softmax over experts (Mixtral, Qwen) or an
    independent sigmoid per expert (DeepSeek-V3)."""
    normalize_top_k: bool = True
    """Rescale each token's top-k scores to sum to 1 (for softmax this is Mixtral's softmax
    over the top-k logits)."""
    route_scale: float = 1.0
    """Factor on the routed experts' combined output (DeepSeek-V3's routed_scaling_factor)."""
    dispatch: Literal["dropless", "capacity"] = "dropless"
    """`dropless`: tokens sorted by expert and run as a grouped matmul, none dropped;
    `capacity`: fixed per-expert buffers of each sequence, assignments over capacity dropped."""
    capacity_factor: float = 1.25
    """Capacity mode: buffer slots per expert = ceil(capacity_factor * top-k * seq_len / E)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch / GShard load-balancing loss E * sum_e f_e * P_e (1 when balanced),
    averaged over MoE layers."""
    router_z_loss_weight: float = 0.001
    """Weight of the router z-loss, mean logsumexp(router logits)^2 (ST-MoE), averaged over
    MoE layers."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores for
    the top-k choice only, moves by this much per step against the sign of each expert's load
    error; 0 keeps it where it is (and without `router_bias` there is no bias at all)."""
    router_bias: bool = False
    """Keep the per-expert choice bias even when bias_update_rate is 0: a model imported from
    DeepSeek-V3 routes with its trained `e_score_correction_bias`, frozen unless
    bias_update_rate > 0 (which implies a bias)."""
    router_logit_bias: bool = False
    """A trained per-expert bias added to the router logits themselves, before the top-k and
    the softmax (gpt-oss's router); unlike `router_bias` it is a parameter."""
    expert_bias: bool = False
    """Biases on every expert's gate, up and down projections (gpt-oss)."""
    activation: Literal["swiglu", "swiglu_clamped"] = "swiglu"
    """The experts' gate: `swiglu` silu(gate) * up; `swiglu_clamped` gpt-oss's
    (up + 1) * gate * sigmoid(swiglu_alpha * gate) with gate <= swiglu_limit and
    |up| <= swiglu_limit."""
    swiglu_alpha: float = 1.702
    """activation=swiglu_clamped: the sigmoid's slope (gpt-oss: 1.702)."""
    swiglu_limit: float = 7.0
    """activation=swiglu_clamped: where gate and up are clipped (gpt-oss: 7.0)."""
    num_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups
    of consecutive experts (one per device or node in DeepSeek's layout); 1: no groups."""
    groups_per_token: int = 1
    """Group-limited routing (DeepSeek-V3's topk_group): a token's top-k experts come from its
    best this-many groups, a group ranked by `group_score`, which bounds how many devices a
    token's assignments travel to; num_groups: no limit."""
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """How group-limited routing ranks a group: the sum of its two highest (biased) scores
    (DeepSeek-V3's noaux_tc) or its highest score (DeepSeek-V2's group_limited_greedy)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def has_router_bias(self) -> bool:
        """Whether MoE layers carry a `RouterBias` (in the model state, not the parameters)."""
        return self.router_bias or self.bias_update_rate > 0


def validate_moe(m) -> None:
    """The checks of `m.moe` (m: the `ModelConfig`) against the model's depth."""
    moe = m.moe
    if not 1 <= moe.experts_per_token <= moe.num_experts:
        _fail(
            f"model.moe.experts_per_token ({moe.experts_per_token}) must be between 1 and "
            f"model.moe.num_experts ({moe.num_experts})."
        )
    if moe.expert_mlp_dim is not None and moe.expert_mlp_dim < 1:
        _fail(f"model.moe.expert_mlp_dim must be at least 1 or null, not {moe.expert_mlp_dim}.")
    if moe.num_shared_experts < 0 or moe.first_dense_layers < 0 or moe.moe_every < 1:
        _fail(
            "model.moe.num_shared_experts and model.moe.first_dense_layers must be >= 0 and "
            "model.moe.moe_every >= 1."
        )
    rest = m.num_layers - moe.first_dense_layers
    if rest < moe.moe_every or rest % moe.moe_every:
        _fail(
            f"model.num_layers - model.moe.first_dense_layers ({rest}) must be a positive "
            f"multiple of model.moe.moe_every ({moe.moe_every}), so that the MoE pattern repeats "
            "whole and holds at least one MoE block."
        )
    if moe.shared_expert_gate and not moe.num_shared_experts:
        _fail("model.moe.shared_expert_gate gates the shared experts: set num_shared_experts.")
    if moe.shared_mlp_dim is not None and (moe.shared_mlp_dim < 1 or not moe.num_shared_experts):
        _fail("model.moe.shared_mlp_dim must be positive, with model.moe.num_shared_experts.")
    if moe.capacity_factor <= 0 or moe.route_scale <= 0:
        _fail("model.moe.capacity_factor and model.moe.route_scale must be positive.")
    if moe.swiglu_alpha <= 0 or moe.swiglu_limit <= 0:
        _fail("model.moe.swiglu_alpha and model.moe.swiglu_limit must be positive.")
    for name in ("aux_loss_weight", "router_z_loss_weight", "bias_update_rate"):
        if getattr(moe, name) < 0:
            _fail(f"model.moe.{name} must be >= 0, not {getattr(moe, name)}.")
    _validate_groups(moe)


def _validate_groups(moe: MoEConfig) -> None:
    groups, keep = moe.num_groups, moe.groups_per_token
    if groups < 1 or moe.num_experts % groups:
        _fail(
            f"model.moe.num_groups ({groups}) must be a positive divisor of "
            f"model.moe.num_experts ({moe.num_experts})."
        )
    if not 1 <= keep <= groups:
        _fail(
            f"model.moe.groups_per_token ({keep}) must be between 1 and model.moe.num_groups "
            f"({groups})."
        )
    if moe.experts_per_token > keep * (moe.num_experts // groups):
        _fail(
            f"model.moe.experts_per_token ({moe.experts_per_token}) exceeds the "
            f"{keep * (moe.num_experts // groups)} experts of model.moe.groups_per_token ({keep}) "
            f"groups of {moe.num_experts // groups}; raise groups_per_token."
        )
