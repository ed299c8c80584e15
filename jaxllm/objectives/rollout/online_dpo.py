"""Online DPO: DPO's loss on pairs the policy samples and a reward ranks, each step.

Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792;
TRL's `OnlineDPOTrainer` (`loss_type="sigmoid"`). For each prompt the policy samples two
completions (`sampling`, `train.num_generations=2`), `train.reward` (a function or a reward
model) scores both, the higher one is chosen (the first on a tie, as TRL's `first >= second`),
and the pair's loss is DPO's (`jaxllm.objectives.preference.dpo_loss`) with the reference
`train.reference` (under LoRA the base with its adapters off):

    -log sigma(beta * ((pi_c - pi_r) - (ref_c - ref_r)))

pi and ref the log-probability sums of a completion's tokens (its stop included), beta =
`train.beta`. A rollout row is one prompt + completion; a prompt's two rows are consecutive
(rows 2k, 2k + 1), with float32 [B, L] fields `chosen` (1 on every position of the chosen row)
and `rewards`. The objective's `tokens` is the number of pairs. Metrics with TRL's names, means
over the pairs: `loss`, `rewards/chosen` (beta (pi_c - ref_c)), `rewards/rejected`,
`rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`,
`objective/scores` (the mean reward of the completions), `objective/scores_margin` (chosen
minus rejected reward), `objective/kl` (the mean over completions of sum (pi - ref)),
`reward_mean` (as `objective/scores`, the name GRPO logs) and `completion_length`; with
`train.rewards`, each term's mean reward of the completions as `rewards/<name>/mean` (as GRPO
logs it), from the rollout's `rewards/<name>` fields.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config.rewards import term_name
from jaxllm.objectives.base import ObjectiveOutput, output, reference_logps, token_logps
from jaxllm.objectives.preference import dpo_loss


def rollout_fields(scores_S: np.ndarray, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """`chosen` and `rewards` [S, L] of a rollout whose S = 2N completions come in pairs of
    consecutive rows: the higher-scored of each pair is chosen, the first on a tie."""
    r_Nx2 = np.asarray(scores_S, np.float64).reshape(-1, 2)
    first = r_Nx2[:, 0] >= r_Nx2[:, 1]
    chosen_S = np.stack([first, ~first], axis=1).reshape(-1).astype(np.float32)
    return {
        "chosen": np.broadcast_to(chosen_S[:, None], shape),
        "rewards": np.broadcast_to(np.asarray(scores_S, np.float32)[:, None], shape),
    }


def objective(beta: float, names: tuple[str, ...] = ()):
    """The online DPO objective on rollout rows (see the module docstring), logging the means of
    the named reward terms `names`; it declares `others = ("reference",)`."""

    def online_dpo_objective(model, batch: dict, rng, others=None) -> ObjectiveOutput:
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        logp_BxL, out = token_logps(model, batch, rng)
        if not others or "reference" not in others:
            raise ValueError("the online_dpo objective needs others['reference']")
        ref_BxL = reference_logps(others["reference"], batch)

        def pairs(x_B):  # [B] -> (chosen [N], rejected [N]) of the consecutive row pairs
            c_Nx2 = batch["chosen"][:, 0].reshape(-1, 2)
            x_Nx2 = x_B.reshape(-1, 2)
            return jnp.sum(x_Nx2 * c_Nx2, -1), jnp.sum(x_Nx2 * (1 - c_Nx2), -1)

        length_B = jnp.sum(mask_BxL, axis=-1)
        pi_c, pi_r = pairs(jnp.sum(logp_BxL, -1))
        ref_c, ref_r = pairs(jnp.sum(ref_BxL, -1))
        terms = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
        n_c, n_r = pairs(length_B)
        valid = (n_c > 0) & (n_r > 0)  # padding rows weigh nothing
        count = jnp.sum(valid.astype(jnp.float32))

        def total(x):
            return jnp.sum(jnp.where(valid, jax.lax.stop_gradient(x), 0.0))

        score_c, score_r = pairs(batch["rewards"][:, 0])
        loss_sum = jnp.sum(jnp.where(valid, terms.loss, 0.0))
        kl_B = jnp.sum(logp_BxL - ref_BxL, -1)
        metrics = {
            "loss": jax.lax.stop_gradient(loss_sum),
            "rewards/chosen": total(terms.chosen_reward),
            "rewards/rejected": total(terms.rejected_reward),
            "rewards/margins": total(terms.chosen_reward - terms.rejected_reward),
            "rewards/accuracies": total((terms.chosen_reward > terms.rejected_reward) * 1.0),
            "logps/chosen": total(pi_c),
            "logps/rejected": total(pi_r),
            "objective/scores": total((score_c + score_r) / 2),
            "objective/scores_margin": total(score_c - score_r),
            "objective/kl": total(jnp.sum(jnp.stack(pairs(kl_B)), 0) / 2),
            "reward_mean": total((score_c + score_r) / 2),
            "completion_length": total((n_c + n_r) / 2),
        }
        for name in names:
            term_c, term_r = pairs(batch[f"rewards/{name}"][:, 0])
            metrics[f"rewards/{name}/mean"] = total((term_c + term_r) / 2)
        return output(model, out, loss_sum, count, metrics)

    online_dpo_objective.others = ("reference",)
    return online_dpo_objective


def from_train_config(t) -> object:
    """The online DPO objective with the `train` section `t`'s beta and reward terms."""
    return objective(t.beta, tuple(term_name(r) for r in t.rewards))
