"""`peft.modules_to_save` (PEFT's modules_to_save): whole weights that train beside the LoRA
adapters, are stored with them, and travel through PEFT import / export under PEFT's names."""

import json
import shutil

import jax
import numpy as np
import optax
import peft
import pytest
import torch
from conftest import tiny_model
from flax import nnx
from hf_models import hf_logits, hf_model, run_cli, sample_tokens, save_hf, stderr_of_failure
from safetensors.numpy import load_file
from test_peft_hf import TRAIN

import jaxllm
from jaxllm import config, sharding
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.load import restore
from jaxllm.model import build, lora, split_peft
from jaxllm.train.state import init_state_from


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory):
    """(base HF dir, a PEFT adapter dir, the PeftModel): LoRA on q_proj and v_proj of a Llama 2
    (untied head) with modules_to_save=[lm_head, embed_tokens], the saved copies moved off the
    base."""
    tmp = tmp_path_factory.mktemp("saved")
    model = hf_model("llama2", seed=1)
    src = save_hf(model, tmp / "hf")
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head", "embed_tokens"],
        task_type="CAUSAL_LM",
    )
    theirs = peft.get_peft_model(model, cfg).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp / "adapter")
    return src, tmp / "adapter", theirs


@pytest.mark.torch
def test_import_gives_peft_logits_and_exports_the_same_tensors(saved_adapter, tmp_path):
    src, adapter, theirs = saved_adapter
    run = tmp_path / "run"
    assert run_cli("convert", "import", src, run, "--peft", adapter, "model.dtype=float32") == 0
    assert config.load(run / "config.yaml").peft.modules_to_save == ("embed_tokens", "lm_head")
    tokens = sample_tokens()
    ours = np.asarray(jaxllm.load_model(run)(tokens).logits)
    np.testing.assert_allclose(ours, hf_logits(theirs, tokens), atol=1e-5, rtol=1e-5)
    assert run_cli("convert", "export", run, tmp_path / "back", "--peft") == 0
    original = load_file(str(adapter / "adapter_model.safetensors"))
    back = load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert "base_model.model.lm_head.weight" in back
    assert "base_model.model.model.embed_tokens.weight" in back
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)
    written = json.loads((tmp_path / "back/adapter_config.json").read_text())
    assert sorted(written["modules_to_save"]) == ["embed_tokens", "lm_head"]
    hf_base = type(theirs.base_model.model).from_pretrained(src, attn_implementation="eager")
    again = peft.PeftModel.from_pretrained(hf_base, tmp_path / "back").eval()
    np.testing.assert_allclose(hf_logits(again, tokens), ours, atol=1e-5, rtol=1e-5)


def _params(run) -> dict:
    model = jaxllm.load_model(run)
    return {
        "/".join(map(str, k)): np.asarray(v)
        for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.torch
def test_training_changes_only_the_adapters_and_the_saved_modules(tmp_path):
    src = save_hf(hf_model("llama3.1"), tmp_path / "hf")
    assert run_cli("convert", "import", src, tmp_path / "base", "model.dtype=float32") == 0
    args = [tmp_path / "base/config.yaml", f"checkpoint.init_from={src}", "peft.method=lora"]
    args += ["peft.targets=[q_proj,v_proj]", "peft.modules_to_save=[embed_tokens,lm_head]"]
    args += [*TRAIN, "optim.lr=1e-2", "checkpoint.every=2"]
    assert run_cli("train", *args, f"run.dir={tmp_path / 'run'}", "train.steps=3") == 0
    before, after = _params(tmp_path / "base"), _params(tmp_path / "run")
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert changed == {"embed/embedding", "lm_head"}, changed
    adapters = {k for k in after if k not in before}
    assert adapters and all("_lora_" in k for k in adapters)
    # the checkpoint holds them with the adapters; the optimizer state covers them
    restored = restore(tmp_path / "run")
    assert set(restored.params) == {"embed", "layers", "lm_head"}
    assert "lm_head" not in restored.frozen and "embed" not in restored.frozen
    # resume from step 2 to 3: the same saved modules
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "run", split)
    shutil.rmtree(split / "checkpoints/3")
    assert run_cli("train", *args, f"run.dir={split}", "train.steps=3") == 0
    resumed = _params(split)
    for k in ("embed/embedding", "lm_head"):
        np.testing.assert_array_equal(resumed[k], after[k])
    # the merged export carries them
    assert run_cli("convert", "export", tmp_path / "run", tmp_path / "merged", "--merge") == 0
    merged = load_file(str(tmp_path / "merged/model.safetensors"))
    np.testing.assert_array_equal(merged["model.embed_tokens.weight"], after["embed/embedding"])


def test_refusals_are_one_line(capsys):
    for kwargs, message in [
        (dict(method="none", modules_to_save=("lm_head",)), "trains whole modules beside"),
        (dict(method="prompt", modules_to_save=("lm_head",)), "peft.method=prompt has none"),
        (dict(method="lora", modules_to_save=("norm",)), "'norm' is not a module"),
        (dict(method="lora", modules_to_save=("lm_head",), targets=("lm_head",)), "name it once"),
    ]:
        with pytest.raises(ConfigError, match=message):
            PeftConfig(**kwargs).validate()
    tied = config.from_dict({"model": {"tie_embeddings": True}}).model
    with pytest.raises(ConfigError, match="no lm_head .its embeddings are tied"):
        lora.attach(
            build(tied, 0),
            PeftConfig(method="lora", modules_to_save=("lm_head",)),
            jax.random.key(0),
        )
    err = stderr_of_failure(
        capsys, "train", "peft.method=adapter", "peft.modules_to_save=[lm_head]"
    )
    assert err.startswith("jaxllm: ") and err.count("\n") == 1


@pytest.mark.torch
def test_tied_embeddings_round_trip_with_ensure_weight_tying(tmp_path):
    """A tied model (Qwen2): PEFT with ensure_weight_tying feeds the LM head the saved copy of
    the embeddings, as jaxllm's one matrix; import gives its logits, export loads back."""
    model = hf_model("qwen2", seed=1)
    src = save_hf(model, tmp_path / "hf")
    cfg = peft.LoraConfig(
        r=4,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens"],
        ensure_weight_tying=True,
        task_type="CAUSAL_LM",
    )
    theirs = peft.get_peft_model(model, cfg).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name or "embed_tokens.modules_to_save" in name:
                p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "adapter")
    run = tmp_path / "run"
    assert run_cli("convert", "import", src, run, "--peft", tmp_path / "adapter") == 0
    tokens = sample_tokens()
    ours = np.asarray(jaxllm.load_model(run, overrides=["model.dtype=float32"])(tokens).logits)
    np.testing.assert_allclose(ours, hf_logits(theirs, tokens), atol=1e-4, rtol=1e-4)
    assert run_cli("convert", "export", run, tmp_path / "back", "--peft") == 0
    written = json.loads((tmp_path / "back/adapter_config.json").read_text())
    assert written["modules_to_save"] == ["embed_tokens"] and written["ensure_weight_tying"]
    hf_base = type(theirs.base_model.model).from_pretrained(src, attn_implementation="eager")
    again = peft.PeftModel.from_pretrained(hf_base, tmp_path / "back").eval()
    np.testing.assert_allclose(hf_logits(again, tokens), ours, atol=1e-4, rtol=1e-4)


@pytest.mark.torch
def test_a_saved_copy_of_tied_embeddings_without_weight_tying_is_refused(tmp_path, capsys):
    """Without ensure_weight_tying PEFT feeds the LM head the original embeddings while the
    input takes the saved copy: two matrices, which a tied jaxllm model cannot hold."""
    model = hf_model("qwen2", seed=1)
    src = save_hf(model, tmp_path / "hf")
    cfg = peft.LoraConfig(
        r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"], task_type="CAUSAL_LM"
    )
    peft.get_peft_model(model, cfg).save_pretrained(tmp_path / "adapter")
    capsys.readouterr()
    err = stderr_of_failure(
        capsys, "convert", "import", src, tmp_path / "r", "--peft", tmp_path / "adapter"
    )
    assert "without ensure_weight_tying" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_a_reward_models_score_head_trains_from_the_base_beside_the_adapters():
    cfg = tiny_model(head="score")
    saved = PeftConfig(method="lora", modules_to_save=("score",))
    _, params, frozen, _ = split_peft(build(cfg, 0, saved), saved)
    assert "score" in params and "score" not in frozen
    base = split_peft(build(cfg, 1), None)[1]
    mesh = sharding.make_mesh(config.MeshConfig())
    for peft_cfg in (saved, PeftConfig(method="lora")):
        state = init_state_from(base, cfg, optax.adam(1e-3), mesh, seed=0, peft=peft_cfg)
        if peft_cfg.modules_to_save:  # trains, starting from the base's head, with Adam's moments
            np.testing.assert_array_equal(state.params["score"], base["score"])
            assert state.opt_state[0].mu["score"].shape == base["score"].shape
        else:  # frozen in the base
            assert "score" not in state.params and "score" in state.frozen
