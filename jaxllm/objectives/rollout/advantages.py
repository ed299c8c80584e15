"""The critic-free advantages, computed on the host from a rollout's scores (float64 NumPy).

S completions come as S / G groups of G consecutive completions of one prompt, with rewards r.

- GRPO family (`group_advantages`, TRL 1.16's `scale_rewards`): A_i = (r_i - mean_g r) / (std
  + 1e-4) with the group's std (`group`, Shao et al. 2024), the whole batch's (`batch`), or
  A_i = r_i - mean_g r (`none`, Dr. GRPO); stds with Bessel's correction, as TRL's `nanstd`.
- RLOO (`rloo_advantages`, Ahmadian et al. 2024, arXiv:2402.14740, eq. 4 / TRL's RLOOTrainer):
  A_i = r_i - 1 / (G - 1) sum_{j != i} r_j, where with beta > 0 each reward first loses
  beta * sum_t (log pi_old - log ref) over its completion (the k1 KL, in the reward).
- REINFORCE++ (`reinforce_pp_advantages`, Hu 2025, arXiv:2501.03262, eqs. 4-6): the token
  reward is -beta * (log pi_old - log ref) on every completion token plus the score on the
  last; a token's return is the sum of the rewards from it on (gamma = 1); the advantages are
  those returns normalised by the mean and std over every completion token of the batch.
- DAPO's soft overlong punishment (`overlong_penalties`, Yu et al. 2025, arXiv:2503.14476,
  eq. 13 / TRL's `get_soft_overlong_punishment`): a completion of n tokens, n > L_max - buffer,
  gains (L_max - buffer - n) / buffer * penalty, added to its reward.
- DAPO's dynamic sampling keeps the groups whose rewards are not all equal (`varied_groups`).
"""

from __future__ import annotations

import numpy as np

SCALES = ("group", "batch", "none")


def _std(x: np.ndarray, axis=None, keepdims=False) -> np.ndarray:
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return np.zeros_like(x.mean(axis=axis, keepdims=keepdims))
    return x.std(axis=axis, ddof=1, keepdims=keepdims)


def group_stds(rewards_S, group: int) -> np.ndarray:
    """Each completion's group std of the rewards [S] (float64)."""
    r_NxG = np.asarray(rewards_S, np.float64).reshape(-1, group)
    return np.repeat(_std(r_NxG, axis=1), group)


def group_advantages(rewards_S, group: int, scale: str = "group") -> np.ndarray:
    """GRPO's advantages [S] float32 (see the module docstring)."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale_rewards {scale!r}; one of {SCALES}")
    r_NxG = np.asarray(rewards_S, np.float64).reshape(-1, group)
    centred_NxG = r_NxG - r_NxG.mean(axis=1, keepdims=True)
    if scale == "group":
        centred_NxG = centred_NxG / (_std(r_NxG, axis=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        centred_NxG = centred_NxG / (_std(r_NxG) + 1e-4)
    return centred_NxG.reshape(-1).astype(np.float32)


def rloo_advantages(rewards_S, group: int) -> np.ndarray:
    """RLOO's leave-one-out advantages [S] float32 (G >= 2)."""
    r_NxG = np.asarray(rewards_S, np.float64).reshape(-1, group)
    baseline_NxG = (r_NxG.sum(axis=1, keepdims=True) - r_NxG) / (group - 1)
    return (r_NxG - baseline_NxG).reshape(-1).astype(np.float32)


def reinforce_pp_advantages(scores_S, kl_SxL, mask_SxL, beta: float) -> np.ndarray:
    """REINFORCE++'s token advantages [S, L] float32, 0 outside the completions' mask."""
    mask_SxL = np.asarray(mask_SxL, np.float64)
    reward_SxL = -beta * np.asarray(kl_SxL, np.float64) * mask_SxL
    has_S = mask_SxL.any(axis=1)
    last_S = mask_SxL.shape[1] - 1 - np.argmax(mask_SxL[:, ::-1], axis=1)
    rows = np.nonzero(has_S)[0]
    reward_SxL[rows, last_S[rows]] += np.asarray(scores_S, np.float64)[rows]
    returns_SxL = np.cumsum(reward_SxL[:, ::-1], axis=1)[:, ::-1] * mask_SxL
    n = max(mask_SxL.sum(), 1.0)
    mean = returns_SxL.sum() / n
    var = (np.square(returns_SxL - mean) * mask_SxL).sum() / n
    return ((returns_SxL - mean) / (np.sqrt(var) + 1e-8) * mask_SxL).astype(np.float32)


def overlong_penalties(lengths_S, max_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment [S] (<= 0) of completions of `lengths_S` tokens."""
    n_S = np.asarray(lengths_S, np.float64)
    if buffer <= 0:
        return np.zeros_like(n_S)
    start = max_tokens - buffer
    return np.where(n_S > start, (start - n_S) / buffer * penalty, 0.0)


def varied_groups(rewards_S, group: int) -> np.ndarray:
    """[S / G] bool: the groups whose rewards are not all equal (dynamic sampling keeps them)."""
    r_NxG = np.asarray(rewards_S, np.float64).reshape(-1, group)
    return ~np.all(r_NxG == r_NxG[:, :1], axis=1)
