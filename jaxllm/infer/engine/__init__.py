"""An inference engine: continuous batching over a pool of KV pages.

A library API, the core that `jaxllm serve`, chat evaluation and rollouts sit on:

    engine = Engine(model, max_num_seqs=8, page_size=16, num_pages=256)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7))
    while engine.has_unfinished():
        result = engine.step()  # result.new_tokens, result.finished
    outputs = engine.generate(prompts, SamplingParams(...))  # or all at once

Three pieces, as vLLM's v1 splits them (scheduler, block manager, model runner):
`pages` (free list, reference counts, hash-keyed prefix pages), `runner` (the jitted step of
the existing model over the paged cache, and per-row sampling) and `core` (requests and the
host scheduler). The host schedules in Python; the device runs fixed-shape programs: the slot
count and page pool are fixed, and each step feeds Q tokens per slot with Q a power of two up
to `chunk_size` and attends over a block table as wide as the longest scheduled sequence needs
(a power of two of pages, at most max_seq_len's), so a step costs what the live lengths need
and there is one compile per (Q, width) bucket pair, never one per request shape.

What exists:
- continuous batching: requests join at any step and leave when done (max_tokens or a stop
  token); sequences take pages as they grow and give them back when they end;
- chunked prefill: a long prompt is fed `chunk_size` tokens per step, in the same step as the
  other sequences' decode tokens;
- prefix sharing: full pages keyed by the hash of their token block chain, reference-counted;
  a shared system prompt is stored once, and the n samples of a request share its pages;
  released prefix pages stay cached (LRU) until the pool needs them, so a system prompt is
  prefilled once even when no request holds it (`Engine.prefix_cache_hit_rate`);
- preemption: when the pool runs dry the newest running sequence gives its pages back and is
  recomputed later, or with `swap="host"` has its pages copied to host memory and back (its
  output is the same as uninterrupted either way);
- every cache dtype: float32, bfloat16, int8, and int4 / int2 (KIVI) pages with a residual
  window per slot (`kivi` says how chunks keep a request's tokens as they are alone);
- per-request sampling (`sampling`): temperature, top-k, top-p, min-p, repetition (HF / vLLM)
  and presence / frequency (OpenAI) penalties, stop tokens and stop sequences of several tokens,
  max_tokens, seed, n, logprobs of the chosen tokens and the top (<= 20) logprobs, OpenAI's
  logit_bias and vLLM's min_tokens, all in the same fixed-shape programs; the prompt's
  log-probabilities on request (`prompts`, a second program of the step);
- structured outputs (`structured`, with llguidance and the engine's tokenizer): a sample held
  to a JSON schema, any JSON object, a regex, a choice of strings or a Lark grammar, its
  allowed tokens a bitmask per slot (a second program of the step, only while a slot is guided);
- hybrid models (`model.layer_pattern`, Gated DeltaNet layers): each slot keeps the linear
  layers' fixed-size state beside the pages of the full-attention layers (`linear`), zeroed
  when a sequence starts in the slot and carried across prefill chunks; prefix pages are not
  shared for them (the state is not per page), and a preempted sequence is recomputed or has
  its state swapped to host with its pages;
- a mesh: `Engine(model, mesh=mesh, mesh_config=cfg.mesh)` lays parameters out by their
  logical axes (tensor, fsdp, expert), the pages' kv heads over `tensor` and the slots over the
  data axes, as `generate` runs on a mesh.
- images (a vision-language model): `add_request(ids, params, images=pixels)`; the tower runs
  once per request, its features replace the image tokens' embeddings in (chunked) prefill,
  positions are M-RoPE ids then index + rope delta, and prefix pages are keyed with each
  image's digest (`vision`);
- whole batches the static generator's way (`batch.generate`: its arguments, its
  `Generation`): GRPO / PPO rollouts, on-policy distillation's samples, `jaxllm generate
  --chat / --chat-file` and `jaxllm eval --chat-exact-match` run on the engine, a GRPO group as
  one request with n = G sharing its prompt's pages.

Not yet: pages split over the data axes of a mesh (each data replica holds the whole pool),
pipeline stages or a split sequence.
"""

from jaxllm.infer.engine.core import Engine, Output, StepResult
from jaxllm.infer.engine.sampling import SamplingParams
from jaxllm.infer.engine.structured import Structured

__all__ = ["Engine", "Output", "SamplingParams", "StepResult", "Structured"]
