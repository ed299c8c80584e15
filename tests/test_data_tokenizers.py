"""Tests of the tokenizers: byte-level BPE trained here (function and `jaxllm data tokenizer`),
an existing tokenizer.json, a SentencePiece model trained in the test, explicit BOS/EOS, and the
cheap, jax-free vocabulary lookup that config validation uses.
"""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from jaxllm.cli import main
from jaxllm.config import Config, ConfigError, DataConfig, ModelConfig, SourceConfig
from jaxllm.data import (
    check_vocab,
    load_tokenizer,
    make_tokenizer,
    tokenizer_vocab_size,
    train_bpe,
)
from jaxllm.data.cli import add_data_parser
from jaxllm.data.pipeline import load_splits

CORPUS = [
    f"def function_{i}(self, value):\n    return value * {i} + len('héllo wörld')\n"
    for i in range(200)
]
SAMPLE = "def function_7(self, value):\n    return 'naïve 日本語 🙂'\n"


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return train_bpe(iter(CORPUS), 320, tmp_path_factory.mktemp("bpe"))


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return ns.func(ns)


def test_bpe_train_save_load_round_trip(bpe_path):
    assert bpe_path.name == "tokenizer.json"
    tok = make_tokenizer(DataConfig(tokenizer=str(bpe_path)))
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (320, 0, 1, 2)
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.int32 and ids.max() < 320
    assert tok.decode(ids) == SAMPLE  # byte-level: even unseen characters round-trip
    assert tok.encode(SAMPLE.encode()).tolist() == ids.tolist()
    # merges were learned: the training text takes far fewer ids than bytes
    assert len(tok.encode(CORPUS[3])) < 0.5 * len(CORPUS[3].encode())
    # specials are never produced from text and are dropped when decoding
    assert not {1, 2} & set(tok.encode("<bos> <eos>").tolist())
    assert tok.decode([1, *ids, 2, 10_000]) == SAMPLE
    # the directory stands for its tokenizer.json
    assert load_tokenizer(str(bpe_path.parent)).encode(SAMPLE).tolist() == ids.tolist()
    assert tokenizer_vocab_size(DataConfig(tokenizer=str(bpe_path))) == 320


def test_bpe_tokenizer_packs_rows_with_its_own_specials(bpe_path, tmp_path):
    (tmp_path / "a.txt").write_text(CORPUS[0] * 4)
    src = SourceConfig(path=str(tmp_path))
    cfg = DataConfig(sources=(src,), eval_sources=(src,), tokenizer=str(bpe_path), seq_len=8)
    train, _ = load_splits(cfg)
    tok = make_tokenizer(cfg)
    assert train[0]["inputs"][0] == tok.bos_id
    np.testing.assert_array_equal(train.tokens[1:-1], tok.encode(CORPUS[0] * 4))
    assert train.tokens[-1] == tok.eos_id


def test_tokenizer_cli_writes_tokenizer_json(tmp_path, capsys):
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"t": c}) + "\n" for c in CORPUS))
    out = tmp_path / "tok"
    code = run_cli(
        "data",
        "tokenizer",
        str(tmp_path / "corpus.jsonl"),
        "--text-field",
        "t",
        "--vocab-size",
        "300",
        "--out",
        str(out),
    )
    assert code == 0 and "300 ids (pad" in capsys.readouterr().out
    assert load_tokenizer(str(out / "tokenizer.json")).vocab_size == 300
    (tmp_path / "tiny.txt").write_text("ab ab ab\n")  # two merges, then none left
    tiny = ["data", "tokenizer", str(tmp_path / "tiny.txt"), "--vocab-size", "512"]
    assert run_cli(*tiny, "--out", str(tmp_path / "tiny")) == 0
    n = load_tokenizer(str(tmp_path / "tiny" / "tokenizer.json")).vocab_size
    line = f"{n} ids, fewer than --vocab-size 512: the corpus has no more merges"
    assert n < 512 and line in capsys.readouterr().out
    with pytest.raises(ConfigError, match="needs at least 259 ids"):
        run_cli("data", "tokenizer", str(tmp_path), "--vocab-size", "100", "--out", str(out))


def test_sentencepiece_model_loads_and_encodes(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n".join(c.replace("\n", " ") for c in CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=80,
        model_type="bpe",
        minloglevel=2,
    )
    cfg = DataConfig(tokenizer=str(tmp_path / "sp.model"))
    tok = make_tokenizer(cfg)
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (80, 1, 2)
    text = "def function_5(self, value): return value"
    assert tok.encode(text).tolist() == reference.encode(text)  # no BOS/EOS added by encode
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, *tok.encode(text), 2, 500]) == text
    assert tokenizer_vocab_size(cfg) == 80


def test_tokenizer_without_bos_needs_add_bos_false(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path = str(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"data.add_bos=true but tokenizer .* has no BOS token"):
        make_tokenizer(DataConfig(tokenizer=path))
    with pytest.raises(ConfigError, match=r"data.add_eos=true .* has no EOS token"):
        make_tokenizer(DataConfig(tokenizer=path, add_bos=False))
    plain = make_tokenizer(DataConfig(tokenizer=path, add_bos=False, add_eos=False))
    assert plain.encode("a b a").tolist() == [0, 1, 0]
    # chat sources only: their template writes BOS / EOS, so the flags ask for nothing
    chat = (SourceConfig(path="chats.jsonl", format="chat"),)
    assert make_tokenizer(DataConfig(tokenizer=path, sources=chat)).bos_id is None
    with pytest.raises(ConfigError, match=r"data.add_bos=true"):  # a text eval set needs BOS
        make_tokenizer(DataConfig(tokenizer=path, sources=chat, eval_sources=(SourceConfig(),)))
    chats = tmp_path / "chats.jsonl"  # and chats left at format: auto, detected as chat
    chats.write_text('{"messages": [{"role": "user", "content": "a"}]}\n' * 3)
    auto = (SourceConfig(path=str(chats)),)
    assert make_tokenizer(DataConfig(tokenizer=path, sources=auto)).bos_id is None
    (tmp_path / "docs.jsonl").write_text('{"text": "a b"}\n' * 3)  # text at auto: refused
    with pytest.raises(ConfigError, match=r"data.add_bos=true"):
        make_tokenizer(
            DataConfig(tokenizer=path, sources=(SourceConfig(path=str(tmp_path / "docs.jsonl")),))
        )


def test_missing_tokenizer_file_is_a_config_error(tmp_path):
    cfg = Config(data=DataConfig(tokenizer=str(tmp_path / "nope.json")))
    with pytest.raises(ConfigError, match=r"data.tokenizer=.*nope.json.* is neither `byte`"):
        check_vocab(cfg.data, cfg.model.vocab_size)


def test_vocab_larger_than_model_is_a_config_error(bpe_path, capsys):
    cfg = Config(model=ModelConfig(vocab_size=300), data=DataConfig(tokenizer=str(bpe_path)))
    cfg.validate()  # the config alone reads no tokenizer file ...
    with pytest.raises(ConfigError, match=r"model.vocab_size \(300\) is smaller .* \(320\)"):
        check_vocab(cfg.data, cfg.model.vocab_size)  # ... data meeting the model does
    run = bpe_path.parent / "never_made"
    assert (
        main(["train", f"data.tokenizer={bpe_path}", "model.vocab_size=300", f"run.dir={run}"]) == 2
    )
    assert "model.vocab_size (300) is smaller" in capsys.readouterr().err and not run.exists()


def test_vocab_size_lookup_does_not_import_jax(bpe_path):
    code = (
        "import sys; from jaxllm.config import DataConfig; "
        "from jaxllm.data import tokenizer_vocab_size; "
        f"n = tokenizer_vocab_size(DataConfig(tokenizer={str(bpe_path)!r})); "
        "assert 'jax' not in sys.modules and 'grain' not in sys.modules, 'imported jax'; print(n)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "320"
