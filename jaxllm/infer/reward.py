"""Scoring sequences with a reward model (`model.head=score`), e.g. as the reward of
policy-gradient training (GRPO, PPO) on the policy's rollouts.

A sequence's reward is the score head read at its last token, as in training
(`jaxllm.objectives.reward`) and in Hugging Face's `*ForSequenceClassification` (the last non-pad
token). Rows are right-padded; attention is causal, so the padding after a sequence never
reaches its last token, and only those positions go through the final norm and the head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def score(model, tokens_BxL: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """Rewards [B] float32 of the right-padded sequences `tokens_BxL`, the first `lengths_B`
    tokens of each row (a length of 0 reads position 0). Pure and jittable; `model` is a
    reward model (`Transformer` with `cfg.head == "score"`)."""
    if model.cfg.head != "score":
        raise ValueError("score() needs a reward model (model.head=score), not an LM head")
    last_Bx1 = jnp.clip(lengths_B - 1, 0, tokens_BxL.shape[1] - 1).astype(jnp.int32)[:, None]
    scores_Bx1x1 = model(tokens_BxL, logits_at_BxQ=last_Bx1).logits
    return scores_Bx1x1[:, 0, 0]
