"""LoRA adapters in and out of Hugging Face PEFT: `jaxllm convert export --peft` loads in
`peft.PeftModel.from_pretrained` with jaxllm's logits, `--merge` loads in transformers alone
with the same logits, `jaxllm convert import HF_DIR OUT_DIR --peft ADAPTER_DIR` gives PEFT's
logits and trains on from the imported adapters; what has no PEFT layout is refused in one
line."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import peft
import pytest
import torch
import transformers as hf
from conftest import tiny_model
from flax import nnx
from hf_models import hf_logits, hf_model, run_cli, sample_tokens, save_hf, stderr_of_failure
from safetensors.numpy import load_file, save_file

import jaxllm
from jaxllm import config, sharding
from jaxllm.adapters import export_peft
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.convert import hf as convert_hf
from jaxllm.infer import generate
from jaxllm.model import abstract_model, merge_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAIN = [
    "train.global_batch_size=8",
    "data.seq_len=32",
    "data.max_files=20",
    "train.eval_batches=1",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "optim.warmup_steps=0",
]


def _logits(run, tokens) -> np.ndarray:
    return np.asarray(jaxllm.load_model(run)(tokens).logits)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(base HF dir, its imported run, a LoRA run on it trained 2 steps at a high lr so that
    every B is far from zero): a Llama 3.1 with grouped KV heads, adapters on every
    projection and on the untied head."""
    tmp = tmp_path_factory.mktemp("lora")
    src = save_hf(hf_model("llama3.1"), tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "base", "model.dtype=float32") == 0
    targets = ",".join([*TARGETS, "lm_head"])
    args = [tmp / "base/config.yaml", f"run.dir={tmp / 'lora'}", f"checkpoint.init_from={src}"]
    args += ["peft.method=lora", "peft.rank=4", "peft.alpha=12", f"peft.targets=[{targets}]"]
    assert run_cli("train", *args, *TRAIN, "train.steps=2", "optim.lr=2e-2") == 0
    return src, tmp / "base", tmp / "lora"


@pytest.mark.torch
def test_export_peft_loads_in_peft_with_the_same_logits(lora_run, tmp_path, capsys):
    src, base_run, run = lora_run
    tokens = sample_tokens()
    ours = _logits(run, tokens)
    assert np.abs(ours - _logits(base_run, tokens)).max() > 1e-2  # the adapters act
    capsys.readouterr()
    assert run_cli("convert", "export", run, tmp_path / "ad", "--peft") == 0
    report = capsys.readouterr().out
    assert "self_attn.q_proj.lora_A.weight x2 layers -> layers/attn/q_proj_lora_a" in report

    written = json.loads((tmp_path / "ad/adapter_config.json").read_text())
    assert {k: written[k] for k in ("peft_type", "task_type", "r", "lora_alpha")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 12,
    }
    assert written["target_modules"] == sorted([*TARGETS, "lm_head"])
    assert written["base_model_name_or_path"] == str(src.resolve())
    tensors = load_file(str(tmp_path / "ad/adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1."
    assert tensors[prefix + "self_attn.k_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[prefix + "self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 KV heads
    assert tensors[prefix + "mlp.down_proj.lora_A.weight"].shape == (4, 128)
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (320, 4)
    assert len(tensors) == 2 * (7 * 2 + 1)

    hf_base = hf.AutoModelForCausalLM.from_pretrained(
        written["base_model_name_or_path"], attn_implementation="eager"
    )
    theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "ad").eval()
    np.testing.assert_allclose(hf_logits(theirs, tokens), ours, atol=1e-4, rtol=1e-4)


@pytest.mark.torch
def test_export_merge_loads_in_transformers_with_the_same_logits(lora_run, tmp_path):
    _, _, run = lora_run
    tokens = sample_tokens(1)
    assert run_cli("convert", "export", run, tmp_path / "merged", "--merge") == 0
    merged = hf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", attn_implementation="eager"
    )
    np.testing.assert_allclose(hf_logits(merged.eval(), tokens), _logits(run, tokens), atol=1e-4)
    # greedy generation: the adapters unmerged (the run) and merged (the export) agree
    gen = config.GenerateConfig(max_new_tokens=12)
    prompts = [[5, 17, 42], [7, 7, 7, 100, 3]]
    unmerged = generate(jaxllm.load_model(run), prompts, gen).tokens
    assert unmerged == generate(jaxllm.load_model(tmp_path / "merged"), prompts, gen).tokens


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """(base HF dir, a PEFT adapter dir, PeftModel's logits): a rank-stabilised LoRA of rank 4
    on every attention and MLP projection of a Llama 2, with random B."""
    tmp = tmp_path_factory.mktemp("peft")
    model = hf_model("llama2", seed=1)
    src = save_hf(model, tmp / "hf")
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=6,
        use_rslora=True,
        lora_dropout=0.05,
        target_modules=TARGETS,
        task_type="CAUSAL_LM",
    )
    theirs = peft.get_peft_model(model, lora).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp / "adapter")
    return src, tmp / "adapter", hf_logits(theirs, sample_tokens())


@pytest.mark.torch
def test_import_peft_gives_peft_logits(peft_adapter, tmp_path, capsys):
    src, adapter, want = peft_adapter
    run = tmp_path / "run"
    assert run_cli("convert", "import", src, run, "--peft", adapter, "model.dtype=float32") == 0
    assert (
        "mlp.up_proj.lora_B.weight x2 layers -> layers/mlp/up_proj_lora_b"
        in capsys.readouterr().out
    )
    cfg = config.load(run / "config.yaml")
    assert cfg.peft == PeftConfig(
        method="lora", rank=4, alpha=6.0, dropout=0.05, targets=tuple(sorted(TARGETS)), rslora=True
    )
    assert cfg.checkpoint.init_from == str(src.resolve())
    np.testing.assert_allclose(_logits(run, sample_tokens()), want, atol=1e-4, rtol=1e-4)
    # and back out: the same tensors PEFT wrote
    assert run_cli("convert", "export", run, tmp_path / "back", "--peft") == 0
    original = load_file(str(adapter / "adapter_model.safetensors"))
    back = load_file(str(tmp_path / "back/adapter_model.safetensors"))
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)


@pytest.mark.torch
def test_training_an_imported_adapter_starts_from_it(peft_adapter, tmp_path, capsys):
    """`jaxllm train` in the imported directory takes the base from checkpoint.init_from and
    the adapters from the imported checkpoint: at lr 0 the trained run still gives PEFT's
    logits (fresh adapters, B = 0, would give the base's); generate runs on base + adapters."""
    src, adapter, want = peft_adapter
    run = tmp_path / "run"
    assert run_cli("convert", "import", src, run, "--peft", adapter, "model.dtype=float32") == 0
    capsys.readouterr()
    assert run_cli("train", run, *TRAIN, "train.steps=1", "optim.lr=0.0") == 0
    assert "adapters from this run's imported checkpoint" in capsys.readouterr().err
    assert jaxllm.checkpoint.latest_step(run / "checkpoints") == 1
    np.testing.assert_allclose(_logits(run, sample_tokens()), want, atol=1e-4, rtol=1e-4)
    assert run_cli("generate", run, "--prompt", "ab", "--max-new-tokens", "3") == 0


@pytest.mark.torch
def test_refusals_are_one_line(lora_run, peft_adapter, tmp_path, capsys):
    src, base_run, run = lora_run
    err = stderr_of_failure(capsys, "convert", "export", run, tmp_path / "a")
    assert "pass --peft" in err and "--merge" in err and not (tmp_path / "a").exists()
    err = stderr_of_failure(capsys, "convert", "export", base_run, tmp_path / "b", "--peft")
    assert "not a fine-tuning run (peft.method=none)" in err
    err = stderr_of_failure(capsys, "convert", "export", base_run, tmp_path / "b", "--merge")
    assert "export it without --merge" in err

    src, adapter, _ = peft_adapter
    for key, value, message in [
        ("lora_bias", True, "sets lora_bias=True"),
        ("rank_pattern", {"q_proj": 2}, "sets rank_pattern="),
        ("peft_type", "PROMPT_TUNING", "not a LoRA adapter"),
    ]:
        changed = tmp_path / key
        shutil.copytree(adapter, changed)
        written = json.loads((changed / "adapter_config.json").read_text())
        (changed / "adapter_config.json").write_text(json.dumps({**written, key: value}))
        err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "r", "--peft", changed)
        assert message in err and not (tmp_path / "r").exists()
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "r", "--peft", tmp_path)
    assert "has no adapter_config.json" in err
    # a layer PEFT left out: jaxllm adapts every layer
    partial = tmp_path / "partial"
    shutil.copytree(adapter, partial)
    tensors = load_file(str(partial / "adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"]
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "r", "--peft", partial)
    assert "missing tensor base_model.model.model.layers.1.mlp.up_proj.lora_A.weight" in err


@pytest.mark.torch
def test_a_qlora_run_exports_its_adapters_and_merges_its_nf4_base(peft_adapter, tmp_path):
    """QLoRA imports the same adapters (PEFT applies them to the bf16 / 4-bit base); --peft
    gives them back as they were, --merge writes the NF4 base dequantized plus the adapters."""
    src, adapter, want = peft_adapter
    run = tmp_path / "qlora"
    args = ["--peft", adapter, "model.dtype=float32", "peft.method=qlora"]
    assert run_cli("convert", "import", src, run, *args) == 0
    ours = _logits(run, sample_tokens())
    assert 1e-4 < np.abs(ours - want).max() < 0.5  # the 4-bit base is close, not equal
    assert run_cli("convert", "export", run, tmp_path / "ad", "--peft") == 0
    back = load_file(str(tmp_path / "ad/adapter_model.safetensors"))
    for name, t in load_file(str(adapter / "adapter_model.safetensors")).items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)
    assert run_cli("convert", "export", run, tmp_path / "merged", "--merge") == 0
    merged = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged, sample_tokens()), ours, atol=1e-4, rtol=1e-4)


@nnx.jit
def _forward(model, tokens):
    return model(tokens).logits


@pytest.mark.torch
@pytest.mark.parametrize(
    "family, targets, modules",
    [
        ("qwen2", ["all-linear"], sorted(TARGETS)),
        (
            "deepseek_v3-dense",  # MLA: the latent projections, named as DeepSeek names them
            ["q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj"],
            ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"],
        ),
        (  # Conv1D; c_proj is also the MLP's, so the attention's are named in full
            "gpt2",
            ["o_proj", "up_proj"],
            ["c_fc", "transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"],
        ),
    ],
)
def test_export_peft_of_other_families(family, targets, modules, tmp_path):
    model = hf_model(family)
    src = save_hf(model, tmp_path / "hf")
    cfg = convert_hf.model_config(src, ["model.dtype=float32"])
    cfg = dataclasses.replace(cfg, peft=PeftConfig("lora", 4, 8.0, targets=tuple(targets)))
    mesh = sharding.make_mesh(config.MeshConfig(), jax.devices()[:1])
    base, model_state, _ = convert_hf.load_params(src, cfg.model, mesh)
    graphdef, abstract, _ = abstract_model(cfg.model, cfg.peft)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda a: 0.1 * rng.standard_normal(a.shape, np.float32), abstract)
    ours = merge_model(graphdef, adapters, base, model_state)
    export_peft(adapters, cfg, tmp_path / "ad", base={"source": str(src)})
    written = json.loads((tmp_path / "ad/adapter_config.json").read_text())
    assert written["target_modules"] == modules
    theirs = peft.PeftModel.from_pretrained(model, tmp_path / "ad").eval()
    want = hf_logits(theirs, sample_tokens())
    np.testing.assert_allclose(_forward(ours, sample_tokens()), want, atol=1e-4, rtol=1e-4)


def _zeros(cfg: config.Config) -> dict:
    return jax.tree.map(
        lambda a: np.zeros(a.shape, a.dtype), abstract_model(cfg.model, cfg.peft)[1]
    )


def test_routed_experts_have_no_peft_layout(tmp_path):
    """transformers keeps a layer's routed experts in one fused parameter (no Linear for PEFT to
    adapt): their adapters are refused by name, attention adapters of the same model export."""
    cfg = config.load(
        None, ["model=tiny_mixtral", "peft.method=lora", "peft.targets=[q_proj,up_proj]"]
    )
    adapters = _zeros(cfg)
    with pytest.raises(ConfigError, match="adapters of moe_layers/moe/mlp/up_proj have no Hugging"):
        export_peft(adapters, cfg, tmp_path / "a")
    attention = {"moe_layers": {"moe": {"attn": adapters["moe_layers"]["moe"]["attn"]}}}
    export_peft(attention, cfg, tmp_path / "b")
    written = json.loads((tmp_path / "b/adapter_config.json").read_text())
    assert written["target_modules"] == ["q_proj"] and written["base_model_name_or_path"] is None
    # PEFT reads DeepSeek's gate_proj / up_proj / down_proj as its fused experts, dense or not
    mla = config.MLAConfig(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8)
    cfg = config.Config(
        model=tiny_model(num_kv_heads=4, mla=mla), peft=PeftConfig("lora", targets=("up_proj",))
    )
    adapters = _zeros(cfg)
    with pytest.raises(ConfigError, match="adapters of layers/mlp/up_proj have .*DeepSeek.s"):
        export_peft(adapters, cfg, tmp_path / "c")


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
