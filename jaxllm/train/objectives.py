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
`reward` fits a reward model (`model.head=score`) to preference pairs (`jaxllm.train.reward`).
`train.objective` in the config names the objective of `jaxllm train`: `next_token`, `sft`,
`reward`, or `MODULE:NAME` / `path/to/file.py:NAME` for an objective of your own.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import Config, ConfigError
from jaxllm.model import moe as moe_lib
from jaxllm.train import reward as reward_lib


class ObjectiveOutput(NamedTuple):
    """What an objective returns for one (micro)batch; all sums over the batch."""

    loss_sum: jax.Array  # float32 scalar the gradient comes from
    tokens: jax.Array  # float32 scalar: what the sums count; the step divides by the total
    metrics: dict[str, jax.Array] = {}  # sums; logged as sum / tokens (`loss` is eval's loss)
    model_stats: Any = {}  # the model's aux sums (MoE), for `Transformer.after_step`


Objective = Callable[[nnx.Module, dict, "jax.Array | None"], ObjectiveOutput]


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array):
    """(-log p(target) [B, L], log Z [B, L]) in float32: the pieces of a token-level loss."""
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    logz_BxL = jax.nn.logsumexp(logits_BxLxV, axis=-1)
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], -1)[..., 0]
    return logz_BxL - target_logit_BxL, logz_BxL


def next_token(z_loss: float = 0.0) -> Objective:
    """Mean next-token cross-entropy over the tokens whose `loss_mask` is 1, in float32, plus
    `z_loss` times the mean squared log-normaliser (PaLM, arXiv:2204.02311), plus the MoE
    balancing losses the model reports. Metrics: `loss` (the cross-entropy), `z_loss`."""

    def objective(model, batch: dict, rng) -> ObjectiveOutput:
        out = model(
            batch["inputs"],
            positions_BxL=batch["positions"],
            segment_ids_BxL=batch["segment_ids"],
            dropout_key=rng,
        )
        nll_BxL, logz_BxL = token_nll(out.logits, batch["targets"])
        mask_BxL = batch["loss_mask"].astype(jnp.float32)
        nll_sum = jnp.sum(nll_BxL * mask_BxL)
        z_sum = jnp.sum(jnp.square(logz_BxL) * mask_BxL)
        count = jnp.sum(mask_BxL)
        loss_sum = nll_sum + z_loss * z_sum
        metrics = {"loss": nll_sum, "z_loss": z_sum}
        stats = {}
        if out.aux:
            extra, aux_metrics, stats = moe_lib.objective_terms(model.cfg.moe, out.aux, count)
            loss_sum += extra
            metrics.update(aux_metrics)
        return ObjectiveOutput(loss_sum, count, metrics, stats)

    return objective


def sft(z_loss: float = 0.0) -> Objective:
    """Supervised fine-tuning: `next_token` over the tokens the data marks as trained (the
    assistant turns / completions of SFT sources, or with data.train_on_prompt every token of
    the example); the mean is over those tokens only, so padding and prompts weigh nothing."""
    return next_token(z_loss)


def reward() -> Objective:
    """A reward model (`model.head=score`) on preference pairs: the Bradley-Terry loss
    -log sigmoid(r_chosen - r_rejected) per pair, r read at the last token of each sequence
    (`jaxllm.train.reward`); `tokens` counts the valid pairs, so every metric is per pair:
    `loss`, `accuracy`, `rewards/chosen`, `rewards/rejected`, `rewards/margins`, and an MoE
    model's balancing losses."""

    def objective(model, batch: dict, rng) -> ObjectiveOutput:
        scores_BxL, out = reward_lib.sequence_scores(model, batch, rng)
        loss_sum, count, metrics = reward_lib.bradley_terry(scores_BxL, batch["segment_ids"])
        stats = {}
        if out.aux:
            extra, aux_metrics, stats = moe_lib.objective_terms(model.cfg.moe, out.aux, count)
            loss_sum += extra
            metrics.update(aux_metrics)
        return ObjectiveOutput(loss_sum, count, metrics, stats)

    return objective


BUILT_IN = {
    "next_token": lambda cfg: next_token(cfg.train.z_loss),
    "sft": lambda cfg: sft(cfg.train.z_loss),
    "reward": lambda cfg: reward(),
}


def from_config(cfg: Config) -> Objective:
    """The objective `train.objective` names: a built-in (`BUILT_IN`), or `MODULE:NAME` /
    `FILE.py:NAME` naming an objective function. ConfigError when it cannot be loaded."""
    name = cfg.train.objective
    if name in BUILT_IN:
        return BUILT_IN[name](cfg)
    if cfg.train.z_loss:
        raise ConfigError(
            f"train.z_loss belongs to the next_token objective, not to train.objective={name!r}; "
            "add a z-loss to your objective instead"
        )
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise ConfigError(
            f"train.objective={name!r}: use one of {', '.join(BUILT_IN)}, or MODULE:NAME / "
            "path/to/file.py:NAME"
        )
    try:
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if spec is None or not Path(where).is_file():
                raise FileNotFoundError(where)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, attr)
    except (ImportError, FileNotFoundError, AttributeError) as e:
        raise ConfigError(f"train.objective={name!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ConfigError(f"train.objective={name!r} is not a function")
    return fn
