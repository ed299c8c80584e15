"""Host offload: the optimizer state in host memory between steps (`optim.offload=host`) and
activations saved to host memory by the remat policy (`model.remat=offload`). On CPU the
numerics must equal no offload; lowered for cuda and tpu, the modules place those buffers in
host memory."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN, abstract_state, tiny_model
from lowering import lower

from jaxllm import config, objectives, optim, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.model import abstract_model
from jaxllm.plan import memory_bill
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state
from jaxllm.train.step import train_step

HOST = '_xla_buffer_placement = "pinned_host"'


def _cfg(offload="none", remat="none", param_dtype="float32", **optim) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=256, remat=remat, param_dtype=param_dtype),
        mesh=config.MeshConfig(data=1),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=4, steps=3),
        optim=config.OptimConfig(
            lr=1e-2, warmup_steps=0, schedule="constant", offload=offload, **optim
        ),
    ).validate()


def _train(cfg):
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, offload=cfg.optim.offload == "host")
    batch = to_global(synthetic_batch(cfg), batch_sh)
    losses = []
    for _ in range(cfg.train.steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.mark.slow  # ~24 s; an offloaded run trains and resumes by default (test_a_run_resumes_...)
def test_offload_trains_like_no_offload():
    """Optimizer state in host memory and activations offloaded by the remat policy: the same
    losses and parameters as everything on the device (both at once: one compile fewer)."""
    want, ref = _train(_cfg())
    got, state = _train(_cfg(offload="host", remat="offload"))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"device"}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_float32_master_weights_of_bfloat16_parameters_live_in_host_memory():
    losses, state = _train(_cfg("host", param_dtype="bfloat16", master_weights="float32"))
    assert losses[-1] < losses[0]
    master = state.opt_state.master
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(master)):
        assert p.dtype == jnp.bfloat16 and p.sharding.memory_kind == "device"
        assert m.dtype == jnp.float32 and m.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(jnp.bfloat16))


def _losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_a_run_resumes_with_its_optimizer_state_offloaded(small_run, tmp_path):
    """A checkpoint written with the state on the device resumes into host memory."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "checkpoints" / "4")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    args = [*SMALL_RUN, "train.steps=4", "checkpoint.every=2", f"run.dir={run}"]
    assert main(["train", *args, "optim.offload=host"]) == 0
    got, want = _losses(run), _losses(small_run)
    np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-6)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowered_step_keeps_state_and_activations_in_host_memory(platform):
    """The step for a GPU / TPU: the optimizer state moved to the device and back, and each
    block's saved matmul outputs sent to host memory."""
    hlo = {}
    for offload, remat in (("host", "none"), ("none", "offload"), ("none", "none")):
        cfg = _cfg(offload=offload, remat=remat)
        graphdef, _, axes = abstract_model(cfg.model)
        tx = optim.build(cfg.optim, cfg.train.steps, axes)
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
        state = jax.eval_shape(lambda cfg=cfg, tx=tx, mesh=mesh: init_state(cfg.model, tx, mesh, 0))
        batch = jax.tree.map(jnp.asarray, synthetic_batch(cfg))

        def step(state, batch, cfg=cfg, graphdef=graphdef, tx=tx):
            return train_step(
                state,
                batch,
                graphdef=graphdef,
                tx=tx,
                lr_schedule=optim.schedule(cfg.optim, cfg.train.steps),
                objective=objectives.from_config(cfg),
                offload_opt_state=cfg.optim.offload == "host",
            )

        hlo[offload, remat] = lower(step, state, batch, platform=platform).as_text()
    n_state = len(jax.tree.leaves(state.opt_state))
    assert hlo["none", "none"].count(HOST) == 0
    assert hlo["host", "none"].count(HOST) >= n_state  # every state leaf sent back to the host
    assert hlo["none", "offload"].count(HOST) > 0


def test_plan_bills_offloaded_state_to_host_memory():
    state, shardings, axes, _ = abstract_state(
        "mesh=fsdp", "model.dtype=float32", "optim.offload=host"
    )
    bill = memory_bill(state, shardings, axes)
    psi = sum(p.size for p in jax.tree.leaves(state.params))
    assert bill["optimizer_state"] == 0
    assert bill["host"] == pytest.approx(8 * psi / 8, rel=0.01)  # AdamW, split 8 ways
    assert bill["parameters"] == pytest.approx(4 * psi / 8, rel=0.01)
