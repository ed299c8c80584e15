"""Input pipelines: corpus sources, tokenizers, packing into rows, Grain datasets.

A batch is a dict of int32 arrays of shape [B, L]:
  inputs       token ids the model reads
  targets      the next token of each input (what the loss predicts)
  segment_ids  document number within the row, from 1 (0 marks padding); attention stays within one
  positions    position of the token within its document (RoPE uses it)
  loss_mask    1 where `targets` continues the same document, else 0
"""

from jaxllm.data.tokenizer import ByteTokenizer, make_tokenizer, tokenizer_vocab_size

__all__ = ["ByteTokenizer", "make_tokenizer", "tokenizer_vocab_size"]
