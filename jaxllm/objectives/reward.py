"""Reward models: a decoder with a scalar head (`model.head=score`) fitted to preference pairs
by the Bradley-Terry model (Bradley & Terry 1952), as in InstructGPT (Ouyang et al. 2022,
arXiv:2203.02155) and TRL's `RewardTrainer`:

    p(chosen > rejected) = sigmoid(r(x, y_chosen) - r(x, y_rejected)),
    loss = -log sigmoid(r_chosen - r_rejected), averaged over pairs,

where r(x, y) is the score head read at the last token of prompt + answer. The pairs come in
the preference layout (`jaxllm.objectives.base`); the packer gives each sequence one extra input
position holding its last token (`whole_inputs`), so the last input position of a segment has
seen the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.objectives.base import Objective, ObjectiveOutput, output, pair_sums


def last_positions(positions_BxL: jax.Array, segment_ids_BxL: jax.Array) -> jax.Array:
    """1.0 at the last position of every segment (padding excluded), else 0.0. Found as the
    position equal to its segment's largest, not by comparing neighbours, so it holds under
    any permutation of a row (ring attention's zigzag layout)."""
    num = segment_ids_BxL.shape[1] + 1

    def per_row(pos_L, seg_L):
        top = jax.ops.segment_max(pos_L, seg_L, num_segments=num)
        return (pos_L == top[seg_L]) & (seg_L > 0)

    return jax.vmap(per_row)(positions_BxL, segment_ids_BxL).astype(jnp.float32)


def sequence_scores(model, batch: dict, rng=None):
    """(scores at each segment's last position [B, L] (0 elsewhere), the model's output)."""
    out = model(
        batch["inputs"],
        positions_BxL=batch["positions"],
        segment_ids_BxL=batch["segment_ids"],
        dropout_key=rng,
    )
    last_BxL = last_positions(batch["positions"], batch["segment_ids"])
    return out.logits[..., 0] * last_BxL, out


def bradley_terry(scores_BxL: jax.Array, segment_ids_BxL: jax.Array):
    """(loss sum, number of valid pairs, metric sums) of the scores at each segment's last
    position (0 elsewhere, `sequence_scores`) of rows in the preference layout. Metrics:
    `loss`, `accuracy` (r_chosen > r_rejected), `rewards/chosen`, `rewards/rejected`,
    `rewards/margins`, each summed over the valid pairs."""
    chosen_BxP, rejected_BxP, valid_BxP = pair_sums(scores_BxL, segment_ids_BxL)
    valid_BxP = valid_BxP.astype(jnp.float32)
    margin_BxP = chosen_BxP - rejected_BxP
    # -log sigmoid(m) = softplus(-m), stable for margins of either sign
    nll_sum = jnp.sum(-jax.nn.log_sigmoid(margin_BxP) * valid_BxP)
    metrics = {
        "loss": nll_sum,
        "accuracy": jnp.sum((margin_BxP > 0) * valid_BxP),
        "rewards/chosen": jnp.sum(chosen_BxP * valid_BxP),
        "rewards/rejected": jnp.sum(rejected_BxP * valid_BxP),
        "rewards/margins": jnp.sum(margin_BxP * valid_BxP),
    }
    return nll_sum, jnp.sum(valid_BxP), metrics


def objective() -> Objective:
    """The `reward` objective: the Bradley-Terry loss of the scores at each sequence's last
    token over the valid pairs of the batch; `tokens` counts those pairs, so every metric is per
    pair: `loss`, `accuracy`, `rewards/chosen`, `rewards/rejected`, `rewards/margins`, and an
    MoE model's balancing losses (weighted per pair)."""

    def reward_objective(model, batch: dict, rng) -> ObjectiveOutput:
        scores_BxL, out = sequence_scores(model, batch, rng)
        loss_sum, count, metrics = bradley_terry(scores_BxL, batch["segment_ids"])
        return output(model, out, loss_sum, count, metrics)

    return reward_objective
