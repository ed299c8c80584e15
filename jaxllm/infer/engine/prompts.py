"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`, OpenAI's `echo` with `logprobs`):
collected chunk by chunk during prefill, only for the sequences that ask.

A step in which such a sequence feeds prompt tokens gives the device each slot's targets (the
token after each fed one, `targets`) and runs the step's other program, which keeps the logits
of every position; `record` stores the log-probability of each prompt token after the first
(and the top pairs at its position) by position, so a chunk computed again after a preemption
writes the same values. Such a prompt is computed, not read from the prefix cache, until its
log-probabilities are complete.
"""

from __future__ import annotations

import numpy as np


def asks(seq) -> bool:
    """Whether `seq` still needs its prompt's log-probabilities computed."""
    return seq.params.prompt_logprobs is not None and seq.prompt_lp is None


def targets(batch, slots: int, q: int) -> np.ndarray | None:
    """[slots, q] the token after each fed token of the sequences that ask (0 elsewhere); None
    when no sequence of the step feeds prompt tokens it asks for."""
    if not any(asks(seq) and seq.computed < len(seq.prompt) for seq, _ in batch):
        return None
    out_SxQ = np.zeros((slots, q), np.int32)
    for seq, take in batch:
        if asks(seq):
            after = seq.prompt[seq.computed + 1 : seq.computed + 1 + take]
            out_SxQ[seq.slot, : len(after)] = after
    return out_SxQ


def record(batch, prompt) -> None:
    """Stores the step's prompt log-probabilities (`runner.prompt_logprobs`) into each asking
    sequence's `prompt_partial` (read before `computed` advances)."""
    logp_SxQ, rank_SxQ, ids_SxQxK, top_SxQxK = map(np.asarray, prompt)
    for seq, take in batch:
        if not asks(seq):
            continue
        if seq.prompt_partial is None:
            seq.prompt_partial = [None] * len(seq.prompt)
        k = seq.params.prompt_logprobs
        for i in range(take):
            pos = seq.computed + i + 1
            if pos >= len(seq.prompt):
                break
            r = seq.slot
            top = [(int(t), float(v)) for t, v in zip(ids_SxQxK[r, i, :k], top_SxQxK[r, i, :k])]
            seq.prompt_partial[pos] = (float(logp_SxQ[r, i]), int(rank_SxQ[r, i]), top)


def finished(batch) -> list:
    """The asking sequences whose prompt is now fully computed: their log-probabilities are
    complete (`seq.prompt_lp`: None then (log-prob, rank, top pairs) per prompt token)."""
    done = []
    for seq, _ in batch:
        if asks(seq) and seq.computed >= len(seq.prompt):
            seq.prompt_lp = seq.prompt_partial or [None]
            seq.prompt_partial = None
            done.append(seq)
    return done
