"""GRPO's and PPO's batches: sampled by the policy itself, scored, laid out as the step's rows.

`Rollouts` stands where the data pipeline's iterator stands in the loop (`jaxllm.train.loop`):
before each step the loop hands it the `TrainState` the previous step returned (`next_rows`),
and it

1. draws global_batch_size / G prompts of the `format: rollout` sources (`jaxllm.data.rollout`),
   a draw without replacement seeded by (data.seed, rollout number);
2. generates G completions of each on the inference engine (`jaxllm.infer.engine.batch`: one
   request with n = G per prompt, so the group shares the prompt's KV pages and prefill), or
   with the jitted prefill / decode generator (`jaxllm.infer.generate`) where the engine cannot
   run it (a mesh with a pipeline stage or sequence axis), on the run's mesh, from
   the state's own parameter arrays (no copy: rollout and update share them), sampling at
   `train.rollout_temperature` with the `generate` section's top_k / top_p and KV cache
   (`generate.kv_cache_dtype`: int8 / int4 / int2 quantized caches too), up to
   `train.max_completion_tokens` or EOS; each row's sampling key is seeded by (run.seed,
   rollout number, the row's place in the global batch), so a row's completion does not depend
   on the rows sampled beside it;
3. scores every completion (`scoring`): on the host with the reward functions of its decoded
   text, on the mesh with reward models (held frozen in `TrainState.others`), the weighted
   sum of `train.rewards` or the one `train.reward`; then turns the rewards into the
   critic-free objectives' advantages (`critic_free`: GRPO's group-relative ones, RLOO's,
   REINFORCE++'s; DAPO's dynamic sampling draws again where a group agrees), or for PPO into
   GAE advantages and returns from the value head's V_old (`ppo.rollout_fields`), for online DPO
   into each pair's chosen one (`online_dpo.rollout_fields`);
4. builds one row per completion, prompt then completion then the stop that ended it (EOS;
   after a chat prompt also the chat template's end-of-turn marker, `jaxllm.infer.chat`),
   `loss_mask` on the completion's tokens, with float32 `advantages`, `rewards` and
   `old_logps`: log pi_old of every target in one batched, jitted forward pass of the same
   parameters (not read off the decoding, whose cache may be quantized); PPO's `old_values`
   come from that same pass.

With `train.updates_per_rollout` = mu > 1 the same batch (its pi_old, advantages and returns
unchanged) is handed to mu steps in a row before the next rollout.

With several processes each samples and scores only its own rows (whole groups), from a
whole copy of the parameters on its first device; pi_old, V_old and a reward model's scores
are computed on the mesh over the global batch assembled from every process's rows, and the
rollout's whole batch is gathered on every process (the checkpoint holds it). Two processes
make the batches of one.

With `train.rollout_ahead=1` (one step off-policy) rollout k+1 is sampled from the parameters
that rollout k is handed out with, from a copy (the step about to run donates them), in a
background thread while that step runs; its collective half (a reward model, pi_old of the
sampling parameters) runs when it is handed out (`_Next`).

Its state is the number of rollouts made, so a resumed run draws the same prompts and samples
with the same keys: given the same parameters, the same batches. Between the mu steps of one
rollout the state also carries the batch itself (compressed, in the checkpoint's `data` item):
the parameters it was sampled with are gone by then; so does the next rollout's batch under
`train.rollout_ahead=1`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import io
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxllm import parallel, sharding
from jaxllm.config import Config, ConfigError
from jaxllm.config.grpo import settings
from jaxllm.data.rollout import Prompt, prompt_splits
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.infer.chat import end_of_turn
from jaxllm.model import abstract_model, merge_model
from jaxllm.objectives.base import token_logps
from jaxllm.objectives.rollout import critic_free, online_dpo, ppo
from jaxllm.objectives.rollout import images as image_prompts
from jaxllm.objectives.rollout.generation import rows, sample
from jaxllm.objectives.rollout.scoring import Scorer
from jaxllm.sharding import to_global


def _policy_logps(params, frozen, model_state, batch, *, graphdef, parallel_settings):
    """(log pi(target) [B, L] of a batch's rows, 0 outside `loss_mask`; the value head's
    V [B, L], None without one), in the rows' order."""
    with sharding.active(parallel_settings):
        length = batch["inputs"].shape[1]
        order_1xL = parallel.sequence_layout({"i": jnp.arange(length)[None]})["i"]
        model = merge_model(graphdef, params, frozen, model_state)
        logp_BxL, out = token_logps(model, parallel.sequence_layout(batch))
        back_L = jnp.argsort(order_1xL[0])  # back from a ring's zigzag layout
        return logp_BxL[:, back_L], None if out.values is None else out.values[:, back_L]


class _Weights(NamedTuple):
    """The arrays a rollout samples and scores with: a `TrainState`'s, or a copy of them."""

    params: object
    frozen: object
    model_state: object


def _encode(batch: dict) -> str:
    buf = io.BytesIO()
    np.savez_compressed(buf, **batch)
    return base64.b64encode(buf.getvalue()).decode()


def _decode(text: str) -> dict:
    with np.load(io.BytesIO(base64.b64decode(text))) as npz:
        return {k: npz[k] for k in npz.files}


class _Next:
    """The next rollout (`train.rollout_ahead=1`): its sampling (generation, the reward
    function) runs in a background thread; its collective parts (a reward model, pi_old, the
    rows of the other processes) run in the caller's thread when `batch()` is first asked for,
    in every process at the same point of the loop."""

    def __init__(self, future=None, finish=None, batch: dict | None = None):
        self.future, self.finish, self._batch = future, finish, batch

    def batch(self, others) -> dict:
        """The whole batch; `others`: the live TrainState's (a reward model)."""
        if self._batch is None:
            self._batch = self.finish(self.future.result(), others=others)
            self.future = self.finish = None  # the parameter copy goes with them
        return self._batch


class Rollouts:
    """The iterator of GRPO's and PPO's batches (see the module docstring): `next_rows(it,
    state)` gives this process's rows of the next global batch, made with `state`'s parameters."""

    def __init__(self, cfg: Config, mesh, batch_sharding, local: slice, reference=None):
        t = cfg.train
        if cfg.peft.method == "prompt":
            raise ConfigError(
                f"train.objective={t.objective} does not train soft prompts yet "
                "(peft.method=prompt): use peft.method=lora or qlora, or full fine-tuning"
            )
        local = slice(*local.indices(t.global_batch_size)[:2])
        if local.start % t.num_generations or local.stop % t.num_generations:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} gives rows {local.start} to "
                f"{local.stop - 1} to process {jax.process_index()} of {jax.process_count()}, "
                f"which splits a group of train.num_generations={t.num_generations}: each "
                "process samples whole groups, so global_batch_size / processes must be a "
                "multiple of num_generations"
            )
        self.cfg, self.mesh, self.local = cfg, mesh, local
        self.batch_sharding = batch_sharding
        # RLOO / REINFORCE++ with beta > 0: the reference's log-probabilities of a global batch,
        # (params, frozen, model_state, others, batch) -> [B, L] (`jaxllm.train.precompute`)
        self.reference = reference
        self.settings = settings(t)
        # several processes: each samples its own rows from a whole copy of the parameters on
        # its first device (the generator runs on process-local data)
        self.multi = jax.process_count() > 1
        self.sample_mesh = None if self.multi else mesh
        self.tok = make_tokenizer(cfg.data)
        self.images = image_prompts.inputs(cfg)  # a vision-language model's image reading
        self.prompts, self.eval_prompts = prompt_splits(cfg.data, self.tok, self.images)
        if not any(p.pixels is not None for p in (*self.prompts, *self.eval_prompts)):
            self.images = None  # text prompts: text rows
        self.group = t.num_generations
        self.per_step = t.global_batch_size // self.group
        if len(self.prompts) < self.per_step:
            raise ConfigError(
                f"data.sources hold {len(self.prompts)} rollout prompts, fewer than the "
                f"{self.per_step} a step samples (train.global_batch_size / train.num_generations)"
            )
        parallel_settings = sharding.Parallel.of(mesh, cfg.mesh)
        prompts = (*self.prompts, *self.eval_prompts)
        self.scorer = Scorer(cfg, self.tok, batch_sharding, parallel_settings, prompts)
        self.reward_model = self.scorer.outcome_model
        if self.images is not None:
            image_prompts.check(cfg, bool(self.scorer.models))
            self.units = image_prompts.budget((*self.prompts, *self.eval_prompts), cfg.model.vision)
        longest = max(len(p.ids) for p in (*self.prompts, *self.eval_prompts))
        # a reward model reads the whole sequence, its closing stop included, in one row
        room = min(cfg.data.seq_len - self.reward_model, cfg.model.max_seq_len)
        if longest + t.max_completion_tokens > room:
            raise ConfigError(
                f"the longest rollout prompt ({longest} tokens) plus train.max_completion_tokens "
                f"({t.max_completion_tokens}) exceeds data.seq_len ({cfg.data.seq_len}"
                f"{', less 1 for the stop a reward model reads' if self.reward_model else ''}) or "
                f"model.max_seq_len ({cfg.model.max_seq_len}); raise them or shorten the prompts"
            )
        if self.scorer.models and self.settings.dynamic_sampling and t.objective != "ppo":
            raise ConfigError(
                "train.grpo.dynamic_sampling scores each round of samples on the host: it takes "
                "reward functions (train.reward, the fn terms of train.rewards), not a reward "
                "model; set train.grpo.dynamic_sampling=false."
            )
        # A completion ends at EOS; after a chat prompt also at the template's end of turn.
        chat = any(not isinstance(p.prompt, str) for p in (*self.prompts, *self.eval_prompts))
        eos = getattr(self.tok, "eos_id", None)
        eot = end_of_turn(self.tok) if chat else None
        self.stops = sorted(eot.stop_ids) if eot else ([] if eos is None else [eos])
        self.stop_sequences = eot.stop_sequences if eot else ()
        self.made = 0  # rollouts begun: the iterator's state
        self.pending, self.served = None, 0  # the last rollout's batch, the steps it fed
        self.next: _Next | None = None  # rollout_ahead: the rollout after `pending`
        self.policy = None  # the TrainState the next rollout samples from
        self._thread = concurrent.futures.ThreadPoolExecutor(1) if t.rollout_ahead else None
        self.graphdef = abstract_model(cfg.model, cfg.peft)[0]
        self._logps = jax.jit(
            functools.partial(
                _policy_logps, graphdef=self.graphdef, parallel_settings=parallel_settings
            )
        )

    def get_state(self) -> dict:
        """The rollouts begun, the batch still to be served and (rollout_ahead) the next one,
        whole batches (every process's rows); the next one as a function of the TrainState that
        the loop calls when it saves (by then it is made: asking here would wait for it)."""
        state = {"rollouts": self.made}
        if self.pending is not None and self.served < self.cfg.train.updates_per_rollout:
            state |= {"served": self.served, "batch": _encode(self.pending)}
        if self.next is not None:
            state["next"] = functools.partial(lambda n, at: _encode(n.batch(at.others)), self.next)
        return state

    def set_state(self, state: dict) -> None:
        self.made = int(state["rollouts"])
        self.pending, self.served, self.next = None, 0, None
        if "batch" in state:
            self.pending, self.served = _decode(state["batch"]), int(state["served"])
        if "next" in state:
            self.next = _Next(batch=_decode(state["next"]))

    def _sampler(self, weights: _Weights) -> _Weights:
        """The weights the generator reads: `weights` themselves in one process; with several,
        a whole copy on this process's first device (every process takes part in the gather)."""
        if not self.multi:
            return weights
        whole = multihost_utils.process_allgather(tuple(weights), tiled=True)
        return _Weights(*jax.device_put(whole, jax.local_devices()[0]))

    def _generate(self, state, prompts: list[Prompt], temperature: float, seed):
        ids = [p.ids for p in prompts]
        model = merge_model(self.graphdef, state.params, state.frozen, state.model_state)
        stops = (self.stops, self.stop_sequences)
        pixels = None if self.images is None else [p.pixels for p in prompts]
        return sample(self.cfg, model, self.sample_mesh, ids, temperature, seed, *stops, pixels)

    def _rewards(self, state, prompts: list[Prompt], out, seqs) -> list[float]:
        """One reward per completion of the whole list (the same in every process): a model
        term reads whole batches, so the list is padded to one and each process scores its
        rows of it."""
        gbs, n = self.cfg.train.global_batch_size, len(seqs)
        texts = [None] * n
        if self.scorer.needs_text:
            texts = [self.tok.decode(c) for c in out.tokens]
        if not self.scorer.models:
            return [float(r) for r in self.scorer.total(self.scorer.text_scores(prompts, texts)[0])]
        pad = lambda x: (list(x) * gbs)[:gbs] if n < gbs else list(x)  # noqa: E731
        mine = [pad(x or texts)[self.local] for x in (prompts, texts, seqs)]
        text = self.scorer.text_scores(mine[0], mine[1])
        terms = self._whole({"t": self.scorer.terms(state.others, mine[2], text, self.local)})
        return [float(r) for r in self.scorer.total(terms["t"])[:n]]

    def __next__(self) -> dict:
        if self.policy is None:
            raise RuntimeError("Rollouts samples from a TrainState: call next_rows(it, state)")
        if self.pending is None or self.served >= self.cfg.train.updates_per_rollout:
            if self.next is not None:
                self.pending, self.next = self.next.batch(self.policy.others), None
            else:
                weights = _Weights(self.policy.params, self.policy.frozen, self.policy.model_state)
                sampled = self._sample(self.made, self._sampler(weights))
                self.pending = self._finish(sampled, weights, self.policy.others)
                self.made += 1
            self.served = 0
            if self._thread is not None:
                self.next = self._ahead()
        self.served += 1
        return {k: v[self.local] for k, v in self.pending.items()}

    def _ahead(self) -> _Next:
        """Begins the next rollout from `self.policy`, which the step about to run updates in
        place (donated): from a copy, dispatched before that step is."""
        s = self.policy
        weights = _Weights(*jax.tree.map(jnp.copy, (s.params, s.frozen, s.model_state)))
        future = self._thread.submit(self._sample, self.made, self._sampler(weights))
        self.made += 1
        return _Next(future, functools.partial(self._finish, weights=weights))

    def _draw(self, k: int, j: int = 0) -> tuple[list[Prompt], list[int]]:
        """Rollout k's prompts of this process's rows, and a sampling seed for each row from
        (run.seed, k, the row's place in the global batch): the same rows, sampled the same,
        however the batch is split over processes. j > 0: dynamic sampling's round j."""
        draw = np.random.default_rng([self.cfg.data.seed, k, *([j] if j else [])])
        picked = draw.choice(len(self.prompts), self.per_step, replace=False)
        where = range(self.local.start, self.local.stop)
        prompts = [self.prompts[picked[i // self.group]] for i in where]
        seed = self.cfg.run.seed
        return prompts, [
            int(np.random.SeedSequence([seed, k, i, *([j] if j else [])]).generate_state(1)[0])
            for i in where
        ]

    def _sampled_rows(self, k: int, sampler: _Weights, j: int = 0) -> list[tuple]:
        """(prompt, sequence, function terms' scores [K] (NaN for a model), a process reward
        model's row or None, completion tokens, truncated) of each of this process's rows of
        rollout k (round j of dynamic sampling)."""
        prompts, seeds = self._draw(k, j)
        out, seqs = self._generate(sampler, prompts, self.cfg.train.rollout_temperature, seeds)
        texts = [self.tok.decode(c) if self.scorer.needs_text else None for c in out.tokens]
        fn, prm = self.scorer.text_scores(prompts, texts)
        prm_rows = [None] * len(seqs) if prm is None else [
            {key: v[i] for key, v in prm.items()} for i in range(len(seqs))
        ]  # fmt: skip
        lengths = [len(c) for c in out.tokens]
        truncated = [not len(e) for e in out.ends]
        return list(zip(prompts, seqs, fn, prm_rows, lengths, truncated))

    def _sample(self, k: int, sampler: _Weights):
        """Rollout k's process-local half: this process's rows sampled from `sampler`, their
        reward function's scores (a reward model's come in `_finish`); no collectives, so it can
        run in a background thread."""
        got = self._sampled_rows(k, sampler)
        s, t = self.settings, self.cfg.train
        if s.dynamic_sampling and t.objective != "ppo":  # function terms only (`__init__`)
            got = critic_free.refill(
                got,
                lambda j: self._sampled_rows(k, sampler, j),
                self.group,
                s.max_resample,
                lambda rows_: critic_free.shaped(
                    self.scorer.total(np.stack([r[2] for r in rows_])),
                    [r[4] for r in rows_],
                    t.max_completion_tokens,
                    s,
                ),
            )
        prompts, seqs, fn, prm_rows, lengths, truncated = map(list, zip(*got))
        prm = None if prm_rows[0] is None else {
            key: np.stack([r[key] for r in prm_rows]) for key in prm_rows[0]
        }  # fmt: skip
        local = rows([p.ids for p in prompts], seqs, self.cfg.data.seq_len)
        if self.images is not None:
            fields = image_prompts.image_fields
            local |= fields(prompts, seqs, self.cfg.data.seq_len, self.images, self.units)
        local["ended"] = np.asarray([lengths, truncated], np.float32).T  # [N, 2]
        return seqs, (np.stack(fn), prm), local

    def _whole(self, local: dict) -> dict:
        """The global batch of every process's `local` rows (a collective)."""
        if not self.multi:
            return local
        gbs = self.cfg.train.global_batch_size
        placed = to_global(local, self.batch_sharding, gbs)
        return {
            k: np.asarray(v)
            for k, v in multihost_utils.process_allgather(placed, tiled=True).items()
        }

    def _finish(self, sampled, weights: _Weights, others) -> dict:
        """The whole batch of a rollout from its sampled half: a reward model's scores, pi_old
        (and PPO's V_old) of `weights`, the sampling policy, and the advantages."""
        t, gbs = self.cfg.train, self.cfg.train.global_batch_size
        seqs, text, local = sampled
        terms = self.scorer.terms(others, seqs, text, self.local)
        batch = self._whole({**local, "terms": np.asarray(terms, np.float32)})
        terms = batch.pop("terms")
        scores = self.scorer.total(terms)
        lengths, truncated = batch.pop("ended").T
        placed = to_global({k: v[self.local] for k, v in batch.items()}, self.batch_sharding, gbs)
        old, values = self._logps(weights.params, weights.frozen, weights.model_state, placed)
        gather = functools.partial(multihost_utils.process_allgather, tiled=True)
        batch["old_logps"] = np.asarray(gather(old), np.float32)
        if t.objective == "online_dpo":
            batch.update(online_dpo.rollout_fields(scores, batch["inputs"].shape))
        elif t.objective == "ppo":
            batch["old_values"] = np.asarray(gather(values), np.float32)
            batch.update(ppo.rollout_fields(scores, batch["old_values"], batch["loss_mask"], t))
        else:
            batch.update(
                critic_free.finish(self, batch, (scores, lengths, truncated), weights, others)
            )
        batch.update(self.scorer.term_fields(terms, batch["inputs"].shape))
        return {k: np.ascontiguousarray(v) for k, v in batch.items()}

    def evaluate(self, state) -> dict:
        """{'eval_reward': the mean reward of greedy completions of the eval prompts} (empty
        when data.eval_sources hold none)."""
        if not self.eval_prompts:
            return {}
        weights = _Weights(state.params, state.frozen, state.model_state)
        sampler = self._sampler(weights)
        scores = []
        for i in range(0, len(self.eval_prompts), self.cfg.train.global_batch_size):
            chunk = self.eval_prompts[i : i + self.cfg.train.global_batch_size]
            out, seqs = self._generate(sampler, chunk, 0.0, 0)
            scores += self._rewards(state, chunk, out, seqs)
        return {"eval_reward": float(np.mean(scores))}


def next_rows(batches, state) -> dict:
    """The next batch's rows: the data pipeline's, or those `state` samples: GRPO's and PPO's
    rollouts, on-policy distillation's batches (an iterator with a `policy` attribute)."""
    if hasattr(batches, "policy"):
        batches.policy = state
    return next(batches)
