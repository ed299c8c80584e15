"""The benchmark's FLOP accounting: analytic 6N + attention against XLA's count of the step."""

import dataclasses
import gzip
import json

import jax
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm import config, sharding
from jaxllm.bench import (
    bench_train,
    compiled_step_flops,
    device_op_summary,
    format_result,
    format_summary,
)
from jaxllm.metrics import flops_per_token, param_counts, peak_flops
from jaxllm.model import build


def _cfg(**model) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=258, d_model=64, mlp_dim=192, num_layers=3, **model),
        mesh=config.MeshConfig(data=1),
        data=config.DataConfig(seq_len=64),
        train=config.TrainConfig(global_batch_size=4),
    )


def test_param_count_matches_the_model():
    for tie in (False, True):
        cfg = _cfg(tie_embeddings=tie)
        state = nnx.state(build(cfg.model), nnx.Param)
        actual = sum(x.size for x in jax.tree.leaves(state))
        assert param_counts(cfg.model)["total"] == actual


def test_compiled_flops_within_10_percent_of_analytic_without_remat():
    cfg = _cfg(remat="none")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    analytic = flops_per_token(cfg.model, cfg.data.seq_len)["total"] * 4 * 64
    ratio = compiled_step_flops(cfg, mesh) / analytic
    assert 0.9 <= ratio <= 1.1, ratio


def test_full_remat_adds_a_forward_pass_of_flops():
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    none = compiled_step_flops(_cfg(remat="none"), mesh)
    full = compiled_step_flops(_cfg(remat="full"), mesh)
    assert 1.15 < full / none < 1.45  # ideal 4/3: forward recomputed in the backward pass


def test_grad_accumulation_counts_every_microbatch():
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    cfg = _cfg()
    accum = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=2))
    one, two = compiled_step_flops(cfg, mesh), compiled_step_flops(accum, mesh)
    assert abs(two / one - 1) < 0.05


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("TPU v5p") == 459e12
    assert peak_flops("cpu") is None


def test_device_op_summary_sums_device_events_only(tmp_path):
    """The Perfetto trace's complete events of `/device:` processes, summed by name over
    streams; host events (the Python thread, the PjRt client) are left out."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(step)", "dur": 9000.0},
        {"ph": "X", "pid": 7, "tid": 1, "name": "cudnn_flash_fwd", "dur": 300.0},
        {"ph": "X", "pid": 7, "tid": 2, "name": "cudnn_flash_fwd", "dur": 500.0},
        {"ph": "X", "pid": 7, "tid": 1, "name": "gemm_fusion", "dur": 1200.0},
        {"ph": "X", "pid": 7, "tid": 1, "name": "loop_fusion", "dur": 100.0},
    ]
    out = tmp_path / "plugins" / "profile" / "run"
    out.mkdir(parents=True)
    with gzip.open(out / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = device_op_summary(str(tmp_path), top=2)
    assert rows == [("gemm_fusion", 1.2, 1), ("cudnn_flash_fwd", 0.8, 2)]
    text = format_summary(rows, steps=1)
    assert "gemm_fusion" in text and "PjitFunction" not in text


@pytest.mark.slow  # ~19 s; the trace reading itself is tested above on a stored trace
def test_bench_profile_on_cpu_says_it_saw_no_device_ops(tmp_path):
    cfg = _cfg()
    cfg = dataclasses.replace(  # bench_train takes every device: 8 simulated ones here
        cfg,
        mesh=config.MeshConfig(data=-1),
        train=dataclasses.replace(cfg.train, global_batch_size=8),
    )
    r = bench_train(cfg, steps=1, warmup=0, compiled_flops=False, profile_dir=str(tmp_path))
    assert r["profile"].startswith("profile: no device ops")
    assert any(tmp_path.glob("**/perfetto_trace.json.gz"))
    assert "profile: no device ops" in format_result(r)


def test_a_prefix_lm_step_is_benched_on_rows_with_a_prefix():
    """The synthetic batch carries what the objective reads (prefix LM: `prefix`)."""
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    cfg = _cfg()
    prefix = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="prefix_lm"))
    assert abs(compiled_step_flops(prefix, mesh) / compiled_step_flops(cfg, mesh) - 1) < 0.05
