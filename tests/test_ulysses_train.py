"""mesh.sequence_attention=ulysses and usp train like one device: three steps on packed rows
(two documents each) give the same losses and parameters for causal, sliding-window, GQA (kv
heads repeated), sink and ALiBi models (usp: those its ring supports), with heads over `tensor`
too and inside pipeline stages; a Gaussian-kernel model under Ulysses."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

STEPS = 3
MODELS = {
    "causal": dict(num_kv_heads=4),
    "gqa": dict(num_kv_heads=2),
    "gqa_window": dict(num_kv_heads=2, sliding_window=8),
    "gqa_sinks": dict(num_kv_heads=2, attention_sinks=True),
    "alibi": dict(num_kv_heads=2, position="alibi"),
    "gaussian": dict(num_kv_heads=2, attention_kernel="gaussian", gaussian_sigma_learned=True),
}


def _cfg(model: str, accum: int = 1, **mesh) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=264, d_model=64, num_heads=8, mlp_dim=128, **MODELS[model]),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=4, steps=STEPS, grad_accum_steps=accum),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, n_devices: int):
    devices = jax.devices()[:n_devices]
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    losses = []
    for i in range(STEPS):
        batch = synthetic_batch(cfg, seed=i)
        # two documents per row; the second starts inside the second of four sequence shards
        batch["segment_ids"][:, 13:] = 2
        batch["positions"][:, 13:] -= 13
        batch["loss_mask"][:, 12] = 0
        state, metrics = step(state, to_global(batch, batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@functools.cache
def _single_device(model: str, accum: int):
    return _train(_cfg(model, accum), 1)


ULYSSES = dict(sequence_attention="ulysses")
USP = dict(sequence_attention="usp", sequence_ulysses=2)


# the slow ones: each case's parts are covered by the default ones and tests/test_ulysses.py
@pytest.mark.parametrize(
    "model, accum, mesh",
    [
        ("causal", 1, dict(data=2, sequence=4, **ULYSSES)),
        ("gqa_window", 1, dict(data=2, sequence=4, **ULYSSES)),  # 2 kv heads repeated to 4
        pytest.param(
            "gqa_sinks", 1, dict(tensor=2, sequence=4, **ULYSSES), marks=pytest.mark.slow
        ),  # 1 kv head per tensor shard x4
        pytest.param(
            "alibi", 1, dict(sequence=8, **ULYSSES), marks=pytest.mark.slow
        ),  # one head per device, its own slope
        pytest.param(
            "gaussian", 1, dict(data=2, sequence=4, **ULYSSES), marks=pytest.mark.slow
        ),  # learned sigma per head
        # inside pipeline stages: the step's two microbatches run through them
        ("gqa_window", 2, dict(stage=2, sequence=2, data=2, **ULYSSES)),
        ("causal", 1, dict(data=2, sequence=4, **USP)),  # 2 groups of 2
        pytest.param(
            "gqa", 1, dict(tensor=2, sequence=4, **USP), marks=pytest.mark.slow
        ),  # 1 kv head per tensor shard x2
        ("gqa", 2, dict(stage=2, sequence=4, **USP)),
    ],
    ids=[
        "causal-dp2_sp4",
        "gqa_window-dp2_sp4",
        "gqa_sinks-tp2_sp4",
        "alibi-sp8",
        "gaussian-dp2_sp4",
        "pp2_sp2_dp2",
        "usp-causal-dp2_sp4_u2",
        "usp-gqa-tp2_sp4_u2",
        "usp-gqa-pp2_sp4_u2",
    ],
)
def test_ulysses_trains_like_one_device(model, accum, mesh):
    want_losses, want_params = _single_device(model, accum)
    losses, params = _train(_cfg(model, accum, **mesh), 8)
    # float32 end to end; only the order of cross-device sums differs
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want_params)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_allclose(a, flat_want[path], rtol=1e-4, atol=2e-5, err_msg=str(path))


# the kernel per head group / per ring block pair is covered in test_ulysses; ~10-15 s each
@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [dict(data=2, sequence=4, **ULYSSES), dict(data=2, sequence=4, **USP)],
    ids=["ulysses-dp2_sp4", "usp-dp2_sp4_u2"],
)
def test_flash_trains_like_xla_on_one_device(mesh):
    want_losses, want_params = _single_device("gqa", 1)
    cfg = _cfg("gqa", 1, **mesh)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="flash"))
    losses, params = _train(cfg, 8)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want_params)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_allclose(a, flat_want[path], rtol=1e-4, atol=2e-5, err_msg=str(path))
