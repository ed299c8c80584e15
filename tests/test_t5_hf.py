"""T5 v1.0 (ReLU, tied and rescaled head) and v1.1 (gated GELU, untied head) in and out of
Hugging Face: decoder-logit parity with transformers on CPU, and the export round trip."""

import json
import math

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from flax import nnx
from safetensors.torch import load_file, save_file

import jaxllm
from jaxllm import config
from jaxllm.convert.export import export_hf
from jaxllm.convert.hf import model_config
from jaxllm.model import abstract_model

pytestmark = pytest.mark.torch
VOCAB = 288  # above the byte tokenizer's 258: the run gets it (no tokenizer.json here)


def t5_dir(tmp_path, v11: bool, decoder_layers: int = 3):
    """A tiny T5 saved by transformers, every weight random (v1.1: a head of its own)."""
    cfg = hf.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=decoder_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu" if v11 else "relu",
        tie_word_embeddings=not v11,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    model = hf.T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    path = tmp_path / ("v11" if v11 else "v10")
    model.save_pretrained(path)
    if v11:  # as the original v1.1 checkpoints: lm_head stored, tie_word_embeddings false
        tensors = load_file(path / "model.safetensors")
        tensors["lm_head.weight"] = torch.randn(VOCAB, 32) * 0.3
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        c = json.loads((path / "config.json").read_text())
        c["tie_word_embeddings"] = False
        c.pop("scale_decoder_outputs", None)
        (path / "config.json").write_text(json.dumps(c))
    return path


def reference_logits(path, ids, mask, dec):
    model = hf.T5ForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
        )
    return out.logits.numpy()


def inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(2, VOCAB, (2, 30))
    mask = np.ones_like(ids)
    mask[1, 21:] = 0  # the second row is right-padded
    return ids, mask, rng.integers(2, VOCAB, (2, 25))


@pytest.mark.parametrize("v11", [False, True], ids=["v1.0", "v1.1"])
def test_decoder_logits_match_transformers(tmp_path, v11):
    path = t5_dir(tmp_path, v11)
    ids, mask, dec = inputs()
    ref = reference_logits(path, ids, mask, dec)
    model = jaxllm.load_model(path, overrides=["model.dtype=float32"])
    assert type(model).__name__ == "EncoderDecoder"
    assert model.cfg.tie_embeddings is (not v11) and model.cfg.scale_head_input is (not v11)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(model(ids, dec, segment_ids_BxS=mask).logits)
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("v11", [False, True], ids=["v1.0", "v1.1"])
def test_export_round_trip(tmp_path, v11):
    path = t5_dir(tmp_path, v11)
    cfg = model_config(path, ["model.dtype=float32"])
    assert cfg.train.objective == "span_corruption"  # what an imported T5 trains with
    model = jaxllm.load_model(path, overrides=["model.dtype=float32"])
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = tmp_path / "exported"
    export_hf(params, cfg, out)
    ours, theirs = load_file(out / "model.safetensors"), load_file(path / "model.safetensors")
    theirs = {k: v for k, v in theirs.items() if not k.endswith("embed_tokens.weight")}
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        np.testing.assert_array_equal(ours[name].numpy(), tensor.numpy(), err_msg=name)
    ids, mask, dec = inputs()
    np.testing.assert_allclose(
        reference_logits(out, ids, mask, dec), reference_logits(path, ids, mask, dec), atol=1e-5
    )


def test_t5_small_preset_has_transformers_parameter_count():
    cfg = config.load(None, ["model=t5_small", "train.objective=span_corruption"]).model
    _, abstract, axes = abstract_model(cfg)
    ours = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))
    assert len(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))) == len(
        jax.tree.leaves(abstract)
    )
    t5 = hf.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8)
    with torch.device("meta"):
        theirs = hf.T5ForConditionalGeneration(t5).num_parameters()
    assert ours == theirs == 60_506_624
