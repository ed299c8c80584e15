"""Tokenizers. Byte-level is the default: no files, 256 byte ids plus BOS and EOS."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS = 256, EOS = 257."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


def make_tokenizer(data_cfg) -> ByteTokenizer:
    return ByteTokenizer()


def tokenizer_vocab_size(data_cfg) -> int:
    return ByteTokenizer.vocab_size
