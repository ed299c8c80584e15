"""`jaxllm plan`: ahead-of-time compile reports for meshes larger than the machine."""

import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import cpu_env

from jaxllm import config
from jaxllm.plan import collectives, parse_bytes, plan

REPO = Path(__file__).resolve().parent.parent


def _plan(*overrides, path=None):
    return plan(config.load(path, list(overrides)), jax.devices())


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(config.ConfigError, match="--hbm"):
        parse_bytes("lots")


def test_collectives_parser_on_hlo_text():
    hlo = """
  %all-gather.3 = f32[8,64]{1,0} all-gather(f32[1,64]{1,0} %p), dimensions={0}
  %ar = (f32[16]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), to_apply=%add
  %cp = f32[2,8]{1,0} collective-permute-start(%x), source_target_pairs={{0,1}}
  %dot = f32[8,8]{1,0} dot(%a, %b)
"""
    out = collectives(hlo)
    assert out["all-gather"] == {"count": 1, "bytes": 8 * 64 * 4}
    assert out["all-reduce"] == {"count": 1, "bytes": 16 * 4 + 16 * 2}
    assert out["collective-permute"]["count"] == 1
    assert "dot" not in out


def test_fsdp_plan_shards_parameters_and_gathers_them():
    r = _plan("mesh=fsdp", "train.global_batch_size=8")
    assert r["mesh"]["fsdp"] == 8
    rows = {row["name"]: row for row in r["param_rows"]}
    gate = rows["layers/mlp/gate_proj"]
    assert tuple(gate["spec"]) == (None, "fsdp", "tensor")
    assert gate["bytes_per_device"] == 4 * 256 * 640 * 4 // 8
    assert r["collectives"]["all-gather"]["count"] > 0  # parameters gathered for compute
    bill = r["bill"]  # AdamW: two float32 moments per parameter, all split 8 ways
    assert bill["parameters"] == bill["gradients"] == pytest.approx(4 * r["params"] / 8, rel=0.01)
    assert bill["optimizer_state"] == pytest.approx(2 * bill["parameters"], rel=1e-3)
    assert bill["opt_bytes_per_param"] == pytest.approx(8.0, rel=1e-3)


def test_plan_reports_kv_cache_bytes_per_token():
    r = _plan("mesh.data=2", "mesh.tensor=2", "mesh.fsdp=2", "generate.kv_cache_dtype=int8")
    kv = r["kv_cache"]
    m = config.ModelConfig()
    assert kv["per_token"]["bfloat16"] == m.num_layers * m.num_kv_heads * m.resolved_head_dim * 4
    assert kv["per_token"]["int8"] <= 0.55 * kv["per_token"]["bfloat16"]
    assert kv["per_token"]["int4"] <= 0.32 * kv["per_token"]["bfloat16"]
    assert kv["per_token"]["int2"] <= 0.19 * kv["per_token"]["bfloat16"]
    tokens = config.TrainConfig().global_batch_size * m.max_seq_len
    assert kv["bytes_per_device"] == kv["per_token"]["int8"] * tokens / 8


def test_plan_reports_a_hybrid_models_kv_cache_and_fixed_linear_state():
    """3:1 linear / full: the KV cache holds the one full layer; the linear layers' state is
    float32 [H, K, V] plus bf16 conv tails per sequence, split over data x fsdp x tensor."""
    r = _plan(
        *("mesh.data=2", "mesh.tensor=2", "mesh.fsdp=2"),
        "model.layer_pattern=[linear, linear, linear, full]",
        "model.linear_attention.kind=gated_deltanet",
    )
    kv, m = r["kv_cache"], config.ModelConfig()
    la = config.LinearAttentionConfig()
    assert kv["per_token"]["bfloat16"] == 1 * m.num_kv_heads * m.resolved_head_dim * 4
    qk, vd = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
    per_seq = 4 * la.num_v_heads * la.k_head_dim * la.v_head_dim + 2 * 3 * (2 * qk + vd)
    batch = config.TrainConfig().global_batch_size
    assert kv["linear_state"] == 3 * batch * per_seq
    assert kv["linear_state_per_device"] == kv["linear_state"] / 8


def test_plan_reports_the_latent_cache_of_an_mla_model():
    """[latent ; rope key] per token and layer, no int4 / int2, and not split over tensor (one head)."""
    r = _plan(
        "mesh.data=2",
        "mesh.tensor=2",
        "mesh.fsdp=2",
        "model.num_kv_heads=4",
        "model.mla.kv_lora_rank=32",
        "model.mla.qk_rope_head_dim=16",
    )
    kv = r["kv_cache"]
    m = config.ModelConfig()
    assert kv["per_token"] == {
        "bfloat16": m.num_layers * 48 * 2,
        "float32": m.num_layers * 48 * 4,
        "int8": m.num_layers * (48 + 2),
    }
    tokens = config.TrainConfig().global_batch_size * m.max_seq_len
    assert kv["bytes_per_device"] == kv["per_token"]["float32"] * tokens / 4  # the default cache


@pytest.mark.slow  # ~30 s; ring attention's numerics: test_sharding's ring layout
def test_ring_attention_passes_kv_around_the_ring():
    r = _plan("mesh.data=1", "mesh.fsdp=4", "mesh.sequence=2", "mesh.sequence_attention=ring")
    assert r["collectives"]["collective-permute"]["count"] > 0
    gathered = _plan("mesh.data=1", "mesh.fsdp=4", "mesh.sequence=2")
    assert "collective-permute" not in gathered["collectives"]


@pytest.mark.slow  # ~25 s: an 8B plan compile
def test_full_remat_plans_far_fewer_temporaries_for_llama3_8b():
    path = REPO / "configs/runs/llama3_8b.yaml"
    full = _plan("mesh=fsdp", "model.remat=full", path=path)
    none = _plan("mesh=fsdp", "model.remat=none", path=path)
    assert full["params"] == 8_030_261_248
    assert full["memory"]["temporaries"] * 4 < none["memory"]["temporaries"]
    # ZeRO-3: params + two Adam moments, float32, split 8 ways (plus the small batch)
    state_bytes = 3 * 4 * 8_030_261_248 / 8
    assert state_bytes <= full["memory"]["arguments"] <= state_bytes * 1.01


def _cli(*args):
    env = cpu_env()
    return subprocess.run(
        [sys.executable, "-m", "jaxllm", "plan", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_simulates_devices_and_gives_a_verdict():
    ok = _cli("mesh=fsdp", "--devices", "8", "--hbm", "80GiB")
    assert ok.returncode == 0, ok.stderr
    assert "fsdp=8" in ok.stdout and "(8 x cpu)" in ok.stdout
    assert "temporaries" in ok.stdout and "verdict: FITS" in ok.stdout
    too_small = _cli("mesh=fsdp", "--devices", "8", "--hbm", "1MiB")
    assert too_small.returncode == 1
    assert "DOES NOT FIT" in too_small.stdout


def test_cli_plan_config_error_exits_2():
    bad = _cli("mesh.fsdp=3", "mesh.data=1", "--devices", "8")
    assert bad.returncode == 2
    assert "mesh" in bad.stderr and "Traceback" not in bad.stderr
