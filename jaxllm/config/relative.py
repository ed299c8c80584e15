"""T5's relative position buckets (`model.position=relative`, `jaxllm.model.relative_position`)."""

from __future__ import annotations

import dataclasses

from jaxllm.config.errors import fail


@dataclasses.dataclass(frozen=True)
class RelativeConfig:
    """Buckets of T5's relative position bias: one learned scalar per (bucket, head), one table
    per stack (encoder, decoder). Read only with `model.position=relative`."""

    num_buckets: int = 32
    """Buckets of relative positions (T5: 32); half exact, half logarithmic (bidirectional
    stacks split them between keys before and after the query)."""
    max_distance: int = 128
    """Distance from which every relative position shares the last bucket (T5: 128)."""


# What the encoder–decoder (`jaxllm.model.encoder_decoder`) does not build: key -> its default.
_NOT_IN_ENCODER_DECODER = {
    "sliding_window": None,
    "qk_norm": False,
    "qkv_bias": False,
    "o_bias": False,
    "attn_soft_cap": None,
    "final_soft_cap": None,
    "scale_embeddings": False,
    "norm_placement": "pre",
    "head": "lm",
    "value_head": False,
}


def validate_encoder_decoder(m) -> None:
    """The checks of `model.kind=encoder_decoder` and `model.position=relative` (ConfigError)."""
    if m.kind != "encoder_decoder":
        if m.position == "relative":
            fail("model.position=relative (T5 buckets) needs model.kind=encoder_decoder.")
        for key in ("decoder_layers", "scale_head_input"):
            if getattr(m, key) not in (None, False):
                fail(f"model.{key} belongs to model.kind=encoder_decoder only.")
        return
    if m.position not in ("relative", "none"):
        fail(
            f"model.kind=encoder_decoder takes model.position=relative (T5) or none, not "
            f"{m.position}."
        )
    if m.moe.enabled or m.mla.enabled:
        fail("model.kind=encoder_decoder has dense GQA blocks: unset model.moe and model.mla.")
    for key, default in _NOT_IN_ENCODER_DECODER.items():
        if getattr(m, key) != default:
            fail(f"model.{key} is not part of model.kind=encoder_decoder; set it to {default}.")
    if m.decoder_layers is not None and m.decoder_layers < 1:
        fail(f"model.decoder_layers must be >= 1 or null, not {m.decoder_layers}.")
    r = m.relative
    if m.position == "relative" and (r.num_buckets < 2 or r.max_distance <= r.num_buckets // 4):
        fail(
            "model.relative.num_buckets must be >= 2 and model.relative.max_distance above a "
            "quarter of it."
        )
    if m.position != "relative" and r != RelativeConfig():
        fail("model.relative.* only applies to model.position=relative.")
