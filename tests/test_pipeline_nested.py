"""What runs its own `shard_map` inside a pipeline stage: MoE dispatch and the attention
kernels (ring attention inside stages is refused: its losses differ from one device's). MoE models: each stage adds its own layers' balancing losses and expert loads, so
three train steps on pp2 x dp2 x tp2 (and pp2 x ep2 x dp2) match one device: losses, the MoE
metrics, the parameters and the router biases of auxiliary-loss-free balancing. The flash
kernel inside stages matches one device too."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

STEPS = 3


def _cfg(dispatch: str | None, micro: int = 4, **mesh) -> config.Config:
    moe = config.MoEConfig(
        num_experts=4,
        experts_per_token=2,
        expert_mlp_dim=32,
        dispatch=dispatch,
        aux_loss_weight=0.05,
        router_z_loss_weight=0.01,
        bias_update_rate=0.01,
    )
    return config.Config(
        model=tiny_model(vocab_size=264, num_layers=4, moe=moe if dispatch else config.MoEConfig()),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=16),
        train=config.TrainConfig(global_batch_size=16, steps=STEPS, grad_accum_steps=micro),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, devices):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    history = []
    for i in range(STEPS):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        history.append({k: float(v) for k, v in metrics.items() if np.ndim(v) == 0})
    return history, jax.device_get((state.params, state.model_state))


def _assert_trees_close(got, want):
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(got)[0]:
        np.testing.assert_allclose(a, flat_want[path], rtol=1e-4, atol=2e-5, err_msg=str(path))


@pytest.mark.parametrize(
    "dispatch,mesh",
    [
        ("capacity", dict(stage=2, data=2, tensor=2)),
        pytest.param("dropless", dict(stage=2, data=2, expert=2), marks=pytest.mark.slow),
    ],
    ids=["capacity-pp2_dp2_tp2", "dropless-pp2_ep2_dp2"],
)
def test_moe_pipeline_matches_single_device(dispatch, mesh):
    want, want_state = _train(_cfg(dispatch), jax.devices()[:1])
    got, got_state = _train(_cfg(dispatch, **mesh), jax.devices())
    for name in ("loss", "moe_aux_loss", "moe_router_z_loss"):
        np.testing.assert_allclose(
            [m[name] for m in got], [m[name] for m in want], rtol=1e-5, err_msg=name
        )
    assert want[0]["moe_aux_loss"] > 0
    _assert_trees_close(got_state, want_state)
    biases = [
        a
        for p, a in jax.tree_util.tree_flatten_with_path(want_state[1])[0]
        if "router_bias" in str(p)
    ]
    assert biases and np.abs(biases[0]).max() > 0  # the loads moved the biases


@pytest.mark.parametrize(
    "model,mesh",
    [
        pytest.param(
            dict(attention_impl="flash"), dict(stage=2, data=2, tensor=2), marks=pytest.mark.slow
        ),
    ],
    ids=["flash-pp2_dp2_tp2"],
)
def test_attention_kernels_inside_stages_match_single_device(model, mesh):
    def cfg_of(**m):
        cfg = _cfg(None, **m)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))

    want, want_state = _train(cfg_of(), jax.devices()[:1])
    got, got_state = _train(cfg_of(**mesh), jax.devices())
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)
    _assert_trees_close(got_state, want_state)
