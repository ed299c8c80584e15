"""GRPO: group relative policy optimisation, as an objective of the one train step.

For each prompt the policy samples a group of G completions (`sampling`); a verifiable
reward r_i scores each, and a completion's advantage is its reward relative to its
group's (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, section 4.1.2):

    sequence   A_i = (r_i - mean_g r) / (std_g r + 1e-4)      (std with Bessel's correction)
    dr_grpo    A_i = r_i - mean_g r                            (Liu et al. 2025, Dr. GRPO,
                                                               arXiv:2503.20783, section 3.2)

Every completion token t of sequence i then carries the clipped surrogate of PPO with the
per-token ratio rho = exp(log pi(y_t) - log pi_old(y_t)) and the k3 estimator of KL(pi || ref)
(Schulman 2020, "Approximating KL divergence"), both on the sampled tokens:

    l_t = -min(rho A_i, clip(rho, 1 - eps, 1 + eps) A_i) + beta * k3_t
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (>= 0, unbiased for the KL)

with eps = `train.clip_epsilon`, beta = `train.beta` (0 drops the reference entirely). The
loss over a batch of S sequences with completion lengths |o_i|:

    sequence   (1 / S) sum_i (1 / |o_i|) sum_t l_t                 (GRPO's eq. 3)
    dr_grpo    (1 / S) sum_i (1 / T_max) sum_t l_t, T_max = `train.max_completion_tokens`
                                                                  (no length bias)

which are TRL 1.16's `loss_type="grpo"` and `"dr_grpo"` (`GRPOTrainer._compute_loss`). The
objective's `tokens` is the number of sequences S, so the step's division of the sums gives
those means however the batch is split into microbatches.

A batch row is one prompt + completion; its fields besides the usual `inputs`, `targets`,
`positions`, `segment_ids` and `loss_mask` (1 on the completion's tokens, its EOS included)
are float32 [B, L]: `advantages` (A_i on every position of row i), `old_logps` (log pi_old of
each target, computed in one batched forward pass before the update), `rewards` (r_i on every
position, for the metric). Metrics, means over the sequences of a step: `loss`, `reward_mean`,
`kl` (the per-sequence mean of k3), `clip_ratio` (share of a sequence's tokens whose ratio was
clipped), `completion_length`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.objectives.base import ObjectiveOutput, output, reference_logps, token_logps

NORMALIZATIONS = ("sequence", "dr_grpo")


def group_advantages(rewards_S: np.ndarray, group: int, normalization: str) -> np.ndarray:
    """Each completion's reward relative to its group's (see the module docstring): rewards_S
    holds S = (S / G) groups of `group` consecutive completions of one prompt. Float32."""
    r_NxG = np.asarray(rewards_S, np.float64).reshape(-1, group)
    centred_NxG = r_NxG - r_NxG.mean(axis=1, keepdims=True)
    if normalization == "sequence":
        std_Nx1 = r_NxG.std(axis=1, ddof=1, keepdims=True) if group > 1 else 0.0
        centred_NxG = centred_NxG / (std_Nx1 + 1e-4)
    elif normalization != "dr_grpo":
        raise ValueError(f"unknown GRPO normalization {normalization!r}; one of {NORMALIZATIONS}")
    return centred_NxG.reshape(-1).astype(np.float32)


def k3(logp_BxL: jax.Array, ref_BxL: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(pi || ref) per sampled token: e^d - d - 1, d = ref - logp."""
    d_BxL = ref_BxL - logp_BxL
    return jnp.exp(d_BxL) - d_BxL - 1.0


def token_losses(logp_BxL, old_BxL, adv_BxL, ref_BxL, *, beta: float, clip_epsilon: float):
    """(per-token loss l_t [B, L], k3 [B, L] or None, clipped [B, L] float): the clipped
    surrogate plus beta * k3 (see the module docstring). `ref_BxL` may be None when beta = 0."""
    ratio_BxL = jnp.exp(logp_BxL - old_BxL)
    clipped_ratio_BxL = jnp.clip(ratio_BxL, 1.0 - clip_epsilon, 1.0 + clip_epsilon)
    loss_BxL = -jnp.minimum(ratio_BxL * adv_BxL, clipped_ratio_BxL * adv_BxL)
    clipped_BxL = ((ratio_BxL < 1 - clip_epsilon) & (adv_BxL < 0)) | (
        (ratio_BxL > 1 + clip_epsilon) & (adv_BxL > 0)
    )
    kl_BxL = None
    if beta:
        kl_BxL = k3(logp_BxL, ref_BxL)
        loss_BxL = loss_BxL + beta * kl_BxL
    return loss_BxL, kl_BxL, clipped_BxL.astype(jnp.float32)


def objective(
    beta: float,
    clip_epsilon: float = 0.2,
    normalization: str = "sequence",
    max_completion_tokens: int = 256,
):
    """The GRPO objective on rollout rows (see the module docstring). With beta > 0 it
    declares `others = ("reference",)` (under LoRA the base with the adapters off)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown GRPO normalization {normalization!r}; one of {NORMALIZATIONS}")

    def grpo_objective(model, batch: dict, rng, others=None) -> ObjectiveOutput:
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        logp_BxL, out = token_logps(model, batch, rng)
        ref_BxL = None
        if beta:
            if not others or "reference" not in others:
                raise ValueError("the grpo objective with beta > 0 needs others['reference']")
            ref_BxL = reference_logps(others["reference"], batch)
        loss_BxL, kl_BxL, clipped_BxL = token_losses(
            logp_BxL,
            batch["old_logps"],
            batch["advantages"],
            ref_BxL,
            beta=beta,
            clip_epsilon=clip_epsilon,
        )
        length_B = jnp.sum(mask_BxL, axis=-1)
        valid_B = (length_B > 0).astype(jnp.float32)  # padding rows weigh nothing
        per_token_B = 1.0 / jnp.maximum(length_B, 1.0)
        if normalization == "sequence":
            weight_B = per_token_B
        else:
            weight_B = jnp.full_like(length_B, 1.0 / max_completion_tokens)
        loss_sum = jnp.sum(weight_B * jnp.sum(loss_BxL * mask_BxL, axis=-1))
        count = jnp.sum(valid_B)

        def seq_mean(x_BxL):  # sum over sequences of each one's mean over its completion
            x_BxL = jax.lax.stop_gradient(x_BxL)
            return jnp.sum(per_token_B * jnp.sum(x_BxL * mask_BxL, axis=-1))

        metrics = {
            "loss": jax.lax.stop_gradient(loss_sum),
            "reward_mean": jnp.sum(batch["rewards"][:, 0] * valid_B),
            "clip_ratio": seq_mean(clipped_BxL),
            "completion_length": jnp.sum(length_B),
        }
        if kl_BxL is not None:
            metrics["kl"] = seq_mean(kl_BxL)
        return output(model, out, loss_sum, count, metrics)

    grpo_objective.others = ("reference",) if beta else ()
    return grpo_objective


def from_train_config(t) -> object:
    """The GRPO objective with the coefficients of the `train` section `t`."""
    return objective(t.beta, t.clip_epsilon, t.grpo_normalization, t.max_completion_tokens)
