"""Compiling the engine's step for every bucket pair before serving.

A step's shapes are (Q, J): Q tokens per slot (a power of two up to `chunk_size`) and a block
table J pages wide (a power of two up to max_seq_len's pages), so a server meets up to
|Q buckets| x |J buckets| programs, each compiled when first met. Met mid-traffic, each
compile stalls every running request (1-2 s for runs/default on a 2-core CPU); vLLM captures
its CUDA graphs at start-up for the same reason. `compile_buckets` runs each pair once on
all-padding slots before any request: every table entry is 0, so the writes land in the
scratch page, and the KIVI residuals it touches are written afresh by each sequence before
they are read; slots with no real tokens leave a hybrid model's linear state as it is.

A step in which a sequence feeds prompt tokens whose log-probabilities it asks for (`echo`
with `logprobs`, `prompt_logprobs`: `prompts.py`) runs the step's other program, which keeps
every position's logits, one more program per pair. `compile_buckets(...,
prompt_logprobs=True)` compiles those (`jaxllm serve --precompile-scoring`) for a server that
scores prompts (lm-evaluation-harness's loglikelihood requests meet almost only them). They
are not compiled by default: they take longer than the sampling programs (runs/default's model
on a 2-core CPU: 47 pairs, 110 s for the sampling programs, 150 s more for these).
"""

from __future__ import annotations

import functools

import numpy as np

from jaxllm.infer.engine import runner


def compile_buckets(engine, sampling: bool = True, prompt_logprobs: bool = False) -> int:
    """Runs `engine`'s step once per (Q, J) pair that can occur (J pages hold at least Q
    tokens): its sampling program (`sampling`) and its prompt log-probabilities program
    (`prompt_logprobs`); returns how many programs that compiled. Only on an idle engine."""
    if engine.has_unfinished():
        raise ValueError("compile_buckets runs before any request, on an idle engine")
    if not (sampling or prompt_logprobs):
        return 0
    s, ps, parallel = len(engine._slots), engine.page_size, engine._parallel
    before = runner.TRACES[0]
    put = functools.partial(runner.put_rows, parallel)
    for q in engine.query_buckets:
        for j in engine.page_buckets:
            if j * ps < q and j < engine.pages_per_slot:
                continue
            zeros_S = np.zeros(s, np.int32)
            rows = put(np.zeros((s, q), np.int32), zeros_S, zeros_S, np.zeros((s, j), np.int32))
            programs = [None] if sampling else []  # each program's targets_SxQ
            if prompt_logprobs:
                programs += put(np.zeros((s, q), np.int32))
            for targets in programs:
                picked, engine._kv, engine._linear, _ = runner.step(
                    engine._graphdef,
                    engine._state,
                    engine._kv,
                    engine._linear,
                    *rows,
                    engine._rows.build([], put),
                    images(engine, s, q, put),
                    impl=engine._impl,
                    interpret=engine._interpret,
                    parallel=parallel,
                    targets_SxQ=targets,
                )
    np.asarray(picked[0])  # wait for the last program
    return runner.TRACES[0] - before


def images(engine, s: int, q: int, put):
    """A vision-language model's text-step input (M-RoPE positions), else None; steps whose
    chunks hold image tokens compile when they come."""
    if engine.cfg.vision is None:
        return None
    return (put(np.zeros((s, 3, q), np.int32))[0], None)
