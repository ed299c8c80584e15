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

One module per family, each building on `base` (`ObjectiveOutput`, `Objective`, the shared
sums); this package holds the registry of built-ins (`BUILT_IN`) and the resolution of
`train.objective` (`from_config`):

- `lm`: `next_token` (pretraining), `sft` (the same cross-entropy over the tokens whose
  `loss_mask` is 1: for chat / prompt_completion sources the assistant turns and completions),
  `prefix_lm` (next-token prediction after a bidirectional prefix).
- `preference`: the DPO family, `dpo`, `ipo`, `simpo` and `orpo`, losses over the (chosen,
  rejected) pairs of `format: preference` rows; their `tokens` is the number of pairs.
- `kto`: KTO on the desirable / undesirable examples of `format: unpaired_preference` rows.
- `reward`: fits a reward model (`model.head=score`) to the same pairs (Bradley-Terry);
  `prm` a process reward model to the step labels of `format: stepwise` solutions.
- `rollout`: `grpo` (GRPO's clipped, group-relative policy gradient with a KL to the
  reference; its presets `dr_grpo`, `dapo`, `gspo` and the options of `train.grpo`), `rloo`,
  `reinforce_pp` (`rollout.advantages`) and `ppo` (PPO with GAE from the policy's value head),
  on batches the policy samples itself (`rollout.sampling`), scored by `rollout.rewards`;
  `online_dpo` (DPO's loss on the two sampled completions of each prompt, ranked by the reward).
- `distill`: matches a frozen teacher's next-token distributions, on the data or, with
  `train.distill_lambda`, partly on the student's own samples (GKD, `rollout.onpolicy`).
- `denoising`: `mlm` (masked LM for encoders, `model.kind=encoder`, on rows `jaxllm.data.mlm`
  corrupts) and `span_corruption` (T5's denoising loss of an encoder–decoder).

An objective that needs frozen models besides the policy names them in its `others` attribute
(`("reference",)` for DPO / IPO); the engine holds them (`jaxllm.train.companions`).
`train.objective` in the config names the objective of `jaxllm train`: `next_token`, `sft`,
`mlm`, `prefix_lm`, one of the preference losses, `kto`, `reward`, the rollout objectives, `distill`,
`span_corruption`, or `MODULE:NAME` / `path/to/file.py:NAME` for an objective of your own.
"""

from __future__ import annotations

from jaxllm.config import Config, ConfigError
from jaxllm.config.grpo import CRITIC_FREE
from jaxllm.config.rewards import term_name
from jaxllm.objectives import denoising, distill, kto, preference, reward
from jaxllm.objectives.base import Objective, ObjectiveOutput, load_function, token_nll
from jaxllm.objectives.denoising import mlm
from jaxllm.objectives.lm import next_token, prefix_lm, sft
from jaxllm.objectives.rollout import grpo, online_dpo, ppo
from jaxllm.objectives.rollout.rewards import with_term_metrics

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


BUILT_IN = {
    "next_token": lambda cfg: next_token(cfg.train.z_loss, loss_chunks=cfg.train.loss_chunks),
    "sft": lambda cfg: sft(cfg.train.z_loss, cfg.train.loss_chunks),
    "mlm": lambda cfg: mlm(cfg.train.z_loss, cfg.train.loss_chunks),
    "prefix_lm": lambda cfg: prefix_lm(cfg.train.z_loss, cfg.train.loss_chunks),
    **{
        kind: (lambda cfg, kind=kind: preference.from_train_config(kind, cfg.train))
        for kind in preference.KINDS
    },
    "kto": lambda cfg: kto.from_train_config(cfg.train),
    "reward": lambda cfg: reward.objective(),
    "prm": lambda cfg: reward.prm(),
    **{
        name: (lambda cfg: _named_rewards(cfg, grpo.from_train_config(cfg.train), True))
        for name in CRITIC_FREE
    },
    "ppo": lambda cfg: _named_rewards(cfg, ppo.from_config(cfg), False),
    "online_dpo": lambda cfg: online_dpo.from_train_config(cfg.train),
    "distill": distill.from_config,
    "span_corruption": lambda cfg: denoising.span_corruption(cfg.train.z_loss),
}


def _named_rewards(cfg: Config, objective: Objective, every_row: bool) -> Objective:
    """A rollout objective that logs each of `train.rewards` by name (none without it)."""
    if not cfg.train.rewards:
        return objective
    names = [term_name(r) for r in cfg.train.rewards]
    return with_term_metrics(objective, names, every_row=every_row)


# The built-ins that read train.z_loss; set for another objective it would do nothing.
Z_LOSS_OBJECTIVES = ("next_token", "sft", "mlm", "prefix_lm", "span_corruption")
# The built-ins that read train.loss_chunks.
LOSS_CHUNK_OBJECTIVES = ("next_token", "sft", "mlm", "prefix_lm")


def _check_head(name: str, head: str) -> None:
    """A built-in objective fits the model's head: `reward` / `prm` the score head of a reward model,
    every other one the LM head (an objective of your own may use either)."""
    scored = name in ("reward", "prm")
    if scored and head != "score":
        raise ConfigError(
            f"train.objective={name} trains a scalar score head: set model.head=score (the LM "
            "head is dropped and the score head starts fresh)."
        )
    if not scored and head == "score":
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
