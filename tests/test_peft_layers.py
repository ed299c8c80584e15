"""`peft.layers_to_transform` (PEFT's layers_to_transform): LoRA on some layers only. The other
layers' factors are zero, where their gradients are zero too: PEFT's adapters import with
PEFT's logits, train with those layers left alone, and export with only their tensors."""

import json

import numpy as np
import peft
import pytest
import torch
from hf_models import hf_logits, hf_model, run_cli, sample_tokens, save_hf
from safetensors.numpy import load_file
from test_peft_hf import TRAIN

import jaxllm
from jaxllm import config
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.load import restore
from jaxllm.model import build


@pytest.mark.torch
def test_peft_adapter_on_one_layer_imports_trains_and_exports(tmp_path):
    model = hf_model("llama2", seed=1)
    src = save_hf(model, tmp_path / "hf")
    cfg = peft.LoraConfig(
        r=4,
        target_modules=["q_proj", "down_proj"],
        layers_to_transform=[1],
        task_type="CAUSAL_LM",
    )
    theirs = peft.get_peft_model(model, cfg).eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "adapter")
    run = tmp_path / "run"
    assert run_cli("convert", "import", src, run, "--peft", tmp_path / "adapter") == 0
    assert config.load(run / "config.yaml").peft.layers_to_transform == (1,)
    tokens = sample_tokens()
    over = ["model.dtype=float32"]
    ours = np.asarray(jaxllm.load_model(run, overrides=over)(tokens).logits)
    np.testing.assert_allclose(ours, hf_logits(theirs, tokens), atol=1e-5, rtol=1e-5)

    assert run_cli("train", run, *TRAIN, "train.steps=2", "optim.lr=1e-2") == 0
    attn = restore(run).params["layers"]["attn"]
    a, b = np.asarray(attn["q_proj_lora_a"]), np.asarray(attn["q_proj_lora_b"])
    assert not a[0].any() and not b[0].any()  # layer 0: off, and still off after training
    assert a[1].any() and b[1].any()
    assert run_cli("convert", "export", run, tmp_path / "back", "--peft") == 0
    back = load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert sorted(back) == sorted(load_file(str(tmp_path / "adapter/adapter_model.safetensors")))
    written = json.loads((tmp_path / "back/adapter_config.json").read_text())
    assert written["layers_to_transform"] == [1]
    hf_base = type(theirs.base_model.model).from_pretrained(src, attn_implementation="eager")
    again = peft.PeftModel.from_pretrained(hf_base, tmp_path / "back").eval()
    trained = np.asarray(jaxllm.load_model(run, overrides=over)(tokens).logits)
    np.testing.assert_allclose(hf_logits(again, tokens), trained, atol=1e-4, rtol=1e-4)


def test_fresh_factors_and_refusals():
    for kwargs, message in [
        (dict(method="prompt", layers_to_transform=(0,)), "picks LoRA's layers"),
        (dict(method="lora", dora=True, layers_to_transform=(0,)), "set one of them"),
        (dict(method="lora", layers_to_transform=(-1,)), "layer numbers are >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            PeftConfig(**kwargs).validate()
    cfg = config.from_dict({}).model
    fresh = build(cfg, 0, PeftConfig(method="lora", layers_to_transform=(1,)))
    a = np.asarray(fresh.layers.attn.q_proj_lora_a[...])
    assert not a[0].any() and a[1].all()  # a fresh run's A: zero on the layers left out
    with pytest.raises(ConfigError, match="this model has layers 0"):
        build(cfg, 0, PeftConfig(method="lora", layers_to_transform=(cfg.num_layers,)))
    moe = config.from_dict({"model": {"moe": {"num_experts": 4, "first_dense_layers": 1}}})
    with pytest.raises(ConfigError, match="one stack of layers"):
        build(moe.model, 0, PeftConfig(method="lora", layers_to_transform=(0,)))
