"""The critic-free objectives' part of a rollout (`sampling.Rollouts`): DAPO's dynamic sampling
(`refill`) and the batch's fields (`fields`) from the scores, in `train.grpo`'s settings
(`jaxllm.config.grpo.settings`).

Dynamic sampling: after a rollout's groups are scored (overlong punishment included), those
whose rewards are all equal (zero advantage, no gradient) are dropped; round j = 1, 2, ...,
`max_resample` draws the step's prompts again from a generator seeded by (data.seed, rollout
number, j), samples each row with a key seeded by (run.seed, rollout number, row, j), and
keeps its varied groups, until this process's share of the batch is full; it is then filled
with dropped groups in their order. Each process fills its own rows from its own draws, so
the batches depend on the process count (with one process they are those of any layout).

The fields, on every position of a row (float32 [S, L]) besides `advantages`: `rewards` (the
score with the overlong punishment), `reward_std` (its group's std), `zero_std` (1 where that
std is 0), `truncated` (1 where the completion hit max_completion_tokens without a stop),
`lengths` (the completion's tokens, its stop included), `batch_tokens` (the batch's trained
completion tokens / S, for the token-level losses and metrics) and
for RLOO / REINFORCE++ with beta > 0 `kl` (log pi_old - log ref per token, the k1 of the
reward). With `mask_truncated_completions` a truncated row's `loss_mask` is all 0.
"""

from __future__ import annotations

import numpy as np

from jaxllm.data.vision_rows import KEYS as IMAGE_KEYS
from jaxllm.objectives.rollout import advantages as adv_lib
from jaxllm.sharding import to_global


def shaped(scores_S, lengths_S, max_tokens: int, s) -> np.ndarray:
    """The scores with DAPO's overlong punishment added (settings `s`)."""
    extra_S = adv_lib.overlong_penalties(
        lengths_S, max_tokens, s.overlong_buffer, s.overlong_penalty
    )
    return np.asarray(scores_S, np.float64) + extra_S


def refill(first, more, group: int, rounds: int, score):
    """Dynamic sampling's rows (see the module docstring). `first`: the rollout's sampled rows,
    a list of per-row tuples whose `score(rows)` gives their shaped rewards; `more(j)` samples
    round j's rows the same way. Returns as many rows as `first`, whole groups."""
    need = len(first) // group

    def groups(rows):
        keep = adv_lib.varied_groups(score(rows), group)
        split = [rows[i * group : (i + 1) * group] for i in range(len(rows) // group)]
        return [g for g, k in zip(split, keep) if k], [g for g, k in zip(split, keep) if not k]

    kept, dropped = groups(first)
    for j in range(1, rounds + 1):
        if len(kept) >= need:
            break
        more_kept, _ = groups(more(j))
        kept += more_kept
    chosen = (kept + dropped)[:need]
    return [row for g in chosen for row in g]


def fields(objective: str, s, beta: float, group: int, max_tokens: int, batch: dict,
           scores_S, lengths_S, truncated_S, ref_logps=None) -> dict:  # fmt: skip
    """The rollout's fields of a critic-free objective (see the module docstring). `batch`: the
    whole batch's rows with `old_logps`; `ref_logps()`: the reference's [S, L] log-probabilities
    of its targets (RLOO / REINFORCE++ with beta > 0)."""
    shape = batch["inputs"].shape
    rewards_S = shaped(scores_S, lengths_S, max_tokens, s)
    truncated_S = np.asarray(truncated_S, np.float32)
    mask_SxL = batch["loss_mask"]
    out = {"lengths": _rows(mask_SxL.sum(-1), shape)}  # before any masking
    if s.mask_truncated:
        mask_SxL = (mask_SxL * (1 - truncated_S[:, None])).astype(mask_SxL.dtype)
        out["loss_mask"] = mask_SxL
    kl_SxL = None
    if objective in ("rloo", "reinforce_pp") and beta:
        kl_SxL = (batch["old_logps"] - np.asarray(ref_logps(), np.float64)) * mask_SxL
        out["kl"] = kl_SxL.astype(np.float32)
    if objective == "rloo":
        penalised_S = rewards_S - beta * kl_SxL.sum(-1) if kl_SxL is not None else rewards_S
        out["advantages"] = _rows(adv_lib.rloo_advantages(penalised_S, group), shape)
    elif objective == "reinforce_pp":
        kl_SxL = np.zeros(shape) if kl_SxL is None else kl_SxL
        out["advantages"] = adv_lib.reinforce_pp_advantages(rewards_S, kl_SxL, mask_SxL, beta)
    else:
        out["advantages"] = _rows(
            adv_lib.group_advantages(rewards_S, group, s.scale_rewards), shape
        )
    std_S = adv_lib.group_stds(rewards_S, group)
    out |= {
        "rewards": _rows(rewards_S, shape),
        "reward_std": _rows(std_S, shape),
        "zero_std": _rows(np.isclose(std_S, 0.0), shape),
        "truncated": _rows(truncated_S, shape),
        "batch_tokens": _rows(np.full(shape[0], mask_SxL.sum() / shape[0]), shape),
    }
    return out


def finish(rollouts, batch: dict, scored, weights, others) -> dict:
    """`fields` of a `sampling.Rollouts` batch: `scored` = (scores, completion tokens,
    truncated) [S] each; the reference runs on the mesh over `weights` and `others` (the live
    TrainState's held models), a collective."""
    t, local = rollouts.cfg.train, rollouts.local

    def ref_logps():
        gbs, length = t.global_batch_size, rollouts.cfg.data.seq_len
        slots = np.broadcast_to(np.arange(length, dtype=np.int32), (gbs, length))
        keys = ("inputs", "targets", "positions", "segment_ids", "loss_mask", *IMAGE_KEYS)
        rows = {k: batch[k][local] for k in keys if k in batch} | {"slots": slots[local]}
        got = rollouts.reference(*weights, others, to_global(rows, rollouts.batch_sharding, gbs))
        return np.asarray(got.addressable_data(0))  # replicated

    return fields(t.objective, rollouts.settings, t.beta, rollouts.group,
                  t.max_completion_tokens, batch, *scored, ref_logps)  # fmt: skip


def _rows(x_S, shape) -> np.ndarray:
    return np.broadcast_to(np.asarray(x_S, np.float32)[:, None], shape)
