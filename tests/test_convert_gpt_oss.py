"""Hugging Face conversion of gpt-oss (`GptOssForCausalLM`): an odd-shaped tiny model built by
transformers in float32 (hidden 48, 3 layers alternating sliding window 4 / full, 6 heads over
2 kv heads of 16, 5 experts top-2, YaRN without truncation, sinks, biases everywhere) gives the
same logits imported, exports back byte for byte, generates like transformers (and through the
engine's pages), fine-tunes with LoRA through the CLI; the released files' MXFP4 experts keep
their codes and export the same bytes; unknown layer types are refused."""

import json
import os

import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import hf_logits, run_cli, save_hf, stderr_of_failure
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import jaxllm
from jaxllm.config import GenerateConfig
from jaxllm.convert.reader import Reader
from jaxllm.infer import generate
from jaxllm.infer.engine import Engine, SamplingParams

VOCAB, LEN = 320, 11  # the byte tokenizer needs >= 258 ids
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=5,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=64,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 8,
    },
)


def gpt_oss_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = hf.GptOssConfig(**{**TINY, **overrides}, attn_implementation="eager")
    model = hf.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random everything, large enough that sinks and clamps matter
        for name, p in model.named_parameters():
            scale = 1.0 if ("sinks" in name or "experts" in name) else 0.1
            p.copy_(scale * torch.randn_like(p) + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, LEN))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    model = gpt_oss_model()
    src = save_hf(model, tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return model, src, tmp / "run"


def test_import_matches_transformers_and_exports_the_same_bytes(imported, tmp_path):
    model, src, run = imported
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    got = np.asarray(jaxllm.load_model(run)(tokens()).logits)
    np.testing.assert_allclose(got, hf_logits(model, tokens()), atol=1e-4, rtol=1e-4)

    assert run_cli("convert", "export", run, tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name
    back = hf.GptOssForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(back.eval(), tokens()), hf_logits(model, tokens()))


@pytest.mark.slow
def test_generates_like_transformers(imported):
    """Greedy decoding through the KV cache (sinks in the decode attention, windowed layers),
    and through the engine's pages, equals transformers' `generate`."""
    model, _, run = imported
    prompts = [[5, 17, 33, 3], [7, 1, 50, 12, 8, 40, 2]]
    ours = jaxllm.load_model(run)
    tokens = generate(ours, prompts, GenerateConfig(max_new_tokens=6, kv_cache_dtype="float32"))
    engine = Engine(ours, max_num_seqs=2, page_size=4, num_pages=16, chunk_size=8)
    paged = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert [p[0].tokens for p in paged] == tokens.tokens
    for prompt, got in zip(prompts, tokens.tokens):
        with torch.no_grad():
            theirs = model.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )
        assert got == theirs[0, len(prompt) :].tolist()


@pytest.mark.slow  # ~30 s: two CLI processes' compiles (train, generate)
def test_imported_model_fine_tunes_with_lora_and_generates(imported, tmp_path, capsys):
    """A few LoRA steps through `jaxllm train` from the imported weights (sinks, biases and the
    clamped experts in the backward), then `jaxllm generate` from the adapted run."""
    _, _, run = imported
    ft = tmp_path / "ft"
    overrides = [
        run / "config.yaml",
        f"run.dir={ft}",
        f"checkpoint.init_from={run}",
        "peft.method=lora",
        "peft.targets=[q_proj,v_proj,o_proj]",
        "train.steps=3",
        "train.global_batch_size=8",
        "data.seq_len=16",
        "data.max_files=20",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
    ]
    assert run_cli("train", *overrides) == 0
    adapted = jaxllm.load_model(ft)
    attn = adapted.moe_layers.moe.attn
    assert np.abs(np.asarray(attn.q_proj_lora_b[...])).max() > 0  # the adapters moved
    logits = np.asarray(adapted(tokens()).logits)
    assert np.isfinite(logits).all()
    capsys.readouterr()
    assert run_cli("generate", ft, "--prompt", "def", "--max-new-tokens", "4") == 0
    assert capsys.readouterr().out.strip()


def test_mxfp4_experts_read_decoded_as_transformers_decodes_them(imported, tmp_path):
    """The released files' MXFP4 experts (`*_blocks` / `*_scales`, quant_method mxfp4) read as
    transformers' `convert_moe_packed_tensors` decodes them, exactly (the float import of the
    test above then holds); the other tensors are untouched."""
    _, src, _ = imported
    rng = np.random.default_rng(3)
    tensors = {"model.norm.weight": np.ones(48, np.float32)}
    for name, out, n_in in (("gate_up_proj", 80, 64), ("down_proj", 48, 32)):
        prefix = f"model.layers.0.mlp.experts.{name}"
        tensors[prefix + "_blocks"] = rng.integers(0, 256, (5, out, n_in // 32, 16), np.uint8)
        tensors[prefix + "_scales"] = rng.integers(120, 131, (5, out, n_in // 32), np.uint8)
    (tmp_path / "mx").mkdir()
    save_file(tensors, str(tmp_path / "mx" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(cfg))

    reader = Reader(tmp_path / "mx")
    assert sorted(reader.shapes) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.norm.weight",
    ]
    for name in ("gate_up_proj", "down_proj"):
        prefix = f"model.layers.0.mlp.experts.{name}"
        want = convert_moe_packed_tensors(
            torch.from_numpy(tensors[prefix + "_blocks"]),
            torch.from_numpy(tensors[prefix + "_scales"]),
            dtype=torch.float32,
        ).numpy()
        got = reader.read(prefix)
        assert reader.shapes[prefix] == want.shape and got.tobytes() == want.tobytes()


def test_mxfp4_checkpoint_keeps_its_codes_and_exports_the_same_bytes(tmp_path):
    """A released-style checkpoint (MXFP4 experts, quant_method mxfp4; input widths 64 and 32)
    imports as a quantize.method=mxfp4 run holding the experts' very codes, with the logits of
    the float model holding transformers' decoding of them, and exports `*_blocks` / `*_scales`
    byte for byte, which transformers loads with the same logits; `--dequantize` gives the
    float run with the same logits."""
    model = gpt_oss_model(seed=2, hidden_size=64, intermediate_size=32, num_hidden_layers=2)
    rng = np.random.default_rng(4)
    mx = {}
    for i in range(2):
        for name, out, n_in in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            blocks = rng.integers(0, 256, (5, out, n_in // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 130, (5, out, n_in // 32), dtype=np.uint8)
            mx[f"model.layers.{i}.mlp.experts.{name}"] = blocks, scales
            w = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            )
            with torch.no_grad():
                getattr(model.model.layers[i].mlp.experts, name).copy_(w)
    src = save_hf(model, tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    for prefix, (blocks, scales) in mx.items():
        del tensors[prefix]
        tensors[prefix + "_blocks"], tensors[prefix + "_scales"] = blocks, scales
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (src / "config.json").write_text(json.dumps(cfg))
    want = hf_logits(model, tokens())

    assert run_cli("convert", "import", src, tmp_path / "run", "model.dtype=float32") == 0
    run = jaxllm.load_model(tmp_path / "run")
    assert type(run.moe_layers.moe.mlp.gate_proj.get_value()).__name__ == "CodedTensor"
    np.testing.assert_allclose(np.asarray(run(tokens()).logits), want, atol=1e-4, rtol=1e-4)
    assert run_cli("convert", "export", tmp_path / "run", tmp_path / "out") == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(tensors)
    for name, t in tensors.items():
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["quantization_config"]["quant_method"] == "mxfp4"
    loaded = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():  # transformers decodes the exported codes (to bf16 on CPU: exact)
        back = loaded(torch.from_numpy(np.asarray(tokens()))).logits.float().numpy()
    np.testing.assert_allclose(back, want, atol=1e-4, rtol=1e-4)

    args = ("convert", "import", src, tmp_path / "float", "model.dtype=float32", "--dequantize")
    assert run_cli(*args) == 0
    got = np.asarray(jaxllm.load_model(tmp_path / "float")(tokens()).logits)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_unknown_layer_type_is_refused(tmp_path, capsys):
    src = save_hf(gpt_oss_model(), tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["layer_types"][1] = "chunked_attention"
    (src / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # the save's progress bars
    err = stderr_of_failure(capsys, "convert", "import", src, tmp_path / "run")
    assert err.startswith("jaxllm: ") and "chunked_attention" in err
    assert len(err.strip().splitlines()) == 1


@pytest.fixture(autouse=True)
def _quiet_torch():
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
