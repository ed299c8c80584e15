"""Reward models: a decoder with a scalar head (`model.head=score`) fitted to preference pairs
by the Bradley-Terry model (Bradley & Terry 1952), as in InstructGPT (Ouyang et al. 2022,
arXiv:2203.02155) and TRL's `RewardTrainer`:

    p(chosen > rejected) = sigmoid(r(x, y_chosen) - r(x, y_rejected)),
    loss = -log sigmoid(r_chosen - r_rejected), averaged over pairs,

where r(x, y) is the score head read at the last token of prompt + answer. The pairs come in
the preference layout (`jaxllm.objectives.base`); the packer gives each sequence one extra input
position holding its last token (`whole_inputs`), so the last input position of a segment has
seen the whole sequence.

A process reward model (`prm`; Lightman et al. 2023, arXiv:2305.20050; TRL's `PRMTrainer`)
uses the same head as a token classifier: it scores each step of a solution at the step's
last token, the separator (`jaxllm.data.stepwise`), fitted to the step's label by the binary
cross-entropy -[y log sigmoid(s) + (1 - y) log sigmoid(-s)]. TRL's token classifier has two
logits (l0, l1) and a cross-entropy over them, which is this loss at s = l1 - l0.
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


def step_loss(scores_BxL: jax.Array, labels_BxL: jax.Array, mask_BxL: jax.Array):
    """(loss sum, scored steps, metric sums) of step scores at the positions where `mask` is 1
    against 0 / 1 labels: `loss` (binary cross-entropy), `accuracy` (score > 0 == label),
    `rewards/step`: the mean step score."""
    mask_BxL = mask_BxL.astype(jnp.float32)
    y_BxL = labels_BxL.astype(jnp.float32)
    scores_BxL = scores_BxL.astype(jnp.float32)
    # -[y log sigmoid(s) + (1 - y) log sigmoid(-s)] = softplus(s) - y s, stable either sign
    bce_BxL = jax.nn.softplus(scores_BxL) - y_BxL * scores_BxL
    loss_sum = jnp.sum(bce_BxL * mask_BxL)
    metrics = {
        "loss": loss_sum,
        "accuracy": jnp.sum(((scores_BxL > 0) == (y_BxL > 0.5)) * mask_BxL),
        "rewards/step": jnp.sum(scores_BxL * mask_BxL),
    }
    return loss_sum, jnp.sum(mask_BxL), metrics


def prm() -> Objective:
    """The `prm` objective: the binary cross-entropy of the score head at every scored step
    (`loss_mask`) against its label (`targets`); `tokens` counts the scored steps, so every
    metric is per step: `loss`, `accuracy`, `rewards/step`."""

    def prm_objective(model, batch: dict, rng) -> ObjectiveOutput:
        out = model(
            batch["inputs"],
            positions_BxL=batch["positions"],
            segment_ids_BxL=batch["segment_ids"],
            dropout_key=rng,
        )
        loss_sum, count, metrics = step_loss(
            out.logits[..., 0], batch["targets"], batch["loss_mask"]
        )
        return output(model, out, loss_sum, count, metrics)

    return prm_objective
