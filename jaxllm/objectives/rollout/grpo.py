"""The critic-free policy-gradient objectives (GRPO and its kin) on the one train step.

For each prompt the policy samples a group of G completions (`sampling`); rewards score them
and `advantages` turns the rewards into advantages A (per completion, or per token for
REINFORCE++): GRPO's group-relative ones (Shao et al. 2024, arXiv:2402.03300), RLOO's
leave-one-out ones, REINFORCE++'s batch-normalised returns. Each completion token t of
sequence i then carries PPO's clipped surrogate with DAPO's decoupled clip range (Yu et al.
2025, arXiv:2503.14476) and the k3 estimator of KL(pi || ref) (Schulman 2020):

    l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta * k3_t
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

with eps_low = `train.clip_epsilon`, eps_high = `train.grpo.epsilon_high`, beta = `train.beta`
(RLOO and REINFORCE++ put their KL in the reward instead, so their loss has no k3 term). The
ratio rho (`log_ratios`) is per token, exp(log pi(y_t) - log pi_old(y_t)) (`token`); one per
completion, the exp of its mean token log-ratio (`sequence`, GSPO, Zheng et al. 2025,
arXiv:2507.18071, eq. 7); or the ratio of the sequences' probabilities (`sum`, TRL's RLOO).
The loss over a batch of S completions with lengths |o_i| (`train.grpo.loss_type`):

    grpo          (1 / S) sum_i (1 / |o_i|) sum_t l_t                       (GRPO's eq. 3)
    bnpo, dapo    sum_i sum_t l_t / sum_i |o_i|           (DAPO's token-level average)
    dr_grpo       (1 / S) sum_i (1 / T_max) sum_t l_t, T_max = max_completion_tokens
                                                          (Dr. GRPO, Liu et al. 2025, 2503.20783)

as TRL 1.16's GRPOTrainer._compute_loss computes them (its bnpo normalises per process and
microbatch; here, as its dapo, over the rollout's whole batch, through `batch_tokens`). The
objective's `tokens` is S, so the step's division of the sums gives these means however the
batch is split into microbatches.

A batch row is one prompt + completion: the usual `inputs`, `targets`, `positions`,
`segment_ids`, `loss_mask` (1 on the completion's tokens, its stop included), and float32 [B, L]
`advantages`, `old_logps` (log pi_old of each target, one batched forward pass before the
update) and the rollout's per-row fields (`critic_free`). Metrics, by TRL's names: `loss`,
`reward`, `reward_std` (the mean of the groups' stds), `frac_reward_zero_std`, `kl` (a token
mean), `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean` (token means; per
completion with one ratio per completion), `completions/mean_length` and
`completions/clipped_ratio` (the share cut at max_completion_tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.grpo import settings
from jaxllm.objectives.base import ObjectiveOutput, output, reference_logps, token_logps

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence", "sum")
# The rollout's per-row fields (the same on every position of a row) logged as TRL names them.
ROW_METRICS = {
    "rewards": "reward",
    "reward_std": "reward_std",
    "zero_std": "frac_reward_zero_std",
    "truncated": "completions/clipped_ratio",
}


def k3(logp_BxL: jax.Array, ref_BxL: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token: e^d - d - 1, d = ref - logp."""
    d_BxL = ref_BxL - logp_BxL
    return jnp.exp(d_BxL) - d_BxL - 1.0


def log_ratios(logp_BxL, old_BxL, mask_BxL, level: str):
    """log rho: per token [B, L] (`token`), or one per completion [B, 1]: its mean token
    log-ratio (`sequence`, GSPO) or their sum (`sum`, RLOO's ratio of sequence probabilities)."""
    log_ratio_BxL = (logp_BxL - old_BxL) * mask_BxL
    if level == "token":
        return log_ratio_BxL
    total_Bx1 = jnp.sum(log_ratio_BxL, axis=-1, keepdims=True)
    if level == "sum":
        return total_Bx1
    return total_Bx1 / jnp.maximum(jnp.sum(mask_BxL, axis=-1, keepdims=True), 1.0)


def token_losses(logp_BxL, old_BxL, adv_BxL, ref_BxL, *, beta, epsilon_low, epsilon_high=None,
                 mask_BxL=None, level="token"):  # fmt: skip
    """(per-token loss l_t [B, L], k3 [B, L] or None, low-clipped [B, L], high-clipped [B, L]):
    the clipped surrogate plus beta * k3 (see the module docstring). `ref_BxL` may be None when
    beta = 0; `mask_BxL` is needed for the sequence levels."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask_BxL = jnp.ones_like(logp_BxL) if mask_BxL is None else mask_BxL
    ratio = jnp.exp(log_ratios(logp_BxL, old_BxL, mask_BxL, level))
    clipped_ratio = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss_BxL = -jnp.minimum(ratio * adv_BxL, clipped_ratio * adv_BxL)
    low_BxL = jnp.broadcast_to((ratio < 1 - epsilon_low) & (adv_BxL < 0), loss_BxL.shape)
    high_BxL = jnp.broadcast_to((ratio > 1 + epsilon_high) & (adv_BxL > 0), loss_BxL.shape)
    kl_BxL = None
    if beta:
        kl_BxL = k3(logp_BxL, ref_BxL)
        loss_BxL = loss_BxL + beta * kl_BxL
    return loss_BxL, kl_BxL, low_BxL.astype(jnp.float32), high_BxL.astype(jnp.float32)


def objective(
    beta: float,
    clip_epsilon: float = 0.2,
    loss_type: str = "grpo",
    max_completion_tokens: int = 256,
    *,
    epsilon_high: float | None = None,
    level: str = "token",
    hold_reference: bool | None = None,
):
    """The clipped policy-gradient objective on rollout rows (see the module docstring).
    `beta` weighs the k3 KL in the loss; with it > 0, or `hold_reference` (RLOO and REINFORCE++
    read the reference when their batches are made, for the KL in the reward), it declares
    `others = ("reference",)` (under LoRA the base with the adapters off)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}; one of {LOSS_TYPES}")
    if level not in LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; one of {LEVELS}")

    def grpo_objective(model, batch: dict, rng, others=None) -> ObjectiveOutput:
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        logp_BxL, out = token_logps(model, batch, rng)
        ref_BxL = None
        if beta:
            if not others or "reference" not in others:
                raise ValueError("the grpo objective with beta > 0 needs others['reference']")
            ref_BxL = reference_logps(others["reference"], batch)
        loss_BxL, kl_BxL, low_BxL, high_BxL = token_losses(
            logp_BxL,
            batch["old_logps"],
            batch["advantages"],
            ref_BxL,
            beta=beta,
            epsilon_low=clip_epsilon,
            epsilon_high=epsilon_high,
            mask_BxL=mask_BxL,
            level=level,
        )
        length_B = jnp.sum(mask_BxL, axis=-1)
        # a row of the batch (segment ids > 0) counts even when its loss mask is all 0
        # (a masked truncated completion); padding rows weigh nothing
        valid_B = (jnp.sum(batch["segment_ids"] > 0, axis=-1) > 0).astype(jnp.float32)
        count = jnp.sum(valid_B)
        # the mean completion length of the whole batch (the rollout's), else this microbatch's
        if "batch_tokens" in batch:
            mean_length = batch["batch_tokens"][:, 0]
        else:
            mean_length = jnp.full_like(length_B, jnp.sum(length_B) / jnp.maximum(count, 1.0))
        per_token_B = 1.0 / jnp.maximum(mean_length, 1.0)  # sum / S of this: a token mean
        if loss_type == "grpo":
            weight_B = 1.0 / jnp.maximum(length_B, 1.0)
        elif loss_type == "dr_grpo":
            weight_B = jnp.full_like(length_B, 1.0 / max_completion_tokens)
        else:  # bnpo, dapo: one mean over the batch's tokens
            weight_B = per_token_B
        loss_sum = jnp.sum(weight_B * jnp.sum(loss_BxL * mask_BxL, axis=-1))

        def token_mean(x_BxL):  # summed over rows, / S: the mean over the batch's tokens
            x_BxL = jax.lax.stop_gradient(x_BxL)
            return jnp.sum(per_token_B * jnp.sum(x_BxL * mask_BxL, axis=-1))

        def row_mean(field):  # summed over rows, / S: the mean over completions
            return jnp.sum(batch[field][:, 0] * valid_B)

        def clip_mean(x_BxL):  # per token; with one ratio per completion, per completion
            if level == "token":
                return token_mean(x_BxL)
            return jnp.sum(x_BxL[:, 0] * valid_B)

        metrics = {
            "loss": jax.lax.stop_gradient(loss_sum),
            "clip_ratio/low_mean": clip_mean(low_BxL),
            "clip_ratio/high_mean": clip_mean(high_BxL),
            "clip_ratio/region_mean": clip_mean(jnp.maximum(low_BxL, high_BxL)),
            "completions/mean_length": row_mean("lengths")
            if "lengths" in batch
            else jnp.sum(length_B),
        }
        metrics |= {name: row_mean(field) for field, name in ROW_METRICS.items() if field in batch}
        if kl_BxL is not None:
            metrics["kl"] = token_mean(kl_BxL)
        elif "kl" in batch:  # RLOO / REINFORCE++: the rollout's KL, per token
            metrics["kl"] = token_mean(batch["kl"])
        return output(model, out, loss_sum, count, metrics)

    reference = bool(beta) if hold_reference is None else hold_reference
    grpo_objective.others = ("reference",) if reference else ()
    return grpo_objective


def from_train_config(t) -> object:
    """The objective of the `train` section `t`: its family's loss with `train.grpo` resolved
    (`jaxllm.config.grpo.settings`); RLOO and REINFORCE++ put their KL in the reward."""
    s = settings(t)
    in_reward = t.objective in ("rloo", "reinforce_pp")
    return objective(
        0.0 if in_reward else t.beta,
        s.epsilon_low,
        s.loss_type,
        t.max_completion_tokens,
        epsilon_high=s.epsilon_high,
        level=s.level,
        hold_reference=bool(t.beta),
    )
