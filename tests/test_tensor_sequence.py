"""Megatron-style sequence parallelism in the tensor group (`mesh.tensor_sequence_parallel`):
training equals one device on dp2 x tp4 and fsdp2 x tp4 for dense, MoE and MLA models; the
compiled step trades its tensor all-reduces for all-gathers and reduce-scatters and holds
smaller residual activations; degrees it cannot take are refused in one line."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.config import MLAConfig, MoEConfig
from jaxllm.hlo_collectives import collectives
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

STEPS = 3
MOE = MoEConfig(
    num_experts=8,
    experts_per_token=2,
    num_shared_experts=1,
    first_dense_layers=1,
    dispatch="dropless",
)
MLA = MLAConfig(
    kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
MODELS = {
    "dense": tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
    "moe": tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, moe=MOE),
    "mla": tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=8, mla=MLA),
}


def _cfg(model: str, **mesh) -> config.Config:
    return config.Config(
        model=MODELS[model],
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=STEPS),
        # eps well above float32 noise: Adam would otherwise blow ~1e-9 gradient noise up to lr
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _compiled(cfg: config.Config, devices):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    return step, state, batch_sh


def _train(cfg: config.Config, devices):
    step, state, batch_sh = _compiled(cfg, devices)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


_SINGLE: dict[str, tuple] = {}


@pytest.mark.parametrize(
    "model,mesh",
    [
        ("dense", dict(data=2, tensor=4)),
        ("dense", dict(fsdp=2, tensor=4)),
        ("moe", dict(fsdp=2, tensor=4)),
        ("mla", dict(data=2, tensor=4)),
    ],
)
def test_training_equals_one_device(model, mesh):
    if model not in _SINGLE:
        _SINGLE[model] = _train(_cfg(model), jax.devices()[:1])
    ref_losses, ref_params = _SINGLE[model]
    losses, params = _train(_cfg(model, **mesh, tensor_sequence_parallel=True), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def _collectives(cfg: config.Config) -> tuple[dict[str, int], int]:
    """({collective kind: count} of the compiled train step's HLO, its temp bytes)."""
    step, state, batch_sh = _compiled(cfg, jax.devices())
    batch = to_global(synthetic_batch(cfg, seed=0), batch_sh)
    compiled = step.lower(state, batch).compile()
    found = collectives(compiled.as_text())
    counts = {
        k: found.get(k, {}).get("count", 0) for k in ("all-reduce", "all-gather", "reduce-scatter")
    }
    return counts, compiled.memory_analysis().temp_size_in_bytes


def test_all_reduces_become_all_gathers_and_reduce_scatters():
    cfg = _cfg("dense", data=2, tensor=4)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=64))
    plain, plain_bytes = _collectives(cfg)
    sp_cfg = dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, tensor_sequence_parallel=True)
    )
    sp, sp_bytes = _collectives(sp_cfg)
    assert sp["reduce-scatter"] > plain["reduce-scatter"], (plain, sp)
    assert sp["all-gather"] > plain["all-gather"], (plain, sp)
    assert sp["all-reduce"] < plain["all-reduce"], (plain, sp)
    assert sp_bytes < plain_bytes, (plain_bytes, sp_bytes)


@pytest.mark.parametrize(
    "args,words",
    [
        (["mesh.tensor=1"], "mesh.tensor, which is 1"),
        (["mesh.tensor=2", "mesh.data=4", "data.seq_len=255"], "divisible by mesh.tensor"),
    ],
)
def test_degrees_it_cannot_take_are_one_line(tmp_path, capsys, args, words):
    argv = ["train", "mesh.tensor_sequence_parallel=true", *args, f"run.dir={tmp_path / 'r'}"]
    assert main([*argv, "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm:") and words in err[0], err
    assert not (tmp_path / "r").exists()


HLO = """
  %ar.1 = f32[4,64,8]{2,1,0} all-reduce(%dot.1), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %slice.1 = f32[4,16,8]{2,1,0} fusion(%ar.1, %partition-id), kind=kLoop, calls=%fused.1
  %ar.2 = f32[4,64,8]{2,1,0} all-reduce(%dot.2), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %convert.2 = bf16[4,64,8]{2,1,0} fusion(%ar.2), kind=kLoop, calls=%fused.2
  %slice.2 = bf16[4,16,8]{2,1,0} fusion(%convert.2, %partition-id), kind=kLoop, calls=%fused.3
  %ar.3 = (f32[4,64,8]{2,1,0}, f32[]) all-reduce(%a, %b), channel_id=3, replica_groups=[2,4]<=[8]
  %gte.1 = f32[4,64,8]{2,1,0} get-tuple-element(%ar.3), index=0
  %gte.2 = f32[] get-tuple-element(%ar.3), index=1
  %slice.3 = f32[4,16,8]{2,1,0} fusion(%gte.1, %partition-id), kind=kLoop, calls=%fused.4
  %ar.4 = f32[4,64,8]{2,1,0} all-reduce(%dot.4), channel_id=4, replica_groups=[2,4]<=[8], to_apply=%add
  %slice.4 = f32[4,16,8]{2,1,0} fusion(%ar.4), kind=kLoop, calls=%fused.5
  %whole.4 = f32[4,64,8]{2,1,0} add(%ar.4, %ar.4)
  %a2a = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}) all-to-all(%x)
"""


def test_collectives_count_a_partitioned_reduce_scatter_as_one():
    """XLA:CPU's form of a reduce-scatter (an all-reduce whose every use keeps one 1 / n slice,
    through a dtype convert too) counts as one, with a 1 / n of the bytes; an all-reduce used
    whole, or combined with one that is, stays an all-reduce; a combined collective of more
    than five arrays (whose shape text holds `/*index=5*/`) is counted whole."""
    got = collectives(HLO)
    assert got["reduce-scatter"] == {"count": 2, "bytes": 2 * 4 * 16 * 8 * 4}
    assert got["all-reduce"] == {"count": 2, "bytes": 2 * 4 * 64 * 8 * 4 + 4}
    assert got["all-to-all"] == {"count": 1, "bytes": 6 * 2 * 4}  # a long tuple's comments
