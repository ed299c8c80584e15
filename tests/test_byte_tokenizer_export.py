"""The export of a run trained on the byte tokenizer holds a tokenizer.json whose ids are jaxllm's
(`jaxllm.convert.byte_tokenizer`): `AutoTokenizer` encodes, decodes and generates with it."""

import json

import pytest
import torch
import transformers as hf

from jaxllm import checkpoint, cli, config
from jaxllm.data.tokenizer import ByteTokenizer
from jaxllm.model import build, split_peft

TEXTS = ["hello world", "  two  spaces\n\ttabs", "héllo 日本語 🙂", "", "<bos> spelled <eos>"]


def _byte_run(tmp_path, add_bos: bool):
    """A run directory of a tiny byte-tokenizer model (initial weights, step 0)."""
    run = tmp_path / "run"
    model = dict(vocab_size=384, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2)
    model |= dict(mlp_dim=64, max_seq_len=64, dtype="float32", param_dtype="float32")
    tree = {"run": {"dir": str(run)}, "model": model, "data": {"seq_len": 32, "add_bos": add_bos}}
    cfg = config.from_dict(tree).validate()
    checkpoint.save_params(
        checkpoint.checkpoint_dir(run),
        split_peft(build(cfg.model, 0), None)[1],
        step=0,
        config=config.to_dict(cfg),
        tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )
    config.dump(cfg, run / "config.yaml")
    return run


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_byte_tokenizer_run_exports_a_tokenizer_with_its_ids(tmp_path, add_bos):
    out = tmp_path / "exported"
    assert cli.main(["convert", "export", str(_byte_run(tmp_path, add_bos)), str(out)]) == 0
    tok, mine = hf.AutoTokenizer.from_pretrained(out), ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id) == (mine.bos_id, mine.eos_id)
    for text in TEXTS:
        ids = mine.encode(text).tolist()
        assert tok(text, add_special_tokens=False)["input_ids"] == ids
        assert tok(text)["input_ids"] == [mine.bos_id] * add_bos + ids  # BOS as the packer adds
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == mine.bos_id

    model = hf.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tok("def f(x):", return_tensors="pt")
    with torch.no_grad():
        seq = model.generate(**prompt, max_new_tokens=8, do_sample=False)[0].tolist()
    assert len(seq) > prompt["input_ids"].shape[1]
    text = tok.decode(seq, skip_special_tokens=True)
    assert text.startswith("def f(x):") and "<bos>" not in text
