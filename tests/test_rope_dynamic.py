"""Dynamic NTK RoPE (`model.rope.scaling=dynamic`) against transformers' `dynamic` rope type on
a tiny Qwen2 past its original context: a full forward, greedy generation through the KV cache
(each decode step with the frequencies of its own length, cached keys kept as written), and the
config.json mapping both ways."""

import os

import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import SMALL, VOCAB, hf_logits, run_cli, save_hf

import jaxllm
from jaxllm import config
from jaxllm.config import GenerateConfig
from jaxllm.convert import families
from jaxllm.infer import generate

ORIGINAL = 16
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def _qwen2():
    """A fresh model each time: transformers' rotary module remembers the longest length it saw
    (it keeps those frequencies for any later length above the original context), so one
    model's forward would change its next `generate`."""
    torch.manual_seed(0)
    kwargs = {**SMALL, "max_position_embeddings": ORIGINAL, "rope_parameters": DYNAMIC}
    model = hf.Qwen2ForCausalLM(hf.Qwen2Config(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dynamic")
    src = save_hf(_qwen2(), tmp / "hf")
    overrides = ("model.dtype=float32", "model.max_seq_len=64")
    assert run_cli("convert", "import", src, tmp / "run", *overrides) == 0
    return tmp / "run"


def test_imports_as_dynamic_with_the_original_context(run):
    rope = jaxllm.load_model(run).cfg.rope
    assert (rope.scaling, rope.factor, rope.original_max_len) == ("dynamic", 2.0, ORIGINAL)


def test_forward_past_the_original_context_equals_transformers(run):
    """Rows of 40 tokens (2.5x the original 16): the base is rescaled for length 40; a row of
    12 keeps the unscaled frequencies (and so differs from a model without scaling only past
    16)."""
    model = jaxllm.load_model(run)
    for length in (40, 12):
        tokens = np.random.default_rng(length).integers(0, VOCAB, (2, length))
        got = np.asarray(model(tokens).logits)
        np.testing.assert_allclose(got, hf_logits(_qwen2(), tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt_len", [10, 21])
def test_greedy_generation_across_and_past_the_original_context_equals_transformers(
    run, prompt_len
):
    """A prompt below the original context whose continuation crosses it, and one already past
    it (a scaled prefill): greedy tokens equal transformers' `generate`."""
    prompt = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len).tolist()
    ours = generate(
        jaxllm.load_model(run),
        [prompt],
        GenerateConfig(max_new_tokens=30, kv_cache_dtype="float32"),
    )
    with torch.no_grad():
        theirs = _qwen2().generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, min_new_tokens=30
        )
    assert ours.tokens[0] == theirs[0, prompt_len:].tolist()


def test_config_json_both_ways(run):
    """Export writes rope_type `dynamic` with max_position_embeddings = the original context
    (transformers has no other key for it); the legacy `rope_scaling` {"type": ...} form
    imports the same."""
    cfg = jaxllm.load_model(run).cfg
    qwen2 = families.FAMILIES["qwen2"]
    out = families.hf_config(cfg, qwen2)
    assert out["rope_parameters"] == {**DYNAMIC, "factor": 2.0}
    assert out["max_position_embeddings"] == ORIGINAL
    legacy = {**out, "rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    assert qwen2.to_model(legacy)["rope"] == qwen2.to_model(out)["rope"]
    assert qwen2.to_model(legacy)["rope"]["original_max_len"] == ORIGINAL


def test_refused_where_no_pass_computes_it():
    base = {"position": "rope", "rope": {"scaling": "dynamic", "factor": 2.0}}
    with pytest.raises(config.ConfigError, match="scaling=dynamic"):
        config.from_dict({"model": {**base, "kind": "encoder"}}).model.validate()


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
