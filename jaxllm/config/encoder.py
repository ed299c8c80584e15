"""The `model.encoder` subsection: the parts a BERT-style encoder (`model.kind=encoder`) adds
around the shared blocks (token types, an embedding norm, position offsets, the MLM head and the
pooler), and their checks."""

from __future__ import annotations

import dataclasses

from jaxllm.config.errors import fail as _fail


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """BERT / RoBERTa parts of an encoder; all off by default (a plain bidirectional stack ending
    in the LM head). `configs/models/bert_base.yaml` turns on what BERT has."""

    type_vocab_size: int = 0
    """Rows of a token-type (segment A / B) embedding table added to the token embeddings (BERT:
    2, RoBERTa: 1); the model takes `token_types_BxL` (default all 0). 0: no table."""
    embed_norm: bool = False
    """Normalise (model.norm, model.norm_eps) the summed token, position and type embeddings
    before the first block (BERT's embeddings LayerNorm)."""
    position_offset: int = 0
    """Learned positions (model.position=learned) read row position + this of the table:
    RoBERTa numbers tokens from padding_idx + 1 = 2, so its table has model.max_seq_len = 514
    rows for 512 tokens. data.seq_len may not exceed model.max_seq_len - position_offset."""
    mlm_head: bool = False
    """BERT's MLM head: before the LM head (tied or not) a dense D x D layer with bias, the MLP's
    activation (model.mlp_activation, model.gelu_approximate) and a norm; after it a bias over
    the vocabulary."""
    pooler: bool = False
    """BERT's pooler: tanh(dense(h)) of each row's first token ([CLS]), returned as
    `ModelOutput.pooled` [B, D]; kept so that BERT checkpoints import and export whole."""

    def validate(self, kind: str, position: str, mlp_activation: str) -> None:
        """Checks against the model's kind, position and activation (raises ConfigError)."""
        changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        if changed and kind != "encoder":
            _fail(f"model.encoder.{changed[0]} needs model.kind=encoder, not {kind}.")
        if self.type_vocab_size < 0 or self.position_offset < 0:
            _fail("model.encoder.type_vocab_size and model.encoder.position_offset must be >= 0.")
        if self.position_offset and position != "learned":
            _fail(
                f"model.encoder.position_offset shifts learned positions: it needs "
                f"model.position=learned, not {position}."
            )
        if self.mlm_head and mlp_activation in ("swiglu", "geglu"):
            _fail(
                f"model.encoder.mlm_head applies the activation of a plain MLP; "
                f"model.mlp_activation={mlp_activation} is gated (use gelu, relu or relu2)."
            )
