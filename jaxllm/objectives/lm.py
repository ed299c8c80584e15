"""Language modelling: the next-token cross-entropy and the objectives that are it on other rows.

`next_token` is pretraining's objective. `sft` is supervised fine-tuning's: the same
cross-entropy over the tokens whose `loss_mask` is 1, which for chat / prompt_completion sources
(`jaxllm.data.sft`) are the assistant turns and completions only, so a run names what it does;
on plain text sources every token is in the mask and `sft` trains exactly as `next_token`.
`prefix_lm` is next-token prediction after a bidirectional prefix
(`jaxllm.data.objective_rows`). Masked LM, the same loss on an encoder's corrupted rows, is
`jaxllm.objectives.denoising.mlm`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.objectives.base import (
    Objective,
    ObjectiveOutput,
    masked_nll_sums,
    model_inputs,
    output,
)


def next_token(z_loss: float = 0.0, prefix: bool = False, loss_chunks: int = 1) -> Objective:
    """Mean next-token cross-entropy over the tokens whose `loss_mask` is 1, in float32, plus
    `z_loss` times the mean squared log-normaliser (PaLM, arXiv:2204.02311), plus the MoE
    balancing losses the model reports. Metrics: `loss` (the cross-entropy), `z_loss`.
    `prefix`: the batch's `prefix` attends bidirectionally (`prefix_lm`). `loss_chunks` > 1:
    the LM head and the loss run in that many chunks of the sequence (`masked_nll_sums`)."""

    def objective(model, batch: dict, rng) -> ObjectiveOutput:
        out = model(
            batch["inputs"],
            **model_inputs(batch),
            segment_ids_BxL=batch["segment_ids"],
            dropout_key=rng,
            hidden_only=loss_chunks > 1,
            **({"prefix_BxL": batch["prefix"]} if prefix else {}),
        )
        nll_sum, z_sum = masked_nll_sums(model, batch, out, loss_chunks)
        count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        loss_sum = nll_sum + z_loss * z_sum
        metrics = {"loss": nll_sum, "z_loss": z_sum}
        return output(model, out, loss_sum, count, metrics)

    return objective


def sft(z_loss: float = 0.0, loss_chunks: int = 1) -> Objective:
    """Supervised fine-tuning: `next_token` over the tokens the data marks as trained (the
    assistant turns / completions of SFT sources, or with data.train_on_prompt every token of
    the example); the mean is over those tokens only, so padding and prompts weigh nothing."""
    return next_token(z_loss, loss_chunks=loss_chunks)


def prefix_lm(z_loss: float = 0.0, loss_chunks: int = 1) -> Objective:
    """Prefix LM for decoders: `next_token` with each example's prefix
    (`jaxllm.data.objective_rows.PrefixLM`: the prompt, or a drawn length of plain text)
    attending bidirectionally, and the loss on what follows it."""
    return next_token(z_loss, prefix=True, loss_chunks=loss_chunks)
