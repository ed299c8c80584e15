"""The `model.rope` subsection: rotary position embedding (`RopeConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding (`jaxllm.model.positions`): the base frequency, context
    extension, the base of windowed layers and the channel-pair layout."""

    theta: float = 10000.0
    """Base frequency."""
    scaling: Literal["none", "linear", "ntk", "dynamic", "yarn", "llama3"] = "none"
    """Context extension by `factor` (Hugging Face `rope_type`): `linear` (position
    interpolation: frequencies / factor), `ntk` (NTK-aware: theta * factor^(K / (K - 2))),
    `dynamic` (dynamic NTK, transformers' `dynamic`: unscaled up to original_max_len, beyond
    it theta * (factor * s / original_max_len - (factor - 1))^(K / (K - 2)) for the current
    length s, recomputed every forward pass and decode step; cached keys keep the frequencies
    they were written with),
    `yarn` (Peng et al. 2023: per-frequency ramp between interpolation and extrapolation, plus
    an attention temperature), `llama3` (Llama 3.1: low frequencies / factor, a smooth band)."""
    factor: float = 1.0
    """Context extension factor of `scaling`; must stay 1 without scaling."""
    original_max_len: int | None = None
    """Context length the model was pretrained at (`yarn`, `llama3`, `dynamic`); null means
    model.max_seq_len."""
    low_freq_factor: float = 1.0
    """`llama3`: wavelengths above original_max_len / this are interpolated fully."""
    high_freq_factor: float = 4.0
    """`llama3`: wavelengths below original_max_len / this are kept as they are."""
    beta_fast: float = 32.0
    """`yarn`: rotations over the original context above which a frequency is extrapolated."""
    beta_slow: float = 1.0
    """`yarn`: rotations below which a frequency is interpolated."""
    attention_factor: float | None = None
    """`yarn`: multiplier of cos/sin (attention temperature); null is 0.1 ln(factor) + 1."""
    truncate: bool = True
    """`yarn`: round the ramp's ends to whole channel pairs (floor / ceil), as the YaRN paper;
    false keeps them fractional (gpt-oss, Hugging Face `truncate: false`)."""
    local_theta: float | None = None
    """Base of windowed (sliding-window) layers, which take no `scaling` (Gemma 3: 10k locally,
    theta 1M with linear scaling globally); null: every layer uses theta and the scaling.
    Needs model.sliding_window."""
    partial_factor: float = 1.0
    """Fraction of each head's channels that RoPE rotates (the first ones; Hugging Face
    `partial_rotary_factor`, Qwen3-Next: 0.25); the rest carry no position."""
    interleave: bool = False
    """Rotate adjacent channel pairs (2i, 2i + 1) (GPT-J, DeepSeek-V2/V3 checkpoints) instead of
    the "rotate half" pairs (i, i + K/2) of Llama checkpoints."""
