"""The byte tokenizer (`jaxllm.data.tokenizer.ByteTokenizer`) as a tokenizer.json, for the export
of a run trained on it, so that `AutoTokenizer.from_pretrained(export)` encodes and decodes as
jaxllm does.

It is a byte-level BPE without merges: the `ByteLevel` pre-tokenizer (GPT-2's) spells each UTF-8
byte b as one printable character, and the vocabulary maps that character to id b, so a text's
ids are its bytes. BOS and EOS are special tokens at jaxllm's ids (256, 257). No text spells
them in jaxllm, so tokenizer_config.json sets `split_special_tokens`: transformers then reads
`<bos>` written in a text as its five bytes too. The pad id, 0, is the NUL byte, a real token,
so it is named only in config.json (`pad_token_id`), not as a special token that decoding with
`skip_special_tokens` would drop. A run that puts BOS before every document (data.add_bos) gets
a post-processor that does the same, as a tokenizer.json run does (`export.exported_backend`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxllm.data.tokenizer import ByteTokenizer

BOS, EOS = "<bos>", "<eos>"


def _byte_chars() -> list[str]:
    """GPT-2's printable character for each byte (`ByteLevel`'s alphabet, by byte): printable
    Latin-1 bytes stand for themselves, the rest take the characters from U+0100 on."""
    kept = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = iter(range(0x100, 0x200))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def byte_tokenizer_json(add_bos: bool) -> Tokenizer:
    """A `tokenizers` tokenizer whose ids are `ByteTokenizer`'s (see the module docstring)."""
    vocab = {char: b for b, char in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    ids = (tok.token_to_id(BOS), tok.token_to_id(EOS))
    assert ids == (ByteTokenizer.bos_id, ByteTokenizer.eos_id), ids  # the ids after the bytes
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A {BOS} $B",
            special_tokens=[(BOS, ByteTokenizer.bos_id)],
        )
    return tok


def write_byte_tokenizer(hf_dir: Path, add_bos: bool, max_len: int) -> None:
    """tokenizer.json and tokenizer_config.json of the byte tokenizer into `hf_dir`."""
    byte_tokenizer_json(add_bos).save(str(hf_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "split_special_tokens": True,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
