"""T5's span corruption (Raffel et al. 2020, arXiv:1910.10683, §3.1.4), as in
`t5.data.preprocessors.span_corruption`.

A row of raw tokens is split into alternating non-noise and noise spans
(`random_spans_noise_mask`: `round(n * noise_density)` noise tokens in
`round(noise / mean_span_length)` spans, both segmentations uniformly random, the row always
starting with non-noise). The encoder reads the kept tokens with one sentinel in place of each
noise span, then EOS; the decoder predicts each sentinel followed by the span it hides, then
EOS:

    tokens   a b c d e f g h        noise  . . x x . . . x
    inputs   a b <s0> e f g <s1> EOS
    targets  <s0> c d <s1> h EOS

Sentinel k is `sentinel_start - k` (T5: `<extra_id_0>` is the top id of its vocabulary and the
ids count down). `raw_length` (T5's `random_spans_helper`) is the longest raw row whose
corrupted inputs fit `inputs_length`; the counts depend only on the row length, so every row of
that length gives inputs and targets of the same lengths. The mask of row `index` is drawn from
`numpy.random.default_rng((seed, index))`, so it is a pure function of (seed, row), whatever
the order rows are read in (exact resume).

A batch row (`SpanCorruptionRows`) holds `inputs` [Le] and `segment_ids` [Le] (1 on tokens, 0
on padding) for the encoder, and `decoder_inputs`, `targets`, `loss_mask` [Ld] for the decoder:
decoder inputs are the targets shifted right behind `decoder_start_id` (T5: the pad id 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.config import ConfigError
from jaxllm.data.pipeline import load_splits
from jaxllm.data.tokenizer import make_tokenizer

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


def _counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a row of `length` tokens, as T5 rounds them."""
    num_noise = int(round(length * noise_density))
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = max(int(round(num_noise / mean_span_length)), 1)
    return num_noise, num_spans


def raw_length(
    inputs_length: int,
    noise_density: float = NOISE_DENSITY,
    mean_span_length: float = MEAN_SPAN_LENGTH,
) -> tuple[int, int]:
    """(raw tokens per row, target length): T5's `random_spans_helper` with one sentinel per
    span on each side and one EOS. Inputs of 512 -> (568, 114)."""

    def lengths(n: int) -> tuple[int, int]:
        noise = int(round(n * noise_density))
        spans = int(round(noise / mean_span_length))
        return n - noise + spans + 1, noise + spans + 1

    n = inputs_length - 1
    while lengths(n + 1)[0] <= inputs_length:
        n += 1
    targets_length = lengths(n)[1]
    if noise_density == 0.5 and targets_length > lengths(n)[0]:
        n, targets_length = n - 1, targets_length - 1
    return n, targets_length


def _segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a uniformly random split of `num_items` into `num_segments` non-empty parts."""
    first = np.zeros(num_items, bool)
    first[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
    return np.bincount(np.cumsum(first), minlength=num_segments).astype(np.int64)


def random_spans_noise_mask(
    length: int,
    rng: np.random.Generator,
    noise_density: float = NOISE_DENSITY,
    mean_span_length: float = MEAN_SPAN_LENGTH,
) -> np.ndarray:
    """Boolean [length]: True on noise. Non-noise and noise spans alternate, non-noise first."""
    n = max(length, 2)
    num_noise, num_spans = _counts(n, noise_density, mean_span_length)
    noise_lengths = _segmentation(num_noise, num_spans, rng)
    keep_lengths = _segmentation(n - num_noise, num_spans, rng)
    interleaved = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)
    span_index = np.repeat(np.arange(2 * num_spans), interleaved)
    return (span_index % 2 == 1)[:length]


def _replace_spans(tokens: np.ndarray, span_mask: np.ndarray, sentinel_start: int) -> np.ndarray:
    """Each run of True in `span_mask` becomes one sentinel (sentinel_start, sentinel_start - 1,
    ...): T5's `noise_span_to_unique_sentinel`."""
    prev = np.concatenate([[False], span_mask[:-1]])
    first = span_mask & ~prev
    sentinels = sentinel_start + 1 - np.cumsum(first)
    out = np.where(first, sentinels, tokens)
    return out[~(span_mask & prev)]


def corrupt(
    tokens: np.ndarray, noise_mask: np.ndarray, sentinel_start: int, eos_id: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of `tokens` under `noise_mask`, each ending in `eos_id` (if any)."""
    tokens = np.asarray(tokens, np.int32)
    inputs = _replace_spans(tokens, noise_mask, sentinel_start)
    targets = _replace_spans(tokens, ~noise_mask, sentinel_start)
    if eos_id is not None:
        inputs, targets = np.append(inputs, eos_id), np.append(targets, eos_id)
    return inputs.astype(np.int32), targets.astype(np.int32)


def sentinel_start_id(tok, vocab_size: int, configured: int | None) -> int:
    """The id of sentinel 0: `configured`, else the tokenizer's `<extra_id_0>`, else the top id
    of the model's vocabulary (`vocab_size - 1`)."""
    if configured is not None:
        return configured
    token_to_id = getattr(getattr(tok, "_tok", None), "token_to_id", None)
    if token_to_id is not None:
        found = token_to_id("<extra_id_0>")
        if found is not None:
            return int(found)
    return vocab_size - 1


class SpanCorruptionRows:
    """Random-access rows of encoder inputs / decoder targets, one per row of `raw` (a source of
    rows whose `inputs` are `raw_length(inputs_length)[0]` raw tokens, e.g. `PackedRows`)."""

    def __init__(
        self,
        raw,
        inputs_length: int,
        *,
        sentinel_start: int,
        eos_id: int | None,
        seed: int,
        pad_id: int = 0,
        decoder_start_id: int = 0,
        noise_density: float = NOISE_DENSITY,
        mean_span_length: float = MEAN_SPAN_LENGTH,
    ):
        self.raw, self.inputs_length, self.seed = raw, inputs_length, seed
        self.sentinel_start, self.eos_id, self.pad_id = sentinel_start, eos_id, pad_id
        self.decoder_start_id = decoder_start_id
        self.noise_density, self.mean_span_length = noise_density, mean_span_length
        self.raw_length, self.targets_length = raw_length(
            inputs_length, noise_density, mean_span_length
        )
        self.num_docs = getattr(raw, "num_docs", len(raw))
        self.num_tokens = getattr(raw, "num_tokens", len(raw) * self.raw_length)

    def __len__(self) -> int:
        return len(self.raw)

    def _pad(self, x: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        out = np.full(length, self.pad_id, np.int32)
        out[: len(x)] = x
        return out, (np.arange(length) < len(x)).astype(np.int32)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens = np.asarray(self.raw[index]["inputs"])
        rng = np.random.default_rng((self.seed, int(index)))
        mask = random_spans_noise_mask(len(tokens), rng, self.noise_density, self.mean_span_length)
        inputs, targets = corrupt(tokens, mask, self.sentinel_start, self.eos_id)
        inputs, segment_ids = self._pad(inputs, self.inputs_length)
        targets, loss_mask = self._pad(targets, self.targets_length)
        decoder_inputs = np.concatenate([[self.decoder_start_id], targets[:-1]]).astype(np.int32)
        return {
            "inputs": inputs,
            "segment_ids": segment_ids,
            "decoder_inputs": decoder_inputs,
            "targets": targets,
            "loss_mask": loss_mask,
        }


def corrupted_splits(data_cfg, vocab_size: int):
    """(train rows, eval rows) of `data.sources` for `train.objective=span_corruption`: the
    concat-packed rows of `raw_length(data.seq_len)` raw tokens, each corrupted by
    `SpanCorruptionRows` with `data.span_corruption`'s settings, the tokenizer's EOS and pad
    (the pad id also starts the decoder, as T5's 0). ConfigError when the sentinels would
    overlap the tokenizer's ids."""
    sc = data_cfg.span_corruption
    n_raw, _ = raw_length(data_cfg.seq_len, sc.noise_density, sc.mean_span_length)
    train, held_out = load_splits(dataclasses.replace(data_cfg, seq_len=n_raw))
    tok = make_tokenizer(data_cfg)
    start = sentinel_start_id(tok, vocab_size, sc.sentinel_start)
    spans = _counts(n_raw, sc.noise_density, sc.mean_span_length)[1]
    tokenizer_ids = tok.vocab_size
    if start >= vocab_size or (start - spans + 1 < tokenizer_ids and start == vocab_size - 1):
        raise ConfigError(
            f"span corruption needs {spans} sentinel ids counting down from {start}, inside "
            f"model.vocab_size ({vocab_size}) and above the tokenizer's {tokenizer_ids} ids: "
            "raise model.vocab_size or set data.span_corruption.sentinel_start."
        )

    def corrupted(rows):
        return SpanCorruptionRows(
            rows,
            data_cfg.seq_len,
            sentinel_start=start,
            eos_id=tok.eos_id,
            seed=data_cfg.seed,
            pad_id=tok.pad_id,
            decoder_start_id=tok.pad_id,
            noise_density=sc.noise_density,
            mean_span_length=sc.mean_span_length,
        )

    return corrupted(train), None if held_out is None else corrupted(held_out)


def batch_lengths(data_cfg) -> dict[str, int]:
    """The length of each array of a span-corruption row (`SpanCorruptionRows`), for synthetic
    and abstract batches (`jaxllm bench`, `jaxllm plan`)."""
    sc = data_cfg.span_corruption
    targets = raw_length(data_cfg.seq_len, sc.noise_density, sc.mean_span_length)[1]
    encoder = dict.fromkeys(("inputs", "segment_ids"), data_cfg.seq_len)
    return {**encoder, **dict.fromkeys(("decoder_inputs", "targets", "loss_mask"), targets)}
