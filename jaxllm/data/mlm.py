"""Masked-LM corruption (BERT, Devlin et al. 2019, arXiv:1810.04805) of packed rows, for
`train.objective=mlm`.

Each real token of a row (segment id > 0, and not BOS / EOS) is selected with probability
`train.mask_rate` (0.15), independently; a selected token becomes the mask token with
probability 0.8, a token drawn uniformly from the tokenizer's vocabulary with 0.1, and stays
itself with 0.1. The row's `inputs` become the corrupted tokens, `targets` the original ones
(at the same position, not shifted) and `loss_mask` the selection, so the objective is
cross-entropy over the selected tokens only. `segment_ids` and `positions` are kept: packed
documents stay apart in attention.

The masking runs in the data pipeline, as a Grain `map_with_index` over the stream of rows, from
a numpy generator seeded by (data.seed, the row's index in the stream): an example's masking is
a pure function of the seed and its position, so a resumed run (which restarts the stream at its
next batch) masks every later row exactly as the uninterrupted run, whatever the number of
processes or Grain workers, and the jitted step needs no extra rng. The training stream repeats
the rows under a new shuffle each epoch, so a row seen again is masked anew (RoBERTa's dynamic
masking); held-out rows are indexed by their place in the eval split, so every evaluation sees
the same masks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.config import Config, ConfigError
from jaxllm.data.tokenizer import Tokenizer

# Keeps the masking's generator apart from any other numpy stream seeded by data.seed.
_STREAM = 0x4D4C4D


@dataclasses.dataclass(frozen=True)
class Masker:
    """`(index, row) -> row` for `grain.MapDataset.map_with_index`: the MLM corruption of row
    number `index` of a stream (see the module docstring)."""

    seed: int
    rate: float
    mask_id: int
    vocab_size: int
    """Random replacements are drawn from ids [0, vocab_size): the tokenizer's."""
    special_ids: tuple[int, ...] = ()
    """Ids never selected (BOS, EOS)."""

    def __call__(self, index: int, row: dict) -> dict:
        rng = np.random.default_rng([self.seed, _STREAM, int(index)])
        tokens_L = np.asarray(row["inputs"], np.int32)
        n = tokens_L.shape[0]
        eligible_L = (np.asarray(row["segment_ids"]) > 0) & ~np.isin(tokens_L, self.special_ids)
        selected_L = eligible_L & (rng.random(n) < self.rate)
        how_L = rng.random(n)  # < 0.8: mask; [0.8, 0.9): random token; else unchanged
        random_L = rng.integers(0, self.vocab_size, n, dtype=np.int32)
        inputs_L = np.where(selected_L & (how_L < 0.8), self.mask_id, tokens_L)
        inputs_L = np.where(selected_L & (how_L >= 0.8) & (how_L < 0.9), random_L, inputs_L)
        return {
            **row,
            "inputs": inputs_L.astype(np.int32),
            "targets": tokens_L,
            "loss_mask": selected_L.astype(np.int32),
        }


def mask_token_id(tok: Tokenizer, requested: int | None) -> int:
    """`train.mask_token_id` when set, else the tokenizer's mask token, else the first id past
    the tokenizer's vocabulary."""
    if requested is not None:
        return requested
    found = getattr(tok, "mask_id", None)
    return tok.vocab_size if found is None else found


def masker(cfg: Config, tok: Tokenizer) -> Masker | None:
    """The corruption of `train.objective=mlm` (None for any other objective). ConfigError when
    model.vocab_size cannot hold the mask token."""
    if cfg.train.objective != "mlm":
        return None
    mask_id = mask_token_id(tok, cfg.train.mask_token_id)
    if mask_id >= cfg.model.vocab_size:
        raise ConfigError(
            f"the mask token id {mask_id} (train.mask_token_id, or the first id past the "
            f"tokenizer's {tok.vocab_size}) is outside model.vocab_size ({cfg.model.vocab_size});"
            " raise model.vocab_size or set train.mask_token_id."
        )
    specials = tuple(i for i in (tok.bos_id, tok.eos_id) if i is not None)
    return Masker(cfg.data.seed, cfg.train.mask_rate, mask_id, tok.vocab_size, specials)
