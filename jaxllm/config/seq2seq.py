"""Encoder–decoder settings: T5's relative position buckets (`model.relative`, read with
`model.position=relative`; `jaxllm.model.relative_position`), span corruption
(`data.span_corruption`, read with `train.objective=span_corruption`;
`jaxllm.data.span_corruption`), and the checks of `model.kind=encoder_decoder`."""

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


@dataclasses.dataclass(frozen=True)
class SpanCorruptionConfig:
    """T5's span corruption of each row of raw tokens (`train.objective=span_corruption`):
    data.seq_len is the encoder's input length, and each row holds as many raw tokens as fit
    it once corrupted (T5's `random_spans_helper`: 568 raw tokens for 512 inputs)."""

    noise_density: float = 0.15
    """Fraction of each row's raw tokens hidden in noise spans (T5: 0.15)."""
    mean_span_length: float = 3.0
    """Mean length of a noise span (T5: 3)."""
    sentinel_start: int | None = None
    """Id of sentinel 0; sentinel k is sentinel_start - k. null: the tokenizer's `<extra_id_0>`
    when it has one (T5's tokenizers), else the top id of the model's vocabulary
    (model.vocab_size - 1), so the ids above the tokenizer's must leave room for the spans."""


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


def validate_span_corruption(cfg) -> None:
    """`data.span_corruption` is read by `train.objective=span_corruption` only, which reads
    concat-packed text (ConfigError). Whether the objective fits `model.kind` is checked where
    the objective is chosen (`jaxllm.objectives.from_config`): an imported T5 loads
    before any objective is given to it."""
    objective, kind, sc = cfg.train.objective, cfg.model.kind, cfg.data.span_corruption
    if objective != "span_corruption" and sc != SpanCorruptionConfig():
        fail("data.span_corruption.* is read by train.objective=span_corruption only.")
    if not 0 < sc.noise_density < 1 or sc.mean_span_length < 1:
        fail(
            "data.span_corruption.noise_density must be in (0, 1) and "
            "data.span_corruption.mean_span_length at least 1."
        )
    if objective == "span_corruption":
        if cfg.data.packing != "concat":
            fail(
                "train.objective=span_corruption corrupts concat-packed rows: set data.packing=concat."
            )
        for i, src in enumerate((*cfg.data.sources, *cfg.data.eval_sources)):
            if src.format in ("chat", "prompt_completion", "preference", "rollout"):
                fail(
                    f"train.objective=span_corruption reads plain text, not the format: "
                    f"{src.format} of data source {i}."
                )
    if cfg.mesh.sequence > 1 and kind == "encoder_decoder":
        fail("model.kind=encoder_decoder has no sequence-parallel attention: set mesh.sequence=1.")
