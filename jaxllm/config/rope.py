"""The `model.rope` subsection: rotary position embedding (`RopeConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxllm.config.errors import fail


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
    mrope_section: tuple[int, ...] | None = None
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; `jaxllm.model.mrope`): how many of the
    rotated frequencies (K/2 of them, `partial_factor` applied) turn by the temporal, height
    and width position rows, e.g. [16, 24, 24] for 128-wide heads; the model then takes
    positions [3, B, L] as well as [B, L] (copied to the three rows: plain RoPE). Null: off."""
    mrope_interleaved: bool = False
    """With mrope_section: frequencies cycle temporal, height, width (Qwen3-VL) instead of
    contiguous sections (Qwen2-VL, Qwen2.5-VL)."""


def validate_mrope(r: RopeConfig, rope_dim: int, mla: bool, kind: str) -> None:
    """Refuses an M-RoPE setting the decoder cannot honour, in one sentence."""
    if r.mrope_section is None:
        if r.mrope_interleaved:
            fail("model.rope.mrope_interleaved needs model.rope.mrope_section.")
        return
    s = r.mrope_section
    if mla or kind != "decoder" or r.scaling == "dynamic":
        fail(
            "model.rope.mrope_section is supported for decoders with GQA attention, not with "
            "MLA, model.kind=encoder/encoder_decoder or model.rope.scaling=dynamic."
        )
    if len(s) != 3 or min(s) < 1:
        fail(f"model.rope.mrope_section must be three positive ints (t, h, w), not {list(s)}.")
    if sum(s) != rope_dim // 2:
        fail(
            f"model.rope.mrope_section {list(s)} must sum to half the rotated head width "
            f"({rope_dim} // 2 = {rope_dim // 2})."
        )
    k2 = rope_dim // 2  # interleaved: frequency i of row 1 (2) when i % 3 == 1 (2), i < 3 s[1 (2)]
    fits = all(len(range(o, min(3 * s[o], k2), 3)) == s[o] for o in (1, 2))
    if r.mrope_interleaved and not fits:
        fail(f"model.rope.mrope_section {list(s)} does not fit the interleaved layout.")
