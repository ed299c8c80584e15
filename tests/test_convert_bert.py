"""BERT and RoBERTa in and out: a tiny `BertForMaskedLM` / `BertForPreTraining` (with its pooler)
/ `RobertaForMaskedLM` imported gives transformers' MLM logits on padded rows with token types;
exported back, the same tensors byte for byte, and transformers' logits again."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import run_cli
from safetensors.numpy import load_file

import jaxllm
from jaxllm import config
from jaxllm.config import ConfigError
from jaxllm.convert import model_config
from jaxllm.convert.families import FAMILIES, guess_family, hf_config, model_fields
from jaxllm.metrics import param_counts
from jaxllm.model import abstract_model

VOCAB, LEN, PAD_AT = 320, 12, 8  # row 1 is padding from PAD_AT on
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=40,
    attn_implementation="eager",
)
MODELS = {
    "bert": (hf.BertConfig, hf.BertForMaskedLM, {}),
    "bert-pretraining": (hf.BertForPreTraining.config_class, hf.BertForPreTraining, {}),
    "roberta": (
        hf.RobertaConfig,
        hf.RobertaForMaskedLM,
        dict(type_vocab_size=1, pad_token_id=1, max_position_embeddings=42),
    ),
}


def _hf_model(name: str):
    cls_cfg, cls_model, extra = MODELS[name]
    torch.manual_seed(0)
    model = cls_model(cls_cfg(**{**SHAPE, **extra})).eval()
    with torch.no_grad():  # perturb everything: zero biases / unit norms would hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _inputs(name: str):
    """(ids, attention mask, token types): row 1 padded with the pad id, no pad id elsewhere
    (RoBERTa numbers positions by counting non-pad ids)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(3, VOCAB, (2, LEN))
    mask = np.ones((2, LEN), np.int64)
    mask[1, PAD_AT:] = 0
    ids[1, PAD_AT:] = 1 if name == "roberta" else 0
    types = np.zeros((2, LEN), np.int64)
    if name != "roberta":
        types[0, LEN // 2 :] = 1  # sentence B
    return ids, mask, types


def _hf_outputs(model, ids, mask, types):
    """(MLM logits, pooled output or None)."""
    args = {k: torch.tensor(v) for k, v in (("input_ids", ids), ("attention_mask", mask))}
    args["token_type_ids"] = torch.tensor(types)
    with torch.no_grad():
        out = model(**args)
        logits = getattr(out, "prediction_logits", None)
        logits = out.logits if logits is None else logits
        pooled = None
        if isinstance(model, hf.BertForPreTraining):
            pooled = model.bert(**args).pooler_output.numpy()
    return logits.numpy(), pooled


def _ours(model, ids, mask, types):
    out = model(ids, segment_ids_BxL=mask.astype(np.int32), token_types_BxL=types)
    return np.asarray(out.logits), out.pooled


@pytest.mark.torch
@pytest.mark.parametrize("name", list(MODELS))
def test_mlm_logits_match_transformers_and_export_round_trips(name, tmp_path):
    model = _hf_model(name)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    ids, mask, types = _inputs(name)
    want, want_pooled = _hf_outputs(model, ids, mask, types)
    real = mask.astype(bool)  # padding outputs differ (ours see only padding): not compared

    ours = jaxllm.load_model(src, overrides=["model.dtype=float32"])
    got, pooled = _ours(ours, ids, mask, types)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    assert (pooled is None) == (want_pooled is None)
    if pooled is not None:
        np.testing.assert_allclose(pooled, want_pooled, atol=1e-5)

    assert run_cli("convert", "import", src, tmp_path / "run", "model.dtype=float32") == 0
    assert run_cli("convert", "export", tmp_path / "run", tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    nsp = {n for n in original if n.startswith("cls.seq_relationship.")}  # not our model's
    assert sorted(set(original) - nsp) == sorted(exported)
    for name_, t in exported.items():
        assert t.dtype == original[name_].dtype and t.tobytes() == original[name_].tobytes()
    # the MLM class loads the export (a pooler, if any, is an unused tensor to it)
    mlm_cls = hf.RobertaForMaskedLM if name == "roberta" else hf.BertForMaskedLM
    back = mlm_cls.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    again, _ = _hf_outputs(back, ids, mask, types)
    np.testing.assert_allclose(again[real], want[real], atol=1e-5)


@pytest.mark.torch
def test_imported_configs_and_refusals(tmp_path):
    bert = _hf_model("bert")
    bert.save_pretrained(tmp_path / "bert")
    cfg = model_config(tmp_path / "bert")
    m = cfg.model
    assert (m.kind, m.norm_placement, m.position, m.mlp_activation) == (
        "encoder",
        "post",
        "learned",
        "gelu",
    )
    assert not m.gelu_approximate and m.norm_eps == 1e-12 and cfg.train.objective == "mlm"
    assert not m.encoder.pooler and m.encoder.type_vocab_size == 2
    assert param_counts(m)["total"] == sum(p.numel() for p in bert.parameters())
    roberta = model_config(_saved("roberta", tmp_path)).model
    assert roberta.encoder.position_offset == 2 and roberta.max_seq_len == 42
    with pytest.raises(ConfigError, match="cannot be expressed in a bert checkpoint"):
        hf_config(dataclasses.replace(m, num_kv_heads=2), FAMILIES["bert"])
    assert guess_family(roberta).name == "roberta" and guess_family(m).name == "bert"


def _saved(name, tmp_path):
    _hf_model(name).save_pretrained(tmp_path / name)
    return tmp_path / name


@pytest.mark.torch
def test_bert_base_preset_counts_what_transformers_counts():
    """configs/models/bert_base.yaml: 109,514,298 parameters, transformers' BertForMaskedLM of
    BertConfig() (bert-base) on the meta device, the model itself, and the imported config."""
    cfg = config.load(None, ["model=bert_base", "train.objective=mlm"]).model
    with torch.device("meta"):
        want = sum(p.numel() for p in hf.BertForMaskedLM(hf.BertConfig()).parameters())
    _, abstract, _ = abstract_model(cfg)
    assert param_counts(cfg)["total"] == want == sum(x.size for x in jax.tree.leaves(abstract))
    assert want == 109_514_298
    hf_cfg = {**hf.BertConfig().to_dict(), "architectures": ["BertForMaskedLM"]}
    imported = config.from_dict({"model": model_fields(hf_cfg)}).model
    assert dataclasses.replace(imported, dtype=cfg.dtype, param_dtype=cfg.param_dtype) == cfg
