"""On-policy distillation: GKD's batches, some of them sampled by the student itself.

Generalized knowledge distillation (GKD, Agarwal et al. 2024, arXiv:2306.13649, algorithm 1)
trains the student on a mix of fixed data and its own samples: with probability lambda a
batch's completions are the student's own, given the batch's prompts, otherwise the data's,
and either way the loss is a divergence between the teacher's and the student's next-token
distributions on the completion tokens (`jaxllm.objectives.distill`, whose `jsd` is GKD's
generalized JSD). Training on its own samples removes the train / inference mismatch of
distilling on fixed sequences only (exposure bias): the teacher corrects the student on the
prefixes the student itself produces.

With `train.objective=distill` and `train.distill_lambda` = lambda > 0, `OnPolicyDistill`
stands where the data pipeline's iterator stands in the loop (as GRPO's `Rollouts` do). Before
batch k it draws u from a generator seeded by (data.seed, k):

- u < lambda (on-policy): it draws global_batch_size prompts of the training examples from the
  same generator (without replacement while there are enough) and samples one completion of
  each from the state's own parameters with the rollouts' generator (`generation.sample`): at
  `train.rollout_temperature` with the `generate` section's top_k / top_p and KV cache, up to
  `train.max_completion_tokens` or the stop (EOS; after chat prompts also the template's end of
  turn), the sampling key seeded by (run.seed, k). Each prompt + completion + stop is one row
  with `loss_mask` on the completion and its stop (`generation.rows`), as TRL's
  `GKDTrainer.generate_on_policy_outputs` labels them.
- otherwise (off-policy): the pipeline's next batch, the very batch the run would train on at
  lambda = 0 (the pipeline moves only on these).

So lambda = 0 is the off-policy distillation of fixed data (that path never builds this
iterator), and lambda = 1 samples every batch. A prompt is an example's tokens before its last
trained span (`jaxllm.data.rollout.example_prompts`): a prompt_completion example's BOS +
prompt, a conversation up to its last assistant reply. Prompts too long to leave room for
`train.max_completion_tokens` within a row are not drawn. Every batch carries `sampled` (1 on
every slot of a sampled row), so the objective logs `on_policy`, the share of the step's
tokens that were the student's samples.

With `train.distill_loss=reverse_kl` at lambda = 1 this is the token-level reverse KL of
MiniLLM (Gu et al. 2024, arXiv:2306.08543) on student samples, sum_t KL(p_s || p_t) at each
sampled prefix, differentiated through the student's distributions only: not MiniLLM's policy
gradient of the sequence-level reverse KL (its single-step term only, without the long-term
reward, teacher-mixed sampling or length normalisation).

Its state is the number of batches made and the pipeline's position, so a resumed run flips the
same coins and draws the same prompts: given the same parameters, the same batches.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from jaxllm.config import Config, ConfigError, JaxllmWarning
from jaxllm.data.prepare import PreparedDir
from jaxllm.data.rollout import example_prompts
from jaxllm.data.sources import is_prepared_dir
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.infer.chat import end_of_turn
from jaxllm.model import abstract_model, merge_model
from jaxllm.objectives.rollout.generation import rows, sample


def _chat(cfg: Config) -> bool:
    """Whether the training examples are conversations (a chat source or a directory prepared
    from one): their completions then also stop at the template's end of turn."""
    return any(
        src.format == "chat"
        or is_prepared_dir(src.path)
        and PreparedDir(src.path, f"data.sources[{i}]", cfg.data.tokenizer).kind == "chat"
        for i, src in enumerate(cfg.data.sources)
    )


class OnPolicyDistill:
    """The iterator of on-policy distillation's batches (see the module docstring):
    `next_rows(it, state)` gives this process's rows of the next global batch, sampled with
    `state`'s parameters or the pipeline's `batches`; `train_rows` are the packed training
    examples the prompts come from."""

    def __init__(self, cfg: Config, mesh, local: slice, train_rows, batches):
        t = cfg.train
        if cfg.peft.method == "prompt":
            raise ConfigError(
                "on-policy distillation (train.distill_lambda > 0) does not train soft prompts "
                "yet (peft.method=prompt): use peft.method=lora or qlora, or full fine-tuning"
            )
        if jax.process_count() > 1:
            raise ConfigError(
                "on-policy distillation (train.distill_lambda > 0) runs in one process for now; "
                "every process would sample the whole batch"
            )
        self.cfg, self.mesh, self.local, self.batches = cfg, mesh, local, batches
        room = min(cfg.data.seq_len, cfg.model.max_seq_len) - t.max_completion_tokens
        every = example_prompts(train_rows)
        self.prompts = [p for p in every if len(p) <= room]
        if not self.prompts:
            raise ConfigError(
                f"no training example's prompt ({min(map(len, every), default=0)} tokens at "
                f"the shortest) leaves room for train.max_completion_tokens="
                f"{t.max_completion_tokens} within data.seq_len={cfg.data.seq_len} and "
                f"model.max_seq_len={cfg.model.max_seq_len}; raise them or lower "
                "train.max_completion_tokens."
            )
        if len(self.prompts) < len(every):
            warnings.warn(
                f"on-policy distillation: {len(every) - len(self.prompts)} of {len(every)} "
                f"prompts leave no room for train.max_completion_tokens="
                f"{t.max_completion_tokens} within data.seq_len={cfg.data.seq_len} and are not "
                "sampled from (their examples still train off-policy).",
                JaxllmWarning,
                stacklevel=2,
            )
        tok = make_tokenizer(cfg.data)
        eos = getattr(tok, "eos_id", None)
        eot = end_of_turn(tok) if _chat(cfg) else None
        self.stops = sorted(eot.stop_ids) if eot else ([] if eos is None else [eos])
        self.stop_sequences = eot.stop_sequences if eot else ()
        self.graphdef = abstract_model(cfg.model, cfg.peft)[0]
        self.made = 0  # batches made: with the pipeline's position, the iterator's state
        self.policy = None  # the TrainState the next on-policy batch samples from

    def get_state(self) -> dict:
        return {**self.batches.get_state(), "distill_batches": self.made}

    def set_state(self, state: dict) -> None:
        self.batches.set_state(state)
        # a run that trained at lambda = 0 until now made as many batches as the pipeline
        self.made = int(state.get("distill_batches", state.get("next_batch", 0)))

    def close(self) -> None:
        self.batches.close()

    def __iter__(self) -> OnPolicyDistill:
        return self

    def __next__(self) -> dict:
        k = self.made
        draw = np.random.default_rng([self.cfg.data.seed, k])
        if draw.random() < self.cfg.train.distill_lambda:
            batch = {key: v[self.local] for key, v in self._sampled(draw, k).items()}
        else:
            batch = dict(next(self.batches))
            batch["sampled"] = np.zeros_like(batch["loss_mask"])
        self.made += 1
        return batch

    def _sampled(self, draw: np.random.Generator, k: int) -> dict:
        """Batch k's whole batch of the student's completions of drawn prompts."""
        if self.policy is None:
            raise RuntimeError("OnPolicyDistill samples from a TrainState: call next_rows")
        n = self.cfg.train.global_batch_size
        picked = draw.choice(len(self.prompts), n, replace=len(self.prompts) < n)
        prompts = [self.prompts[i] for i in picked]
        seed = int(np.random.SeedSequence([self.cfg.run.seed, k]).generate_state(1)[0])
        state = self.policy
        model = merge_model(self.graphdef, state.params, state.frozen, state.model_state)
        temperature, stops = self.cfg.train.rollout_temperature, (self.stops, self.stop_sequences)
        _, seqs = sample(self.cfg, model, self.mesh, prompts, temperature, seed, *stops)
        batch = rows(prompts, seqs, self.cfg.data.seq_len)
        batch["sampled"] = np.ones_like(batch["loss_mask"])
        return batch


def wrap(cfg: Config, mesh, local: slice, train_rows, batches):
    """The training batches of a run: `OnPolicyDistill` over the pipeline's `batches` for
    on-policy distillation (`train.distill_lambda` > 0), else `batches` themselves."""
    if cfg.train.objective != "distill" or cfg.train.distill_lambda == 0:
        return batches
    return OnPolicyDistill(cfg, mesh, local, train_rows, batches)
