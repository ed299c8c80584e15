"""GRPO's and PPO's batches: sampled by the policy itself, scored, laid out as the step's rows.

`Rollouts` stands where the data pipeline's iterator stands in the loop (`jaxllm.train.loop`):
before each step the loop hands it the `TrainState` the previous step returned (`next_rows`),
and it

1. draws global_batch_size / G prompts of the `format: rollout` sources (`jaxllm.data.rollout`),
   a draw without replacement seeded by (data.seed, rollout number);
2. generates G completions of each with the jitted prefill / decode generator
   (`jaxllm.infer.generate`) on the run's mesh, from the state's own parameter arrays (no copy:
   rollout and update share them), sampling at `train.rollout_temperature` with the
   `generate` section's top_k / top_p and KV cache (`generate.kv_cache_dtype`: int8 / int4
   quantized caches too), up to `train.max_completion_tokens` or EOS; the sampling key is
   seeded by (run.seed, rollout number);
3. scores every completion on the host with the reward function (`jaxllm.train.rewards`) and
   turns the rewards into group-relative advantages (`jaxllm.train.grpo.group_advantages`),
   or for PPO into GAE advantages and returns from the value head's V_old
   (`jaxllm.train.ppo.rollout_fields`);
4. builds one row per completion, prompt then completion (then EOS when it stopped there),
   `loss_mask` on the completion's tokens, with float32 `advantages`, `rewards` and
   `old_logps`: log pi_old of every target in one batched, jitted forward pass of the same
   parameters (not read off the decoding, whose cache may be quantized); PPO's `old_values`
   come from that same pass.

Its state is the number of rollouts made, so a resumed run draws the same prompts and samples
with the same keys: given the same parameters, the same batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import parallel, sharding
from jaxllm.config import Config, ConfigError, GenerateConfig
from jaxllm.data.rollout import Prompt, read_prompts
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.infer.generate import generate
from jaxllm.model import abstract_model, merge_model
from jaxllm.train import ppo
from jaxllm.train import rewards as rewards_lib
from jaxllm.train.batches import to_global
from jaxllm.train.grpo import group_advantages
from jaxllm.train.preference import token_logps


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


def rows(prompts: list[np.ndarray], completions: list[list[int]], stopped, eos, seq_len: int):
    """The train rows of prompt + completion pairs: `inputs`, `targets`, `positions`,
    `segment_ids` (1 on the sequence, 0 on padding) and `loss_mask` (1 where the target is a
    completion token, its EOS included), [N, seq_len] int32 each."""
    n = len(prompts)
    out = {k: np.zeros((n, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids")}
    out["loss_mask"] = np.zeros((n, seq_len), np.int32)
    out["positions"] = np.tile(np.arange(seq_len, dtype=np.int32), (n, 1))
    for i, (p, c, s) in enumerate(zip(prompts, completions, stopped)):
        tail = list(c) + ([eos] if s and eos is not None else [])
        seq = np.concatenate([p, np.asarray(tail, np.int32)])[: seq_len + 1]
        m = len(seq) - 1
        out["inputs"][i, :m], out["targets"][i, :m] = seq[:-1], seq[1:]
        out["segment_ids"][i, :m] = 1
        out["loss_mask"][i, len(p) - 1 : m] = 1
    return out


class Rollouts:
    """The iterator of GRPO's and PPO's batches (see the module docstring): `next_rows(it,
    state)` gives this process's rows of the next global batch, made with `state`'s parameters."""

    def __init__(self, cfg: Config, mesh, batch_sharding, local: slice):
        t = cfg.train
        if cfg.peft.method == "prompt":
            raise ConfigError(
                f"train.objective={t.objective} does not train soft prompts yet "
                "(peft.method=prompt): use peft.method=lora or qlora, or full fine-tuning"
            )
        if jax.process_count() > 1:
            raise ConfigError(
                f"train.objective={t.objective} runs in one process for now; every process would "
                "read the whole sampled batch"
            )
        self.cfg, self.mesh, self.local = cfg, mesh, local
        self.batch_sharding = batch_sharding
        self.tok = make_tokenizer(cfg.data)
        self.prompts = read_prompts(cfg.data.sources, cfg.data, self.tok)
        self.eval_prompts = read_prompts(
            cfg.data.eval_sources, cfg.data, self.tok, "data.eval_sources"
        )
        self.group = t.num_generations
        self.per_step = t.global_batch_size // self.group
        if len(self.prompts) < self.per_step:
            raise ConfigError(
                f"data.sources hold {len(self.prompts)} rollout prompts, fewer than the "
                f"{self.per_step} a step samples (train.global_batch_size / train.num_generations)"
            )
        longest = max(len(p.ids) for p in (*self.prompts, *self.eval_prompts))
        if longest + t.max_completion_tokens > min(cfg.data.seq_len, cfg.model.max_seq_len):
            raise ConfigError(
                f"the longest rollout prompt ({longest} tokens) plus train.max_completion_tokens "
                f"({t.max_completion_tokens}) exceeds data.seq_len ({cfg.data.seq_len}) or "
                f"model.max_seq_len ({cfg.model.max_seq_len}); raise them or shorten the prompts"
            )
        self.reward_fn = rewards_lib.from_spec(t.reward)
        self.eos = getattr(self.tok, "eos_id", None)
        self.made = 0  # rollouts made: the iterator's state
        self.policy = None  # the TrainState the next rollout samples from
        self.graphdef = abstract_model(cfg.model, cfg.peft)[0]
        parallel_settings = sharding.Parallel.of(mesh, cfg.mesh)
        self._logps = jax.jit(
            functools.partial(
                _policy_logps, graphdef=self.graphdef, parallel_settings=parallel_settings
            )
        )

    def get_state(self) -> dict:
        return {"rollouts": self.made}

    def set_state(self, state: dict) -> None:
        self.made = int(state["rollouts"])

    def _generate(self, state, prompts: list[Prompt], temperature: float, seed: int):
        g = self.cfg.generate
        gen = GenerateConfig(
            max_new_tokens=self.cfg.train.max_completion_tokens,
            temperature=temperature,
            top_k=g.top_k if temperature else 0,
            top_p=g.top_p if temperature else 1.0,
            seed=seed,
            stop_tokens=g.stop_tokens,
            kv_cache_dtype=g.kv_cache_dtype,
            kv_group=g.kv_group,
            kv_page_size=g.kv_page_size,
            decode_impl=g.decode_impl,
        )
        model = merge_model(self.graphdef, state.params, state.frozen, state.model_state)
        stops = () if self.eos is None else (self.eos,)
        out = generate(model, [p.ids for p in prompts], gen, stop_tokens=stops, mesh=self.mesh)
        texts = [self.tok.decode(c) for c in out.tokens]
        return out, texts

    def __next__(self) -> dict:
        if self.policy is None:
            raise RuntimeError("Rollouts samples from a TrainState: call next_rows(it, state)")
        t, k = self.cfg.train, self.made
        draw = np.random.default_rng([self.cfg.data.seed, k])
        picked = draw.choice(len(self.prompts), self.per_step, replace=False)
        prompts = [self.prompts[i] for i in picked for _ in range(self.group)]
        seed = int(np.random.SeedSequence([self.cfg.run.seed, k]).generate_state(1)[0])
        out, texts = self._generate(self.policy, prompts, t.rollout_temperature, seed)
        scores = rewards_lib.score(
            self.reward_fn, [p.prompt for p in prompts], texts, [p.answer for p in prompts]
        )
        batch = rows(
            [p.ids for p in prompts], out.tokens, out.stopped, self.eos, self.cfg.data.seq_len
        )
        whole = to_global(batch, self.batch_sharding)  # every process made the whole batch
        state = self.policy
        old, values = self._logps(state.params, state.frozen, state.model_state, whole)
        batch["old_logps"] = np.asarray(jax.device_get(old), np.float32)
        if t.objective == "ppo":
            batch["old_values"] = np.asarray(jax.device_get(values), np.float32)
            batch.update(ppo.rollout_fields(scores, batch["old_values"], batch["loss_mask"], t))
        else:
            adv_S = group_advantages(np.asarray(scores), self.group, t.grpo_normalization)
            shape = batch["inputs"].shape
            batch["advantages"] = np.broadcast_to(adv_S[:, None], shape)
            batch["rewards"] = np.broadcast_to(np.asarray(scores, np.float32)[:, None], shape)
        self.made += 1
        return {k: v[self.local] for k, v in batch.items()}

    def evaluate(self, state) -> dict:
        """{'eval_reward': the mean reward of greedy completions of the eval prompts} (empty
        when data.eval_sources hold none)."""
        if not self.eval_prompts:
            return {}
        scores = []
        for i in range(0, len(self.eval_prompts), self.cfg.train.global_batch_size):
            chunk = self.eval_prompts[i : i + self.cfg.train.global_batch_size]
            _, texts = self._generate(state, chunk, 0.0, 0)
            scores += rewards_lib.score(
                self.reward_fn, [p.prompt for p in chunk], texts, [p.answer for p in chunk]
            )
        return {"eval_reward": float(np.mean(scores))}


def next_rows(batches, state) -> dict:
    """The next batch's rows: the data pipeline's, or the rollouts `state` samples (GRPO, PPO)."""
    if isinstance(batches, Rollouts):
        batches.policy = state
    return next(batches)
