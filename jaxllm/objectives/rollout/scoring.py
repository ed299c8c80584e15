"""The rewards of GRPO / PPO rollouts: one term (`train.reward`) or a weighted list
(`train.rewards`), each a function of the decoded texts (on the host) or a frozen model on the
mesh (`jaxllm.train.companions` holds it under the name `rewards.model_sources` gives it).

A completion's reward is sum_k w_k r_k (TRL's `reward_weights`). A model term is

- an outcome reward model (a `train.objective=reward` run, a Hugging Face
  `*ForSequenceClassification`): its score at the sequence's last token, the stop included;
- a process reward model (a `train.objective=prm` run): the completion is split into steps at
  each "\\n" (empty steps dropped), laid out as it was trained (`jaxllm.data.stepwise`: the
  prompt, then every step followed by the separator), and each step scored sigmoid(s) at its
  separator, the probability that it is correct; the completion's reward is the lowest of them
  (`aggregate: min`, the default, as Math-Shepherd and verl's PRM rewards), their mean or the
  last one's. A completion without a step scores 0; a layout longer than `data.seq_len` is
  cut there (its later steps go unscored). The prompt must be a string.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxllm import config, parallel, sharding
from jaxllm.config import ConfigError
from jaxllm.config.rewards import RewardTermConfig, term_name
from jaxllm.convert import is_hf_dir
from jaxllm.data.stepwise import encode_solution
from jaxllm.load import model_section, resolve
from jaxllm.model import abstract_model, merge_model
from jaxllm.objectives.reward import sequence_scores
from jaxllm.objectives.rollout import rewards as rewards_lib
from jaxllm.sharding import to_global


def _outcome_scores(params, model_state, batch, *, graphdef, parallel_settings):
    """The reward model's score [B] of each row's one sequence (read at its last token)."""
    with sharding.active(parallel_settings):
        model = merge_model(graphdef, params, None, model_state)
        scores_BxL, _ = sequence_scores(model, parallel.sequence_layout(batch))
        return scores_BxL.sum(-1)  # a sum over L: the same in any layout


def _step_scores(params, model_state, batch, *, graphdef, parallel_settings, aggregate):
    """The process reward model's reward [B] of each row's one solution: sigmoid of the score
    at each step's separator (`loss_mask`), aggregated (min / mean / last), 0 without a step."""
    with sharding.active(parallel_settings):
        model = merge_model(graphdef, params, None, model_state)
        b = parallel.sequence_layout(batch)
        out = model(b["inputs"], positions_BxL=b["positions"], segment_ids_BxL=b["segment_ids"])
        p_BxL = jax.nn.sigmoid(out.logits[..., 0].astype(jnp.float32))
        mask_BxL = b["loss_mask"] > 0
        steps_B = jnp.sum(mask_BxL, -1)
        if aggregate == "min":
            r_B = jnp.min(jnp.where(mask_BxL, p_BxL, jnp.inf), -1)
        elif aggregate == "mean":
            r_B = jnp.sum(p_BxL * mask_BxL, -1) / jnp.maximum(steps_B, 1)
        else:  # by position, not index: the same in a ring's zigzag layout
            last_B = jnp.max(jnp.where(mask_BxL, b["positions"], -1), -1)
            at_BxL = mask_BxL & (b["positions"] == last_B[:, None])
            r_B = jnp.sum(p_BxL * at_BxL, -1)
        return jnp.where(steps_B > 0, r_B, 0.0)


class Term(NamedTuple):
    """One reward: its logged name, weight, and a function or the companion holding a model."""

    name: str
    weight: float
    fn: rewards_lib.RewardFn | None = None
    other: str | None = None
    prm: bool = False


def _is_prm(source: str) -> bool:
    """Whether the model directory `source` is a `train.objective=prm` run."""
    if is_hf_dir(source):
        return False
    return config.load(resolve(source)[0] / "config.yaml").train.objective == "prm"


class Scorer:
    """The rewards of a run's rollouts (see the module docstring)."""

    def __init__(self, cfg, tok, batch_sharding, parallel_settings, prompts):
        t = cfg.train
        self.cfg, self.tok, self.batch_sharding = cfg, tok, batch_sharding
        self.named = bool(t.rewards)  # log each term's mean by name
        sources = rewards_lib.model_sources(t)
        specs = t.rewards or [RewardTermConfig(fn=t.reward)]
        self.parts, self._score = [], {}
        others = iter(sources)
        for spec in specs:
            name = term_name(spec) if self.named else "reward"
            if spec.model is None and not rewards_lib.is_model(spec.fn):
                self.parts.append(Term(name, spec.weight, fn=rewards_lib.from_spec(spec.fn)))
                continue
            other = next(others)
            source = sources[other]
            prm = _is_prm(source)
            if spec.aggregate != "min" and not prm:
                raise ConfigError(
                    f"train.rewards: {source} is an outcome reward model, so its aggregate "
                    "(of a process reward model's step scores) does nothing; drop it."
                )
            if prm and any(not isinstance(p.prompt, str) for p in prompts):
                raise ConfigError(
                    f"the process reward model {source} scores string prompts (as it was "
                    "trained on format: stepwise), but the rollout prompts include chat messages."
                )
            key = "train.reward" if not self.named else "train.rewards"
            graphdef = abstract_model(model_section(source, key))[0]
            fn = _step_scores if prm else _outcome_scores
            extra = {"aggregate": spec.aggregate} if prm else {}
            self._score[other] = jax.jit(
                functools.partial(
                    fn, graphdef=graphdef, parallel_settings=parallel_settings, **extra
                )
            )
            self.parts.append(Term(name, spec.weight, other=other, prm=prm))
        # an outcome model reads the whole sequence, its closing stop included, in one row
        self.outcome_model = any(x.other and not x.prm for x in self.parts)
        self.models = any(x.other for x in self.parts)
        self.needs_text = any(x.fn or x.prm for x in self.parts)

    def text_scores(self, prompts, completions) -> tuple[np.ndarray, dict | None]:
        """(the function terms' rewards [n, K], NaN in model columns; the process reward
        models' rows of these completions), on the host: no collectives. Without a function
        or process reward term (`needs_text` false) neither argument is read."""
        out = np.full((len(completions), len(self.parts)), np.nan)
        if not self.needs_text:
            return out, None
        answers, texts = [p.answer for p in prompts], [p.prompt for p in prompts]
        for k, term in enumerate(self.parts):
            if term.fn is not None:
                out[:, k] = rewards_lib.score(term.fn, texts, completions, answers)
        rows = None
        if any(term.prm for term in self.parts):
            rows = self._prm_rows(texts, completions)
        return out, rows

    def _prm_rows(self, prompts: list[str], completions: list[str]) -> dict:
        length = self.cfg.data.seq_len
        n = len(prompts)
        rows = {k: np.zeros((n, length), np.int32) for k in ("inputs", "segment_ids", "loss_mask")}
        rows["positions"] = np.tile(np.arange(length, dtype=np.int32), (n, 1))
        for i, (prompt, text) in enumerate(zip(prompts, completions)):
            steps = [s for s in text.split("\n") if s.strip()]
            ids, labels = encode_solution(self.tok, prompt, steps, None, self.cfg.data.add_bos)
            ids, labels = ids[:length], labels[:length]
            rows["inputs"][i, : len(ids)], rows["segment_ids"][i, : len(ids)] = ids, 1
            rows["loss_mask"][i, : len(ids)] = labels >= 0
        return rows

    def terms(self, others, seqs: list[np.ndarray], text: tuple, local: slice) -> np.ndarray:
        """The rewards [n, K] of this process's rows `seqs` (`text`: `text_scores`' output for
        them) of a global batch: the model terms score the whole batch on the mesh (a
        collective, every process calls it; none without a model term)."""
        fn, prm_rows = text
        if not self.models:
            return fn
        whole = self._model_scores(others, seqs, prm_rows)[local]
        return np.where(np.isnan(fn), whole, fn)

    def _model_scores(self, others, seqs: list[np.ndarray], prm_rows) -> np.ndarray:
        gbs, length = self.cfg.train.global_batch_size, self.cfg.data.seq_len
        out = np.full((gbs, len(self.parts)), np.nan)
        n = len(seqs)
        rows = {k: np.zeros((n, length), np.int32) for k in ("inputs", "segment_ids")}
        rows["positions"] = np.tile(np.arange(length, dtype=np.int32), (n, 1))
        for i, seq in enumerate(seqs):
            rows["inputs"][i, : len(seq)], rows["segment_ids"][i, : len(seq)] = seq, 1
        for k, term in enumerate(self.parts):
            if term.other is None:
                continue
            held = others[term.other]
            whole = to_global(prm_rows if term.prm else rows, self.batch_sharding, gbs)
            scores = self._score[term.other](held["params"], held["model_state"], whole)
            out[:, k] = np.asarray(multihost_utils.process_allgather(scores, tiled=True))
        return out

    def total(self, terms_NxK: np.ndarray) -> np.ndarray:
        """Each completion's reward: the weighted sum of its terms."""
        weights = np.asarray([term.weight for term in self.parts], np.float64)
        return terms_NxK.astype(np.float64) @ weights

    def term_fields(self, terms_NxK: np.ndarray, shape) -> dict:
        """The batch fields of the named terms (`train.rewards`): `rewards/<name>` [N, L], each
        row's reward of that term (their means are logged as `rewards/<name>/mean`)."""
        if not self.named:
            return {}
        return {
            f"rewards/{term.name}": np.broadcast_to(terms_NxK[:, k, None].astype(np.float32), shape)
            for k, term in enumerate(self.parts)
        }
