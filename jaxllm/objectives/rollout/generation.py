"""The rollouts' generation: one completion per prompt sampled on the inference engine
(`sample`), and the train rows of prompt + completion + stop (`sequences`, `rows`), shared by
GRPO's and PPO's `sampling.Rollouts` and on-policy distillation (`onpolicy`)."""

from __future__ import annotations

import numpy as np

from jaxllm.config import Config, GenerateConfig
from jaxllm.infer.engine import batch as engine_batch


def sequences(prompts: list[np.ndarray], completions: list[list[int]], ends) -> list[np.ndarray]:
    """Each prompt + completion + the stop it ended with (EOS, an end-of-turn marker; nothing
    when it ran out of tokens)."""
    return [
        np.concatenate([p, np.asarray(list(c) + list(e), np.int32)]).astype(np.int32)
        for p, c, e in zip(prompts, completions, ends)
    ]


def sample(
    cfg: Config, model, mesh, prompts: list[np.ndarray], temperature, seed, stops, ends, images=None
):
    """(the generation, each prompt + completion + stop) of one completion per prompt from
    `model` on `mesh`: up to `train.max_completion_tokens` or one of the stops,
    at `temperature` (0: greedy) with the `generate` section's top_k / top_p and KV cache.
    `seed`: one for the batch, or a list of one per prompt (each row's draws then depend on its
    seed alone). `stops`: the stop ids; `ends`: the stop sequences (a multi-token end-of-turn
    marker). `images`: one `Pixels` or None per prompt (a vision-language model's)."""
    seeds = None if isinstance(seed, int) else [int(x) for x in seed]
    g = cfg.generate
    gen = GenerateConfig(
        max_new_tokens=cfg.train.max_completion_tokens,
        temperature=temperature,
        top_k=g.top_k if temperature else 0,
        top_p=g.top_p if temperature else 1.0,
        seed=0 if seeds is not None else seed,
        stop_tokens=g.stop_tokens,
        kv_cache_dtype=g.kv_cache_dtype,
        kv_group=g.kv_group,
        kv_page_size=g.kv_page_size,
        decode_impl=g.decode_impl,
    )
    # on the engine (`jaxllm.infer.engine.batch`: a group's G copies of a prompt share its
    # pages, its prefill and its images' tower) unless it cannot run this (a mesh with a stage
    # or sequence axis); a pool and slot count fixed by the run, so every rollout runs the same
    # compiled programs (a VLM's tower compiles once per set of image grids)
    out = engine_batch.generate(
        model,
        prompts,
        gen,
        stop_tokens=stops,
        stop_sequences=ends,
        mesh=mesh,
        mesh_config=cfg.mesh,
        slots=cfg.train.global_batch_size,
        max_len=min(cfg.data.seq_len, cfg.model.max_seq_len),
        seeds=seeds,
        group=cfg.train.num_generations,
        images=images if images is not None and any(p is not None for p in images) else None,
    )
    return out, sequences(prompts, out.tokens, out.ends)


def rows(prompts: list[np.ndarray], seqs: list[np.ndarray], seq_len: int):
    """The train rows of `sequences`: `inputs`, `targets`, `positions`, `segment_ids` (1 on the
    sequence, 0 on padding) and `loss_mask` (1 where the target is a completion token, its stop
    included), [N, seq_len] int32 each."""
    n = len(prompts)
    out = {k: np.zeros((n, seq_len), np.int32) for k in ("inputs", "targets", "segment_ids")}
    out["loss_mask"] = np.zeros((n, seq_len), np.int32)
    out["positions"] = np.tile(np.arange(seq_len, dtype=np.int32), (n, 1))
    for i, (p, seq) in enumerate(zip(prompts, seqs)):
        seq = seq[: seq_len + 1]
        m = len(seq) - 1
        out["inputs"][i, :m], out["targets"][i, :m] = seq[:-1], seq[1:]
        out["segment_ids"][i, :m] = 1
        out["loss_mask"][i, len(p) - 1 : m] = 1
    return out
