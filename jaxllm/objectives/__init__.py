"""Objectives: what the train step minimises, plugged in from outside.

An objective is a function `(model, batch, rng) -> ObjectiveOutput`:

- `model` is the `nnx.Module` built from the step's parameters (differentiate through it);
- `batch` is one microbatch: a dict of [B, L] arrays (`inputs`, `targets`, `loss_mask`,
  `positions`, `segment_ids` from the built-in pipeline, or whatever the caller feeds);
- `rng` is a fresh key per step and microbatch (dropout, sampling), None in evaluation.

It returns *sums* over the batch, never means: the step adds them over microbatches and
divides by the token count of the whole global batch, so gradient accumulation equals one big
batch. Every metric is logged as its sum divided by that count. `model_stats` carries the
model's own statistics (MoE expert loads and balancing losses), which the step adds up and
hands back to the model after the update (`Transformer.after_step`): that is how the router
biases, the model's non-trained state, move.

`next_token` is pretraining's objective. `sft` is supervised fine-tuning's: the same
cross-entropy over the tokens whose `loss_mask` is 1, which for chat / prompt_completion sources
(`jaxllm.data.sft`) are the assistant turns and completions only, so a run names what it does;
on plain text sources every token is in the mask and `sft` trains exactly as `next_token`.
The DPO family, `dpo`, `ipo`, `simpo` and `orpo` (`jaxllm.objectives.preference`), are losses over
the (chosen, rejected) pairs of `format: preference` rows; their `tokens` is the number of pairs.
An objective that needs frozen models besides the policy names them in its `others` attribute
(`("reference",)` for DPO / IPO).
`reward` fits a reward model (`model.head=score`) to the same pairs (`jaxllm.objectives.reward`).
`grpo` (`jaxllm.objectives.rollout.grpo`) is GRPO's clipped, group-relative policy gradient with a KL to the
reference, on batches the policy samples itself (`jaxllm.objectives.rollout.sampling`); `ppo`
(`jaxllm.objectives.rollout.ppo`) is PPO on the same batches, with GAE from the policy's value head.
`distill` (`jaxllm.objectives.distill`) matches a frozen teacher's next-token distributions.
`mlm` is masked LM for encoders (`model.kind=encoder`): the pipeline corrupts the rows
(`jaxllm.data.mlm`) and the loss is cross-entropy at the selected positions. `prefix_lm` is
next-token prediction after a bidirectional prefix (`jaxllm.data.objective_rows`).
`span_corruption` (`jaxllm.objectives.denoising`) is T5's denoising loss of an encoder–decoder.
`train.objective` in the config names the objective of `jaxllm train`: `next_token`, `sft`, one of
the preference losses, `reward`, `grpo`, `ppo`, `distill`, `span_corruption`, or `MODULE:NAME` / `path/to/file.py:NAME`
for an objective of your own.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxllm.config import Config, ConfigError
from jaxllm.model import moe as moe_lib
from jaxllm.objectives import denoising, distill, preference, reward
from jaxllm.objectives.base import (
    Objective,
    ObjectiveOutput,
    load_function,
    masked_nll_sums,
    token_nll,
)
from jaxllm.objectives.rollout import grpo, ppo

__all__ = [
    "BUILT_IN",
    "Objective",
    "ObjectiveOutput",
    "from_config",
    "mlm",
    "next_token",
    "prefix_lm",
    "sft",
    "token_nll",
]


def next_token(z_loss: float = 0.0, prefix: bool = False, loss_chunks: int = 1) -> Objective:
    """Mean next-token cross-entropy over the tokens whose `loss_mask` is 1, in float32, plus
    `z_loss` times the mean squared log-normaliser (PaLM, arXiv:2204.02311), plus the MoE
    balancing losses the model reports. Metrics: `loss` (the cross-entropy), `z_loss`.
    `prefix`: the batch's `prefix` attends bidirectionally (`prefix_lm`). `loss_chunks` > 1:
    the LM head and the loss run in that many chunks of the sequence (`masked_nll_sums`)."""

    def objective(model, batch: dict, rng) -> ObjectiveOutput:
        out = model(
            batch["inputs"],
            positions_BxL=batch["positions"],
            segment_ids_BxL=batch["segment_ids"],
            dropout_key=rng,
            hidden_only=loss_chunks > 1,
            **({"prefix_BxL": batch["prefix"]} if prefix else {}),
        )
        nll_sum, z_sum = masked_nll_sums(model, batch, out, loss_chunks)
        count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        loss_sum = nll_sum + z_loss * z_sum
        metrics = {"loss": nll_sum, "z_loss": z_sum}
        stats = {}
        if out.aux:
            extra, aux_metrics, stats = moe_lib.objective_terms(model.cfg.moe, out.aux, count)
            loss_sum += extra
            metrics.update(aux_metrics)
        return ObjectiveOutput(loss_sum, count, metrics, stats)

    return objective


def sft(z_loss: float = 0.0, loss_chunks: int = 1) -> Objective:
    """Supervised fine-tuning: `next_token` over the tokens the data marks as trained (the
    assistant turns / completions of SFT sources, or with data.train_on_prompt every token of
    the example); the mean is over those tokens only, so padding and prompts weigh nothing."""
    return next_token(z_loss, loss_chunks=loss_chunks)


def mlm(z_loss: float = 0.0, loss_chunks: int = 1) -> Objective:
    """Masked LM (BERT): cross-entropy of the original tokens at the positions
    `jaxllm.data.mlm` selected (its rows carry them as `targets` and `loss_mask`, the corrupted
    tokens as `inputs`), computed by an encoder that sees the whole row. The loss is that of
    `next_token` on those rows: the data, not the step, decides what is predicted."""
    return next_token(z_loss, loss_chunks=loss_chunks)


def prefix_lm(z_loss: float = 0.0, loss_chunks: int = 1) -> Objective:
    """Prefix LM for decoders: `next_token` with each example's prefix
    (`jaxllm.data.objective_rows.PrefixLM`: the prompt, or a drawn length of plain text)
    attending bidirectionally, and the loss on what follows it."""
    return next_token(z_loss, prefix=True, loss_chunks=loss_chunks)


BUILT_IN = {
    "next_token": lambda cfg: next_token(cfg.train.z_loss, loss_chunks=cfg.train.loss_chunks),
    "sft": lambda cfg: sft(cfg.train.z_loss, cfg.train.loss_chunks),
    "mlm": lambda cfg: mlm(cfg.train.z_loss, cfg.train.loss_chunks),
    "prefix_lm": lambda cfg: prefix_lm(cfg.train.z_loss, cfg.train.loss_chunks),
    **{
        kind: (lambda cfg, kind=kind: preference.from_train_config(kind, cfg.train))
        for kind in preference.KINDS
    },
    "reward": lambda cfg: reward.objective(),
    "grpo": lambda cfg: grpo.from_train_config(cfg.train),
    "ppo": ppo.from_config,
    "distill": distill.from_config,
    "span_corruption": lambda cfg: denoising.span_corruption(cfg.train.z_loss),
}
# The built-ins that read train.z_loss; set for another objective it would do nothing.
Z_LOSS_OBJECTIVES = ("next_token", "sft", "mlm", "prefix_lm", "span_corruption")
# The built-ins that read train.loss_chunks.
LOSS_CHUNK_OBJECTIVES = ("next_token", "sft", "mlm", "prefix_lm")


def _check_head(name: str, head: str) -> None:
    """A built-in objective fits the model's head: `reward` the score head of a reward model,
    every other one the LM head (an objective of your own may use either)."""
    if name == "reward" and head != "score":
        raise ConfigError(
            "train.objective=reward trains a scalar score head: set model.head=score (the LM "
            "head is dropped and the score head starts fresh)."
        )
    if name != "reward" and head == "score":
        raise ConfigError(
            f"train.objective={name} needs the LM head, but model.head=score; set "
            "model.head=lm, or train.objective=reward to train the reward model."
        )


def _check_kind(name: str, kind: str) -> None:
    """An encoder–decoder trains with `span_corruption`, which trains nothing else (an
    objective of your own may train either)."""
    if (name == "span_corruption") != (kind == "encoder_decoder"):
        raise ConfigError(
            f"train.objective={name} does not train model.kind={kind}: an encoder–decoder "
            "(model.kind=encoder_decoder) trains with train.objective=span_corruption."
        )


def from_config(cfg: Config) -> Objective:
    """The objective `train.objective` names: a built-in (`BUILT_IN`), or `MODULE:NAME` /
    `FILE.py:NAME` naming an objective function. ConfigError when it cannot be loaded."""
    name = cfg.train.objective
    if cfg.train.z_loss and name not in Z_LOSS_OBJECTIVES:
        raise ConfigError(
            f"train.z_loss belongs to the next_token objective, not to train.objective={name!r}"
            + ("; add a z-loss to your objective instead" if name not in BUILT_IN else "")
        )
    if name in BUILT_IN:
        _check_head(name, cfg.model.head)
        _check_kind(name, cfg.model.kind)
        return BUILT_IN[name](cfg)
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise ConfigError(
            f"train.objective={name!r}: use one of {', '.join(BUILT_IN)}, or MODULE:NAME / "
            "path/to/file.py:NAME"
        )
    return load_function(name, "train.objective")
