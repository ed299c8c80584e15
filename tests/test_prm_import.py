"""A process reward model's `*ForTokenClassification` in (`jaxllm convert import`): a PRM run
(train.objective=prm, the score head) whose step scores are transformers' logit difference of
the two labels, on a file whose label-0 row is not zero too, and with transformers' default
score bias (b1 - b0); export -> import -> export gives the same tensors; what the score head
cannot hold is one line and exit 2."""

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_models import run_cli, stderr_of_failure
from safetensors.numpy import load_file, save_file
from test_prm import prm_args, trained_prm

import jaxllm
from jaxllm import config
from jaxllm.data.stepwise import encode_solution
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.model import build

SOLUTIONS = (("q1:", ["s3 ok", "s7 no"]), ("q4:", ["s1 no", "s2 ok", "s9 ok"]))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the session's trained PRM run, its export)"""
    run, hf = trained_prm(), tmp_path_factory.mktemp("prm_import") / "hf"
    assert run_cli("convert", "export", run, hf) == 0
    return run, hf


def _tensors(directory) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_an_exported_prm_imports_as_a_prm_run_and_exports_the_same_tensors(exported, tmp_path):
    run, hf = exported
    back, again = tmp_path / "back", tmp_path / "again"
    assert run_cli("convert", "import", hf, back) == 0
    cfg = config.load(back / "config.yaml")
    assert (cfg.train.objective, cfg.model.head) == ("prm", "score")
    assert [s.format for s in cfg.data.sources] == ["stepwise"]
    np.testing.assert_array_equal(
        np.asarray(jaxllm.load_model(back).score[...]),
        np.asarray(jaxllm.load_model(run).score[...]),
    )
    assert run_cli("convert", "export", back, again) == 0
    want, got = _tensors(hf), _tensors(again)
    assert sorted(got) == sorted(want) and "score.weight" in got
    for name, w in want.items():
        assert got[name].dtype == w.dtype, name
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    assert json.loads((again / "config.json").read_text())["architectures"] == [
        "LlamaForTokenClassification"
    ]


def test_step_scores_are_the_logit_difference_of_the_two_labels(exported, tmp_path):
    """A token classifier whose label-0 row is not zero (as one trained with two free labels):
    the imported score is logits[1] - logits[0], so sigmoid(score) = softmax(logits)[1]."""
    run, hf = exported
    other, back = tmp_path / "hf", tmp_path / "back"
    shutil.copytree(hf, other)
    (path,) = [f for f in other.glob("*.safetensors") if "score.weight" in load_file(f)]
    tensors = load_file(path)
    w = tensors["score.weight"]
    rng = np.random.default_rng(0)
    tensors["score.weight"] = np.stack([rng.normal(0, 0.5, w.shape[1]), w[1]]).astype(w.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    assert run_cli("convert", "import", other, back) == 0
    ref = transformers.AutoModelForTokenClassification.from_pretrained(
        other, torch_dtype=torch.float32
    ).eval()
    cfg = config.load(back / "config.yaml")
    tok, model = make_tokenizer(cfg.data), jaxllm.load_model(back)
    for prompt, steps in SOLUTIONS:
        ids, labels = encode_solution(tok, prompt, steps, None, cfg.data.add_bos)
        ours = np.asarray(model(jnp.asarray(ids)[None]).logits[0, :, 0])
        with torch.no_grad():
            logits = ref(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].numpy()
        at = labels >= 0  # the step separators
        assert at.sum() == len(steps)
        assert np.abs(logits[at, 0]).max() > 0.01  # the label-0 logits are not zero here
        np.testing.assert_allclose(ours[at], logits[at, 1] - logits[at, 0], atol=1e-5, rtol=0)
        probs = torch.softmax(torch.as_tensor(logits), -1)[:, 1].numpy()
        np.testing.assert_allclose(probs[at], 1 / (1 + np.exp(-ours[at])), atol=1e-6)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"token_classification_bias": True}, "score.bias"),  # said, but not in the file
        ({"id2label": {"0": "A", "1": "B", "2": "C"}}, "with 3 labels"),
        ({"model_type": "gemma2"}, "not gemma2"),
    ],
)
def test_a_token_classifier_the_score_head_cannot_hold_is_refused(
    exported, tmp_path, capsys, change, words
):
    _, hf = exported
    other = tmp_path / "hf"
    shutil.copytree(hf, other)
    written = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**written, **change}))
    err = stderr_of_failure(capsys, "convert", "import", other, tmp_path / "out")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()


def test_a_token_classifier_with_transformers_default_bias_imports_trains_and_exports(
    exported, tmp_path
):
    """transformers' own `LlamaForTokenClassification` (a bias on `score`, as TRL's PRM
    trainer saves one): imported, its scores are logits[1] - logits[0] with the biases; one
    LoRA step with the score head saved moves the bias; exported, transformers reads it back at the same logits."""
    run, hf = exported
    theirs, back, again = tmp_path / "hf", tmp_path / "back", tmp_path / "again"
    hf_cfg = transformers.AutoConfig.from_pretrained(hf)
    hf_cfg.token_classification_bias = True
    torch.manual_seed(0)
    ref = transformers.AutoModelForTokenClassification.from_config(hf_cfg).eval()
    missing = ref.load_state_dict({k: torch.as_tensor(v) for k, v in _tensors(hf).items()}, False)
    assert missing.missing_keys == ["score.bias"]
    with torch.no_grad():
        ref.score.bias.copy_(torch.tensor([0.7, -0.4]))
    ref.save_pretrained(theirs)
    for f in hf.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, theirs / f.name)
    assert run_cli("convert", "import", theirs, back) == 0
    cfg = config.load(back / "config.yaml")
    assert cfg.model.score_bias
    model = jaxllm.load_model(back)
    np.testing.assert_allclose(np.asarray(model.score_bias[...]), [-1.1], rtol=1e-6)
    tok = make_tokenizer(cfg.data)
    prompt, steps = SOLUTIONS[1]
    ids, labels = encode_solution(tok, prompt, steps, None, cfg.data.add_bos)
    with torch.no_grad():
        logits = ref(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    ours = np.asarray(model(jnp.asarray(ids)[None]).logits[0, :, 0])
    np.testing.assert_allclose(ours, logits[:, 1] - logits[:, 0], atol=1e-5, rtol=0)
    tuned = tmp_path / "tuned"
    data = prm_args(tmp_path, tuned)
    more = ["train.steps=1", "checkpoint.save_final=true", "optim.lr=1e-2", "optim.warmup_steps=0"]
    more += ["peft.method=lora", "peft.modules_to_save=[score]"]  # the bias trains with score
    assert (
        run_cli("train", *data, f"checkpoint.init_from={back}", "model.score_bias=true", *more) == 0
    )
    assert float(jaxllm.load_model(tuned).score_bias[0]) != pytest.approx(-1.1, abs=1e-6)
    assert run_cli("convert", "export", back, again) == 0
    assert json.loads((again / "config.json").read_text())["token_classification_bias"] is True
    reread = transformers.AutoModelForTokenClassification.from_pretrained(again).eval()
    with torch.no_grad():
        got = reread(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(got[:, 1] - got[:, 0], ours, atol=1e-5, rtol=0)


def test_a_score_bias_needs_a_head_that_holds_it(exported, tmp_path):
    """On an LM it is refused; a reward model with one cannot export, since transformers'
    `*ForSequenceClassification` has no bias (it would be dropped)."""
    from flax import nnx

    from jaxllm.config import ConfigError
    from jaxllm.convert.export import export_hf

    with pytest.raises(ConfigError, match="model.score_bias is the score head's bias"):
        config.ModelConfig(score_bias=True).validate()
    run, _ = exported
    cfg = config.load(run / "config.yaml")
    model_cfg = dataclasses.replace(cfg.model, score_bias=True)
    cfg = dataclasses.replace(
        cfg, model=model_cfg, train=dataclasses.replace(cfg.train, objective="reward")
    )
    params = nnx.to_pure_dict(nnx.state(build(model_cfg, 0), nnx.Param))
    with pytest.raises(ConfigError, match="has no bias on its score head"):
        export_hf(params, cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
