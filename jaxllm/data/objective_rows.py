"""Rows rewritten for an objective, in the data pipeline (`row_transform`): masked LM's
corruption (`jaxllm.data.mlm`) and prefix LM's prefixes (`PrefixLM`).

A prefix LM (Raffel et al. 2020, arXiv:1910.10683, §3.2.1; UniLM) reads a prefix of each example
bidirectionally and predicts the rest causally. `PrefixLM` adds a `prefix` [L] array to each row
(1 on the prefix's tokens; the model's attention lets prefix tokens of one segment see each
other, `jaxllm.model.attention.dot_product_attention`) and trains only on what follows it:

- a segment whose loss mask starts after its first token has a prompt (prompt / completion and
  chat rows, `jaxllm.data.sft`): the prefix is its inputs up to the first trained one, i.e. the
  prompt (for chat, everything before the first assistant turn), and the loss mask stays;
- a segment trained from its first token (plain text, or SFT rows with data.train_on_prompt)
  gets a prefix length P drawn uniformly from 1 .. n - 1 for its n tokens (1 when n = 1), and
  loses the loss on its first P - 1 targets, which the prefix sees.

Either way no trained target is visible to the position that predicts it. As with masked LM,
the draw is seeded by (data.seed, the row's index in the stream), so a resumed run draws the
same prefixes. Packed rows draw per segment (each document, or piece of one, in the row).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.config import Config
from jaxllm.data.mlm import masker
from jaxllm.data.tokenizer import Tokenizer

# Keeps the prefix draws apart from the other numpy streams seeded by data.seed.
_STREAM = 0x50464C


@dataclasses.dataclass(frozen=True)
class PrefixLM:
    """`(index, row) -> row` with the `prefix` of prefix LM (see the module docstring)."""

    seed: int

    def __call__(self, index: int, row: dict) -> dict:
        rng = np.random.default_rng([self.seed, _STREAM, int(index)])
        seg_L = np.asarray(row["segment_ids"])
        loss_L = np.asarray(row["loss_mask"], np.int32).copy()
        prefix_L = np.zeros(seg_L.shape, np.int32)
        for s in np.unique(seg_L[seg_L > 0]):
            at = np.flatnonzero(seg_L == s)
            trained = np.flatnonzero(loss_L[at])
            if trained.size and trained[0] > 0:  # a prompt: the inputs up to the first target
                prefix_L[at[: trained[0] + 1]] = 1
                continue
            n = len(at)
            p = int(rng.integers(1, n)) if n > 1 else 1
            prefix_L[at[:p]] = 1
            loss_L[at[: p - 1]] = 0  # targets inside the prefix: seen by their predictors
        return {**row, "prefix": prefix_L, "loss_mask": loss_L}


def row_transform(cfg: Config, tok: Tokenizer):
    """The `(index, row) -> row` rewrite that `train.objective` needs in the data pipeline
    (`train_batches`, `eval_batches`), or None."""
    if cfg.train.objective == "prefix_lm":
        return PrefixLM(cfg.data.seed)
    return masker(cfg, tok)
