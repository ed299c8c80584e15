"""Input pipelines: corpus sources, tokenizers, packing into rows, Grain datasets.

A batch is a dict of int32 arrays of shape [B, L]:
  inputs       token ids the model reads
  targets      the next token of each input (what the loss predicts; masked LM: the original
               token at the same position)
  segment_ids  document number within the row, from 1 (0 marks padding); attention stays within one
  positions    position of the token within its document (RoPE uses it)
  loss_mask    1 where `targets` continues the same document, else 0 (for SFT examples only
               where the target is in an assistant turn / the completion)
Image-text rows (a model with a vision tower) add M-RoPE positions and their images' patches
(`vision_rows`).

Modules: `sources` (files and formats -> texts), `tokenizer` (texts -> ids), `chat` (chat
templates), `sft` (chat / prompt-completion records -> ids with loss masks -> whole-example
rows), `prepare` (ids -> ArrayRecord shards, once), `packing` (documents -> rows), `mlm`
(masked-LM corruption of rows), `images` (image files / base64 -> patches as the Qwen2-VL
processor cuts them), `pipeline`
(config -> Grain batches), `bench` (pipeline throughput), `cli` (`jaxllm data ...`,
`jaxllm bench data`).

Importing this package must stay cheap and jax-free (config validation imports it); `pipeline`
imports Grain, which imports jax.
"""

from jaxllm.data.tokenizer import (
    ByteTokenizer,
    check_vocab,
    load_tokenizer,
    make_tokenizer,
    tokenizer_vocab_size,
    train_bpe,
)

__all__ = [
    "ByteTokenizer",
    "check_vocab",
    "load_tokenizer",
    "make_tokenizer",
    "tokenizer_vocab_size",
    "train_bpe",
]
