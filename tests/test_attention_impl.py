"""`model.attention_impl`: the Pallas kernel (interpreted on CPU) trains like the XLA reference,
on one device and under a mesh (where it runs per shard through shard_map)."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.model.attention import resolve_impl
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state


def _losses_and_params(impl: str, mesh_cfg: dict, devices):
    cfg = config.Config(
        model=tiny_model(
            vocab_size=264,
            d_model=64,
            num_heads=4,
            num_kv_heads=2,
            mlp_dim=128,
            attention_impl=impl,
        ),
        mesh=config.MeshConfig(**{"data": 1, **mesh_cfg}),
        data=config.DataConfig(seq_len=64),
        train=config.TrainConfig(global_batch_size=4, steps=3),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0)
    losses = []
    for i in range(3):
        batch = synthetic_batch(cfg, seed=i)
        # two documents per row, so the kernel's segment masking is exercised
        batch["segment_ids"][:, 40:] = 2
        batch["positions"][:, 40:] -= 40
        batch["loss_mask"][:, 39] = 0
        state, metrics = step(state, to_global(batch, batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.mark.parametrize(
    "mesh_cfg, n",
    # one device is the slower run (the interpreted kernel on the whole batch) and adds no path
    [pytest.param({}, 1, marks=pytest.mark.slow), ({"data": 2, "fsdp": 2, "tensor": 2}, 8)],
    ids=["single", "dp2_fsdp2_tp2"],
)
def test_flash_trains_like_xla(mesh_cfg, n):
    devices = jax.devices()[:n]
    ref_losses, ref_params = _losses_and_params("xla", mesh_cfg, devices)
    losses, params = _losses_and_params("flash", mesh_cfg, devices)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_auto_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert resolve_impl("auto") == "xla"
    assert resolve_impl("flash") == "flash"


def test_attention_impl_is_type_checked():
    with pytest.raises(config.ConfigError, match="attention_impl"):
        config.load(None, ["model.attention_impl=triton"])
    assert (
        dataclasses.replace(config.ModelConfig(), attention_impl="cudnn").attention_impl == "cudnn"
    )
