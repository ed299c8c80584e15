"""DualPipeV (`mesh.pipeline_schedule=dualpipev`): its table passes the schedule validators of
`test_pipeline_schedules.py` (every action once, after what it needs; every slot read holds what
the action needs, however it arrived), its shape matches its closed forms, the train step on 8
simulated devices equals one device, and the config refuses what it cannot run."""

import dataclasses

import jax
import numpy as np
import pytest
from test_pipeline import _cfg, _train
from test_pipeline_schedules import check_dependencies, check_slots

from jaxllm import config
from jaxllm.parallel import schedules as S

CASES = [(2, 4), (2, 5), (2, 8), (3, 6), (3, 7), (4, 8), (4, 16), (5, 10)]


@pytest.mark.parametrize("p, m", CASES)
def test_table_passes_the_schedule_validators(p, m):
    table = S.build("dualpipev", p, m)
    assert table.virtual == 2
    check_dependencies(table)
    check_slots(table)
    # the V: device d runs chunks d and 2p - 1 - d, the loss (last chunk) on device 0
    for s in range(p):
        kinds = table.actions[:, s, S.ACTION]
        chunks = {S.chunk_of("dualpipev", p, s, int(j)) for j in table.actions[kinds > 0, s, 2]}
        assert chunks == {s, 2 * p - 1 - s}
    assert S.device_of("dualpipev", p, 2 * p - 1) == (0, 1)


@pytest.mark.parametrize("p, m", CASES)
def test_ticks_bubble_and_in_flight(p, m):
    """Every action one tick: 4m + 2p - 1 ticks, device r idle r ticks and running 2p - 1 - r
    split weight passes; each device holds 2p + 2 chunk inputs at its peak (DeepSeek counts PP
    + 1 = 2p + 1; here an input that arrives for the next forward waits a tick, as in 1F1B) and
    p output gradients."""
    table = S.build("dualpipev", p, m)
    kinds = table.actions[:, :, S.ACTION]
    assert table.ticks == 4 * m + 2 * p - 1
    assert (kinds == S.IDLE).sum(axis=0).tolist() == list(range(p))
    assert (kinds == S.W).sum(axis=0).tolist() == [2 * p - 1 - r for r in range(p)]
    assert table.in_flight == (2 * p + 2,) * p
    assert table.grad_slots == p
    assert table.bubble_ratio == pytest.approx(
        p * (p - 1) / 2 / (p * table.ticks - p * (p - 1) / 2)
    )
    # in the units of ZB-H1 over the same 2p chunks (every action a tick), far fewer idle ticks
    assert table.bubble_ratio < S.build("zero_bubble", 2 * p, m).bubble_ratio


@pytest.mark.parametrize(
    "p, m, v", [(2, 3, 1), (4, 7, 1), (2, 4, 2)], ids=["m<2p", "m<2p-p4", "virtual"]
)
def test_build_refuses(p, m, v):
    with pytest.raises(ValueError, match="dualpipev needs"):
        S.build("dualpipev", p, m, v)


@pytest.mark.parametrize(
    "mesh, micro, needle",
    [
        (dict(stage=2), 2, "at least 2 \\* mesh.stage \\(4\\) microbatches"),
        (dict(stage=4), 8, "divisible by 2 \\* mesh.stage \\(2 \\* 4 = 8\\)"),
        (dict(stage=2, virtual_stages=2), 4, "needs mesh.pipeline_schedule=interleaved"),
    ],
)
def test_config_refusals(mesh, micro, needle):
    cfg = _cfg(micro=micro, **{"data": -1, "pipeline_schedule": "dualpipev", **mesh})
    with pytest.raises(config.ConfigError, match=needle):
        cfg.validate(8)


@pytest.fixture(scope="module")
def single_device_run():
    losses, state = _train(_cfg(), jax.devices()[:1])
    return losses, jax.device_get(state.params)


MESHES = {
    "pp2_dp2_tp2": dict(stage=2, data=2, tensor=2),
    "pp2_fsdp4": pytest.param(dict(stage=2, fsdp=4), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_matches_single_device(mesh, single_device_run):
    """Three AdamW steps of a 4-layer model in 4 chunks: losses and parameters as on one device."""
    ref_losses, ref_params = single_device_run
    losses, state = _train(_cfg(pipeline_schedule="dualpipev", **mesh), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_params)[0]
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    assert [k for k, _ in flat] == [k for k, _ in flat_ref]
    for (path, a), (_, b) in zip(flat, flat_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=str(path))


def test_odd_stage_count_matches_single_device():
    """DualPipeV takes an odd number of stages: pp3 x dp2 (6 chunks of one layer, 6
    microbatches) trains as one device does."""

    def cfg(**mesh):
        base = _cfg(micro=6, **mesh)
        return dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, num_layers=6, d_model=48),  # 48: 3 stages
            train=dataclasses.replace(base.train, global_batch_size=12),
        )

    ref_losses, ref_state = _train(cfg(), jax.devices()[:1])
    losses, state = _train(cfg(stage=3, data=2, pipeline_schedule="dualpipev"), jax.devices()[:6])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)),
        jax.tree.leaves(jax.device_get(ref_state.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
