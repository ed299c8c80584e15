"""Hugging Face conversion of Qwen3-Next (`qwen3_next`): an odd-shaped tiny hybrid (three
Gated DeltaNet blocks then one gated attention block, odd head counts, partial RoPE, MoE with
a gated shared expert) matches transformers' logits (its torch fallback of the chunked delta
rule), the round trip gives the same bytes, both expert layouts import, and a config.json
the model cannot take is refused in one line."""

import json

import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import hf_logits, run_cli, sample_tokens, save_hf, stderr_of_failure
from safetensors.numpy import load_file

import jaxllm
from jaxllm.config import GenerateConfig
from jaxllm.infer import generate, greedy_continue

TINY = dict(
    vocab_size=320,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=1,
    linear_num_value_heads=3,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    partial_rotary_factor=0.25,
)


def qwen3_next(seed=0, **changes):
    torch.manual_seed(seed)
    cfg = hf.Qwen3NextConfig(**{**TINY, **changes}, attn_implementation="eager")
    model = hf.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # perturb everything: zero-offset norms would hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3_next")
    model = qwen3_next()
    src = save_hf(model, tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return model, src, tmp


def test_logits_match_transformers_and_round_trip_is_byte_identical(imported, tmp_path):
    model, src, tmp = imported
    tokens = sample_tokens()
    want = hf_logits(model, tokens)
    ours = jaxllm.load_model(tmp / "run")
    assert ours.cfg.layer_pattern == ("linear", "linear", "linear", "full")
    np.testing.assert_allclose(np.asarray(ours(tokens).logits), want, atol=1e-4, rtol=1e-4)

    assert run_cli("convert", "export", tmp / "run", tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name
    back = hf.Qwen3NextForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(hf_logits(back, tokens), want, atol=1e-4, rtol=1e-4)


def test_imported_model_generates_through_its_recurrent_state(imported):
    _, _, tmp = imported
    model = jaxllm.load_model(tmp / "run")
    prompt = [7, 3, 99, 41, 5, 18, 260]
    gen = GenerateConfig(max_new_tokens=5, temperature=0.0, kv_cache_dtype="float32")
    assert generate(model, [prompt], gen).tokens[0] == greedy_continue(model, prompt, 5).tolist()


def test_fused_experts_and_a_dense_hybrid_import(tmp_path):
    """transformers 5's in-memory (fused) expert layout, and a Qwen3-Next without experts."""
    tokens = sample_tokens(1)
    for name, model, kw in (
        ("fused", qwen3_next(1), dict(save_original_format=False)),
        (
            "dense",
            qwen3_next(2, num_experts=0, layer_types=["linear_attention", "full_attention"] * 2),
            {},
        ),
    ):
        model.save_pretrained(tmp_path / name, **kw)
        assert (
            run_cli(
                "convert",
                "import",
                tmp_path / name,
                tmp_path / f"{name}-run",
                "model.dtype=float32",
            )
            == 0
        )
        got = jaxllm.load_model(tmp_path / f"{name}-run")(tokens).logits
        np.testing.assert_allclose(np.asarray(got), hf_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_unknown_layer_type_is_refused_in_one_line(imported, tmp_path, capsys):
    _, src, _ = imported
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["layer_types"][1] = "sliding_attention"
    (bad / "config.json").write_text(json.dumps(cfg))
    err = stderr_of_failure(capsys, "convert", "import", bad, tmp_path / "run")
    assert "layer_types entry 'sliding_attention'" in err and err.count("\n") == 1


def test_preset_is_the_released_config_and_counts_its_parameters():
    """configs/models/qwen3_next_80b_a3b.yaml is what the released config.json imports as, and
    its parameter count is transformers' (79,674,391,296, built on the meta device)."""
    from hf_models import REPO

    from jaxllm import config
    from jaxllm.convert import families
    from jaxllm.metrics import param_counts

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    released = hf.Qwen3NextConfig(
        intermediate_size=5120, max_position_embeddings=262144, rope_parameters=rope
    )
    imported = config.from_dict({"model": families.model_fields(released.to_dict())}).model
    preset = config.load(REPO / "configs/models/qwen3_next_80b_a3b.yaml").model
    assert families._differences(preset, imported) == []
    with torch.device("meta"):
        n = sum(p.numel() for p in hf.Qwen3NextForCausalLM(released).parameters())
    assert param_counts(preset)["total"] == n == 79_674_391_296
