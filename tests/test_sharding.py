"""SPMD layouts: the same three train steps on 8 simulated devices as on one, with the actual
shardings of parameters and optimizer state asserted; FSDP memory; multi-process training."""

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cpu_env, tiny_model
from jax.sharding import PartitionSpec as P

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

REPO = Path(__file__).resolve().parent.parent
STEPS = 3


def _cfg(**mesh) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=STEPS),
        # eps well above float32 noise: Adam would otherwise blow ~1e-9 gradient noise up to lr
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, devices):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.fixture(scope="module")
def single_device_run():
    losses, state = _train(_cfg(), jax.devices()[:1])
    return losses, jax.device_get(state.params)


LAYOUTS = {
    "dp8_zero2": dict(data=8, zero_stage=2),
    "dp2_fsdp2_tp2": dict(data=2, fsdp=2, tensor=2),
    "fsdp2_tp2_sp2": dict(fsdp=2, tensor=2, sequence=2),
    "fsdp4_sp2_ring": dict(fsdp=4, sequence=2, sequence_attention="ring"),
    "dcn_dp2_fsdp4": dict(fsdp=4, dcn_data=2),
}
# each covered by the layouts above in parts (data, fsdp, tensor and sequence splits, the ring)
SLOW_LAYOUTS = {
    "dp8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "tp4_sp2": dict(tensor=4, sequence=2),
    "tp2_sp4_ring": dict(tensor=2, sequence=4, sequence_attention="ring"),
    "dp2_fsdp2_tp2_zero1": dict(data=2, fsdp=2, tensor=2, zero_stage=1),
}


@pytest.mark.parametrize(
    "layout", [*LAYOUTS, *(pytest.param(k, marks=pytest.mark.slow) for k in SLOW_LAYOUTS)]
)
def test_layout_matches_single_device(layout, single_device_run):
    ref_losses, ref_params = single_device_run
    cfg = _cfg(**{**LAYOUTS, **SLOW_LAYOUTS}[layout])
    losses, state = _train(cfg, jax.devices())
    # float32 end to end; only the order of cross-device sums differs
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    got = jax.device_get(state.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    _assert_state_shardings(state, sharding.make_mesh(cfg.mesh, jax.devices()), cfg.mesh.zero_stage)


def _assert_state_shardings(state, mesh, zero_stage=0):
    p = state.params
    gate = p["layers"]["mlp"]["gate_proj"]  # [N, D, F]: ('layers', 'embed', 'mlp')
    q = p["layers"]["attn"]["q_proj"]  # [N, D, H, K]
    down = p["layers"]["mlp"]["down_proj"]  # [N, F, D]
    assert gate.sharding.spec == P(None, "fsdp", "tensor")
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert down.sharding.spec == P(None, "tensor", "fsdp")
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    assert gate.addressable_shards[0].data.shape == (2, 64 // fsdp, 128 // tensor)
    assert q.addressable_shards[0].data.shape == (2, 64 // fsdp, 8 // tensor, 8)
    assert down.addressable_shards[0].data.shape == (2, 128 // tensor, 64 // fsdp)
    # ZeRO-3: every parameter and both Adam moments are split over fsdp, identically; ZeRO-1/2
    # split the moments over data as well, where the parameters are whole
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    for tree in (p, adam.mu, adam.nu):
        for leaf, ref in zip(jax.tree.leaves(tree), jax.tree.leaves(p)):
            axes = jax.tree.leaves(tuple(leaf.sharding.spec))
            if fsdp > 1:
                assert "fsdp" in axes, leaf.sharding
            if tree is p or not zero_stage:
                assert leaf.sharding == ref.sharding
                assert "data" not in axes
            elif leaf.ndim:
                assert "data" in axes, (leaf.shape, leaf.sharding)


@pytest.mark.slow  # ~20 s; the 1/8 split by shardings: test_zero.py, test_plan.py
def test_fsdp8_argument_bytes_are_an_eighth():
    def argument_bytes(cfg, devices):
        mesh = sharding.make_mesh(cfg.mesh, devices)
        step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
        state = init_state(cfg.model, tx, mesh, seed=0)
        batch = to_global(synthetic_batch(cfg), batch_sh)
        return step.lower(state, batch).compile().memory_analysis().argument_size_in_bytes

    single = argument_bytes(_cfg(), jax.devices()[:1])
    fsdp8 = argument_bytes(_cfg(fsdp=8), jax.devices())
    assert fsdp8 <= single / 8 * 1.10, (fsdp8, single)


def test_dcn_degrees_put_slices_outermost():
    mesh = sharding.make_mesh(config.MeshConfig(data=1, fsdp=4, dcn_data=2), jax.devices())
    assert dict(mesh.shape) == {
        "stage": 1,
        "data": 2,
        "fsdp": 4,
        "tensor": 1,
        "tensor2": 1,
        "sequence": 1,
        "expert": 1,
    }
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 4)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [4, 5, 6, 7]])  # data over the groups


def test_indivisible_parameter_is_a_config_error():
    cfg = dataclasses.replace(_cfg(tensor=8), model=tiny_model(num_heads=8, num_kv_heads=8))
    with pytest.raises(config.ConfigError, match="vocab|mlp|embed"):
        _train(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=260)),
            jax.devices(),
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jaxllm_train(args, devices: int, extra_env=None):
    env = cpu_env(devices, **(extra_env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "jaxllm", "train", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize(
    "mesh", ["mesh.data=-1", pytest.param("mesh.data=1 mesh.fsdp=-1", marks=pytest.mark.slow)]
)
def test_two_processes_match_one(tmp_path, mesh):
    common = [
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "train.global_batch_size=8",
        "data.seq_len=32",
        "data.max_files=100",
        "model.d_model=64",
        "model.num_layers=2",
        "model.mlp_dim=128",
        "model.dtype=float32",
        *mesh.split(),
    ]
    port = _free_port()
    procs = [
        # flags for process 0, environment variables for process 1: both paths are used
        _jaxllm_train(
            [
                *common,
                f"run.dir={tmp_path / 'multi'}",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                "0",
            ],
            devices=4,
        ),
        _jaxllm_train(
            [*common, f"run.dir={tmp_path / 'multi'}"],
            devices=4,
            extra_env={
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": "1",
            },
        ),
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "in 2 processes" in outs[0]
    single = _jaxllm_train([*common, f"run.dir={tmp_path / 'single'}"], devices=1)
    out = single.communicate(timeout=600)[0]
    assert single.returncode == 0, out

    def losses(run):
        rows = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows]

    assert len(losses("multi")) == 3
    np.testing.assert_allclose(losses("multi"), losses("single"), rtol=2e-6)
