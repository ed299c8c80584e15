"""A process reward model's export (`jaxllm convert export`): transformers'
`*ForTokenClassification` with TRL's two labels, whose logits at every token are (0, s), s the
run's score, so softmax(...)[1] at each step separator is the PRM's step probability; a family
without a generic token classifier is refused."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_prm import prm_args, trained_prm

import jaxllm
from jaxllm import cli, config
from jaxllm.config import ConfigError
from jaxllm.convert.export import _token_classifier
from jaxllm.data.stepwise import encode_solution
from jaxllm.data.tokenizer import make_tokenizer


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_a_prm_exports_as_a_token_classifier_with_equal_scores(tmp_path, family):
    hf = tmp_path / "hf"
    if family == "llama":
        run = trained_prm()  # the session's
    else:
        run = tmp_path / "run"
        more = ["train.steps=3", "checkpoint.save_final=true", "optim.lr=1e-2"]
        assert cli.main(["train", *prm_args(tmp_path, run), *more, "model.qkv_bias=true"]) == 0
    assert cli.main(["convert", "export", str(run), str(hf), "--family", family]) == 0
    written = json.loads((hf / "config.json").read_text())
    assert written["architectures"] == [f"{family.capitalize()}ForTokenClassification"]
    ref = transformers.AutoModelForTokenClassification.from_pretrained(
        hf, torch_dtype=torch.float32
    ).eval()
    assert type(ref).__name__ == written["architectures"][0] and ref.num_labels == 2

    cfg = config.load(run / "config.yaml")
    tok = make_tokenizer(cfg.data)
    model = jaxllm.load_model(run)
    for prompt, steps in (("q1:", ["s3 ok", "s7 no"]), ("q4:", ["s1 no", "s2 ok", "s9 ok"])):
        ids, labels = encode_solution(tok, prompt, steps, None, cfg.data.add_bos)
        ours = np.asarray(model(jnp.asarray(ids)[None]).logits[0, :, 0])
        with torch.no_grad():
            logits = ref(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].numpy()
        at = labels >= 0  # the step separators
        assert at.sum() == len(steps)
        np.testing.assert_allclose(logits[at, 1], ours[at], atol=1e-4, rtol=0)
        np.testing.assert_array_equal(logits[:, 0], 0)
        probs = torch.softmax(torch.as_tensor(logits), -1)[:, 1].numpy()
        np.testing.assert_allclose(probs[at], jax.nn.sigmoid(ours[at]), atol=1e-5)


def test_a_family_without_a_generic_token_classifier_is_refused():
    """(A ConfigError from the export is one `jaxllm:` line and exit 2 on the command line.)"""
    hf = {"architectures": ["GPT2ForSequenceClassification"], "model_type": "gpt2"}
    with pytest.raises(ConfigError, match="ForTokenClassification, which jaxllm writes for llama"):
        _token_classifier(hf, "gpt2", False)
    assert _token_classifier(
        {**hf, "architectures": ["LlamaForSequenceClassification"]}, "llama", False
    )["architectures"] == ["LlamaForTokenClassification"]
