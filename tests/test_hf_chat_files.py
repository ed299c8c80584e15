"""Chat templates and generation_config.json: their forms and where they are found."""

import json
from pathlib import Path

import pytest

from jaxllm.data import tokenizer as tokenizer_lib

TEXT = [
    "the cat sat on the mat and the dog sat on the log. " * 4,
    "a quick brown fox jumps over the lazy dog; then it naps in the sun. " * 4,
]


def _bpe(tmp_path) -> Path:
    """A byte-level BPE tokenizer.json (<pad>, <bos>, <eos> = 0, 1, 2) in its own directory."""
    return tokenizer_lib.train_bpe(TEXT, 300, tmp_path / "tok")


def test_chat_template_forms():
    """A string chat template is the default; a chat_template.jinja beside the tokenizer wins
    over tokenizer_config.json, as in transformers."""
    assert tokenizer_lib._chat_templates(Path("/nonexistent"), "{{ x }}") == {"default": "{{ x }}"}
    assert tokenizer_lib._chat_templates(Path("/nonexistent"), None) == {}
    with pytest.raises(ValueError, match="neither a string nor a list"):
        tokenizer_lib._chat_templates(Path("/nonexistent"), {"default": 3})


def test_chat_template_jinja_file_wins(tmp_path):
    tok_json = _bpe(tmp_path)
    (tok_json.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A"}))
    assert tokenizer_lib.HFTokenizer(tok_json).chat_template == "A"
    (tok_json.parent / "chat_template.jinja").write_text("B")
    assert tokenizer_lib.HFTokenizer(tok_json).chat_template == "B"
    assert tokenizer_lib.ByteTokenizer().chat_template is None


def test_generation_config_is_found_beside_the_tokenizer_or_in_the_run(tmp_path):
    tok_dir, run = tmp_path / "tok", tmp_path / "run"
    tok_dir.mkdir(), run.mkdir()
    (run / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    find = tokenizer_lib.generation_config
    assert tokenizer_lib.generation_stop_ids(find("byte", run)) == {7}
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    for spec in (tok_dir / "tokenizer.json", tok_dir):  # a file, or the directory holding it
        assert tokenizer_lib.generation_stop_ids(find(str(spec), run)) == {2, 9}
    assert find("none", None) == {}
