"""Denoising objectives: masked LM for encoders, span corruption for encoder–decoders.

`mlm` (BERT) is the cross-entropy of the original tokens at the positions `jaxllm.data.mlm`
selected, computed by an encoder (`model.kind=encoder`) that sees the whole corrupted row: the
loss of `jaxllm.objectives.lm.next_token` on those rows.

`span_corruption` is T5's denoising objective for `model.kind=encoder_decoder`. The batch
(`jaxllm.data.span_corruption`) holds the encoder's `inputs` [B, S] with their `segment_ids`
(0 on padding), and the decoder's `decoder_inputs`, `targets` and `loss_mask` [B, L]. The loss
is the cross-entropy of the decoder's predictions of `targets` (each sentinel and the span it
hides, then EOS) over the `loss_mask` tokens, with teacher forcing.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.objectives.base import Objective, ObjectiveOutput, token_nll
from jaxllm.objectives.lm import next_token


def mlm(z_loss: float = 0.0, loss_chunks: int = 1) -> Objective:
    """Masked LM (BERT): cross-entropy of the original tokens at the positions
    `jaxllm.data.mlm` selected (its rows carry them as `targets` and `loss_mask`, the corrupted
    tokens as `inputs`), computed by an encoder that sees the whole row. The loss is that of
    `next_token` on those rows: the data, not the step, decides what is predicted."""
    return next_token(z_loss, loss_chunks=loss_chunks)


def span_corruption(z_loss: float = 0.0) -> Objective:
    """Mean decoder cross-entropy over the target tokens (`loss`), plus `z_loss` times the mean
    squared log-normaliser (`z_loss`)."""

    def objective(model, batch: dict, rng) -> ObjectiveOutput:
        out = model(
            batch["inputs"],
            batch["decoder_inputs"],
            segment_ids_BxS=batch["segment_ids"],
            dropout_key=rng,
        )
        nll_BxL, logz_BxL = token_nll(out.logits, batch["targets"])
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        nll_sum = jnp.sum(nll_BxL * mask_BxL)
        z_sum = jnp.sum(jnp.square(logz_BxL) * mask_BxL)
        metrics = {"loss": nll_sum, "z_loss": z_sum}
        return ObjectiveOutput(nll_sum + z_loss * z_sum, jnp.sum(mask_BxL), metrics, {})

    return objective
