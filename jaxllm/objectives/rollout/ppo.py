"""PPO: proximal policy optimisation with a learned value head, as an objective of the one step.

The policy samples its own batches as for GRPO (`sampling`); a completion of T tokens
a_0 .. a_{T-1} is an episode whose state s_t is the prompt and a_<t. The critic is the
policy's own value head (`model.value_head`: V(s_t) = h_t . w_v on the final hidden state h_t
that also predicts a_t), so one forward gives log pi(a_t | s_t) and V(s_t) [B, L].

Rewards and advantages (on the host, after the rollout's one batched forward of pi_old and
V_old; Schulman et al. 2016, GAE, arXiv:1506.02438, eq. 16):

    r_t   = R(completion) on the last token (its EOS when it stopped there), 0 before it
    delta_t = r_t + gamma V_old(s_{t+1}) - V_old(s_t),        V_old(s_T) = 0 (the episode ends)
    A_t   = delta_t + gamma lambda A_{t+1},                   A_T = 0
    G_t   = A_t + V_old(s_t)                                  (the value target, "returns")

with gamma = `train.gae_gamma`, lambda = `train.gae_lambda`; the advantages are then whitened
over every completion token of the batch, (A - mean) / sqrt(var + 1e-8) with the unbiased
variance (as TRL's `masked_whiten`).

The loss of a token (Schulman et al. 2017, PPO, arXiv:1707.06347, eqs. 7 and 9; the clipped
value loss of OpenAI's baselines, which TRL 1.16's PPOTrainer writes the same way):

    rho_t = exp(log pi(a_t) - log pi_old(a_t))
    pg_t  = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps))          eps = train.clip_epsilon
    vf_t  = 1/2 max((V_t - G_t)^2, (clip(V_t, V_old,t - eps_v, V_old,t + eps_v) - G_t)^2)
    l_t   = pg_t + c_v vf_t + beta k3_t                                 c_v = train.value_coef

with eps_v = `train.value_clip` and the KL to the reference in the loss, Schulman's k3 on the
sampled tokens as GRPO keeps it (`grpo.k3`), weighted by beta = `train.beta` (0: no
reference). TRL and InstructGPT (Ouyang et al. 2022, arXiv:2203.02155, eq. 2) instead
subtract beta (log pi_old - log ref) from each r_t; here the KL is a term of the loss, whose
gradient flows straight into the policy, and the value head fits the task reward only.

The loss is the mean of l_t over every completion token of the global batch, as TRL's
`masked_mean`: the rollout gives each completion token the weight w = S / T (S sequences, T
completion tokens in the batch, `token_weights`) and the objective's `tokens` is S, so the
step's division of the sums gives that mean however the batch is split into microbatches.

Rows are GRPO's (`loss_mask` on the completion, `old_logps`) with float32 [B, L] `old_values`,
`rewards` (r_t), `advantages`, `returns` and `token_weights`. Metrics, means over the step's
completion tokens unless said: `loss`, `policy_loss`, `value_loss` (vf_t before c_v), `kl`
(k3), `clip_ratio` (share of tokens whose ratio was clipped), `value_clip_ratio`,
`reward_mean` and `completion_length` (means over the sequences).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import Config, ConfigError
from jaxllm.objectives.base import ObjectiveOutput, output, reference_logps, token_logps
from jaxllm.objectives.rollout.grpo import k3


def gae(rewards_BxL, values_BxL, mask_BxL, gamma: float, lam: float):
    """(advantages A [B, L], returns G = A + V [B, L]) float32 of the episodes that `mask_BxL`
    marks (a contiguous run of completion tokens per row), 0 outside them (module docstring)."""
    r_BxL, v_BxL = (np.asarray(x, np.float64) for x in (rewards_BxL, values_BxL))
    m_BxL = np.asarray(mask_BxL, bool)
    adv_BxL = np.zeros_like(r_BxL)
    next_adv_B, next_value_B = np.zeros(len(r_BxL)), np.zeros(len(r_BxL))
    for t in reversed(range(r_BxL.shape[1])):
        # Past an episode's last token (mask 0 at t + 1) the state is terminal: V = A = 0.
        delta_B = r_BxL[:, t] + gamma * next_value_B - v_BxL[:, t]
        adv_BxL[:, t] = np.where(m_BxL[:, t], delta_B + gamma * lam * next_adv_B, 0.0)
        next_adv_B = adv_BxL[:, t]
        next_value_B = np.where(m_BxL[:, t], v_BxL[:, t], 0.0)
    returns_BxL = np.where(m_BxL, adv_BxL + v_BxL, 0.0)
    return adv_BxL.astype(np.float32), returns_BxL.astype(np.float32)


def whiten(x_BxL, mask_BxL) -> np.ndarray:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased variance), 0 elsewhere."""
    x_BxL, m_BxL = np.asarray(x_BxL, np.float64), np.asarray(mask_BxL, bool)
    values = x_BxL[m_BxL]
    var = values.var(ddof=1) if values.size > 1 else 0.0
    out_BxL = (x_BxL - values.mean()) / np.sqrt(var + 1e-8)
    return np.where(m_BxL, out_BxL, 0.0).astype(np.float32)


def rollout_fields(scores_S, old_values_BxL, mask_BxL, t) -> dict:
    """The PPO fields of a rollout batch of S completions scored `scores_S`, given V_old:
    `rewards`, `advantages` (whitened), `returns`, `token_weights` (module docstring)."""
    mask_BxL = np.asarray(mask_BxL, bool)
    last_B = mask_BxL.shape[1] - 1 - np.argmax(mask_BxL[:, ::-1], axis=1)  # last masked position
    rewards_BxL = np.zeros(mask_BxL.shape, np.float32)
    rows_B = np.flatnonzero(mask_BxL.any(axis=1))
    rewards_BxL[rows_B, last_B[rows_B]] = np.asarray(scores_S, np.float32)[rows_B]
    adv_BxL, returns_BxL = gae(rewards_BxL, old_values_BxL, mask_BxL, t.gae_gamma, t.gae_lambda)
    weight = len(rows_B) / max(int(mask_BxL.sum()), 1)
    return {
        "rewards": rewards_BxL,
        "advantages": whiten(adv_BxL, mask_BxL),
        "returns": returns_BxL,
        "token_weights": np.where(mask_BxL, np.float32(weight), np.float32(0)),
    }


def token_losses(logp, old, adv, values, old_values, returns, *, clip_epsilon, value_clip):
    """(pg_t, vf_t, ratio clipped, value clipped) [B, L] each: PPO's clipped policy and value
    losses per token (module docstring)."""
    ratio = jnp.exp(logp - old)
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip_epsilon, 1 + clip_epsilon))
    v_clipped = jnp.clip(values, old_values - value_clip, old_values + value_clip)
    vf_plain, vf_clip = jnp.square(values - returns), jnp.square(v_clipped - returns)
    vf = 0.5 * jnp.maximum(vf_plain, vf_clip)
    ratio_clipped = (-adv * jnp.clip(ratio, 1 - clip_epsilon, 1 + clip_epsilon)) > -adv * ratio
    return pg, vf, ratio_clipped.astype(jnp.float32), (vf_clip > vf_plain).astype(jnp.float32)


def objective(beta: float, clip_epsilon=0.2, value_coef=0.1, value_clip=0.2):
    """The PPO objective on rollout rows (module docstring). With beta > 0 it declares
    `others = ("reference",)`; the model must carry a value head (`model.value_head`)."""

    def ppo_objective(model, batch: dict, rng, others=None) -> ObjectiveOutput:
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        w_BxL = batch["token_weights"] * mask_BxL
        logp_BxL, out = token_logps(model, batch, rng)
        if out.values is None:
            raise ValueError("the ppo objective needs a model with a value head (value_head)")
        pg_BxL, vf_BxL, clipped_BxL, v_clipped_BxL = token_losses(
            logp_BxL,
            batch["old_logps"],
            batch["advantages"],
            out.values,
            batch["old_values"],
            batch["returns"],
            clip_epsilon=clip_epsilon,
            value_clip=value_clip,
        )
        loss_BxL = pg_BxL + value_coef * vf_BxL
        kl_BxL = None
        if beta:
            if not others or "reference" not in others:
                raise ValueError("the ppo objective with beta > 0 needs others['reference']")
            kl_BxL = k3(logp_BxL, reference_logps(others["reference"], batch))
            loss_BxL = loss_BxL + beta * kl_BxL
        loss_sum = jnp.sum(loss_BxL * w_BxL)
        valid_B = (jnp.sum(mask_BxL, axis=-1) > 0).astype(jnp.float32)
        count = jnp.sum(valid_B)

        def token_mean(x_BxL):  # summed with the weights w: the step's division makes a mean
            return jnp.sum(jax.lax.stop_gradient(x_BxL) * w_BxL)

        metrics = {
            "loss": jax.lax.stop_gradient(loss_sum),
            "policy_loss": token_mean(pg_BxL),
            "value_loss": token_mean(vf_BxL),
            "clip_ratio": token_mean(clipped_BxL),
            "value_clip_ratio": token_mean(v_clipped_BxL),
            "reward_mean": jnp.sum(batch["rewards"] * mask_BxL),  # r_t is the score, once
            "completion_length": jnp.sum(mask_BxL),
        }
        if kl_BxL is not None:
            metrics["kl"] = token_mean(kl_BxL)
        return output(model, out, loss_sum, count, metrics)

    ppo_objective.others = ("reference",) if beta else ()
    return ppo_objective


def from_config(cfg: Config):
    """The PPO objective of a run; ConfigError when its model has no value head. Under peft the
    value head trains beside the adapters (`jaxllm.model.lora.ValueParam`)."""
    if not cfg.model.value_head:
        raise ConfigError(
            "train.objective=ppo learns a value function: set model.value_head=true (a [D, 1] "
            "head beside the LM head; it starts fresh when checkpoint.init_from has none)."
        )
    t = cfg.train
    return objective(t.beta, t.clip_epsilon, t.value_coef, t.value_clip)
