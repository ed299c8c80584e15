"""DualPipeV and DualPipe (`mesh.pipeline_schedule=dualpipev|dualpipe`): their tables pass the
schedule validators of `test_pipeline_schedules.py` (every action once, after what it needs;
every slot read holds what the action needs, however it arrived), their shapes match their
closed forms, the train step on simulated devices equals one device (dense and MoE, odd stage
counts for DualPipeV), and the config refuses what they cannot run (DualPipe: odd stages)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import test_pipeline_nested as nested
from conftest import cpu_env
from test_pipeline import _cfg, _train
from test_pipeline_schedules import check_dependencies, check_slots

from jaxllm import config
from jaxllm.parallel import schedules as S

V_CASES = [(2, 4), (2, 5), (2, 8), (3, 6), (3, 7), (4, 8), (4, 16), (5, 10)]
DUAL_CASES = [(2, 4), (2, 6), (4, 8), (4, 12), (6, 12), (8, 16)]
CASES = [("dualpipev", *c) for c in V_CASES] + [("dualpipe", *c) for c in DUAL_CASES]


@pytest.mark.parametrize("schedule, p, m", CASES)
def test_table_passes_the_schedule_validators(schedule, p, m):
    table = S.build(schedule, p, m)
    assert table.virtual == 2
    check_dependencies(table)
    check_slots(table)
    # DualPipeV: device d runs chunks d and 2p - 1 - d, the loss (last chunk) on device 0;
    # DualPipe: stage d for the first half of the microbatches, p - 1 - d for the second
    kinds, mbs, js = (table.actions[:, :, f] for f in (S.ACTION, S.MB, S.CHUNK))
    for s in range(p):
        busy = kinds[:, s] > 0
        chunks = {S.chunk_of(schedule, p, s, int(j)) for j in js[busy, s]}
        if schedule == "dualpipev":
            assert chunks == {s, 2 * p - 1 - s}
        else:
            assert chunks == {s, p - 1 - s}
            assert np.array_equal(js[busy, s], mbs[busy, s] >= m // 2)
    assert table.chunks == (2 * p if schedule == "dualpipev" else p)


@pytest.mark.parametrize("p, m", V_CASES)
def test_dualpipev_ticks_bubble_and_in_flight(p, m):
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
    idle = p * (p - 1) / 2
    assert table.bubble_ratio == pytest.approx(idle / (p * table.ticks - idle))
    # in the units of ZB-H1 over the same 2p chunks (every action a tick), far fewer idle ticks
    assert table.bubble_ratio < S.build("zero_bubble", 2 * p, m).bubble_ratio


@pytest.mark.parametrize("p, m", DUAL_CASES)
def test_dualpipe_ticks_bubble_and_in_flight(p, m):
    """Every action one tick: 2m + p - 1 ticks; device r idle h = min(r, p - 1 - r) ticks and
    running p - 1 - h split weight passes; p + 2 stage inputs at its peak (DeepSeek: PP + 1)
    and p / 2 output gradients."""
    table = S.build("dualpipe", p, m)
    kinds = table.actions[:, :, S.ACTION]
    half = [min(r, p - 1 - r) for r in range(p)]
    assert table.ticks == 2 * m + p - 1
    assert (kinds == S.IDLE).sum(axis=0).tolist() == half
    assert (kinds == S.W).sum(axis=0).tolist() == [p - 1 - h for h in half]
    assert table.in_flight == (p + 2,) * p
    assert table.grad_slots == p // 2
    assert table.bubble_ratio < S.build("zero_bubble", p, m).bubble_ratio


@pytest.mark.parametrize(
    "schedule, p, m, v, needle",
    [
        ("dualpipev", 2, 3, 1, "dualpipev needs v = 1 and m >= 2p"),
        ("dualpipev", 4, 7, 1, "dualpipev needs v = 1 and m >= 2p"),
        ("dualpipev", 2, 4, 2, "dualpipev needs v = 1 and m >= 2p"),
        ("dualpipe", 3, 6, 1, "dualpipe needs even p and m"),
        ("dualpipe", 2, 5, 1, "dualpipe needs even p and m"),
        ("dualpipe", 4, 6, 1, "dualpipe needs even p and m"),
    ],
)
def test_build_refuses(schedule, p, m, v, needle):
    with pytest.raises(ValueError, match=needle):
        S.build(schedule, p, m, v)


@pytest.mark.parametrize(
    "mesh, micro, devices, needle",
    [
        (dict(stage=2), 2, 8, "dualpipev needs at least 2 \\* mesh.stage \\(4\\) microbatches"),
        (dict(stage=4), 8, 8, "divisible by 2 \\* mesh.stage \\(2 \\* 4 = 8\\)"),
        (dict(stage=2, virtual_stages=2), 4, 8, "needs mesh.pipeline_schedule=interleaved"),
        (dict(stage=3, schedule="dualpipe"), 4, 6, "needs an even mesh.stage, not 3"),
        (dict(stage=2, schedule="dualpipe"), 2, 8, "dualpipe needs at least 2 \\* mesh.stage"),
        (dict(stage=2, schedule="dualpipe", pipeline_microbatches=5), 1, 8, "even"),
    ],
)
def test_config_refusals(mesh, micro, devices, needle):
    mesh = dict(mesh)
    schedule = mesh.pop("schedule", "dualpipev")
    cfg = _cfg(micro=micro, **{"data": -1, "pipeline_schedule": schedule, **mesh})
    if mesh.get("pipeline_microbatches"):  # a batch that 5 microbatches divide
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=20))
    with pytest.raises(config.ConfigError, match=needle):
        cfg.validate(devices)


@pytest.fixture(scope="module")
def single_device_run():
    losses, state = _train(_cfg(), jax.devices()[:1])
    return losses, jax.device_get(state.params)


MESHES = {
    "dualpipev-pp2_dp2_tp2": dict(stage=2, data=2, tensor=2),
    "dualpipev-pp2_fsdp4": pytest.param(dict(stage=2, fsdp=4), marks=pytest.mark.slow),
    "dualpipe-pp2_dp2_tp2": dict(stage=2, data=2, tensor=2, pipeline_schedule="dualpipe"),
    "dualpipe-pp4_fsdp2": pytest.param(
        dict(stage=4, fsdp=2, pipeline_schedule="dualpipe", micro=8), marks=pytest.mark.slow
    ),
}


@pytest.mark.parametrize("mesh", MESHES.values(), ids=MESHES.keys())
def test_matches_single_device(mesh, single_device_run):
    """Three AdamW steps of a 4-layer model (DualPipeV: 4 chunks of a layer; DualPipe: each
    stage's layers twice, on two devices): losses and parameters as on one device (4
    microbatches; the same batch in 8 sums to the same loss)."""
    ref_losses, ref_params = single_device_run
    mesh = {"pipeline_schedule": "dualpipev", **mesh}
    losses, state = _train(_cfg(micro=mesh.pop("micro", 4), **mesh), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_params)[0]
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    assert [k for k, _ in flat] == [k for k, _ in flat_ref]
    for (path, a), (_, b) in zip(flat, flat_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=str(path))


@pytest.mark.slow  # ~45 s; the pp2 cases above run by default
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


def test_cli_refuses_dualpipe_on_an_odd_stage_count():
    """Bad input at the command line: one `jaxllm:` line naming the key, exit 2."""
    bad = subprocess.run(
        [sys.executable, "-m", "jaxllm", "plan", "mesh.stage=3", "mesh.data=2"]
        + ["mesh.pipeline_schedule=dualpipe", "--devices", "6"],
        cwd=Path(__file__).resolve().parent.parent,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxllm: "), bad.stderr
    assert "mesh.pipeline_schedule=dualpipe" in lines[0] and "even mesh.stage, not 3" in lines[0]


@pytest.mark.slow  # ~40 s each on 2 cores
@pytest.mark.parametrize(
    "schedule, layout",
    [
        ("dualpipe", nested.MIXED),  # a dense prefix on both devices running stage 0
        ("dualpipev", dict(layers=8, moe_layout=dict(moe_every=2))),  # 4 groups, 4 chunks
    ],
)
def test_moe_matches_single_device(schedule, layout):
    """An MoE model's balancing losses, expert loads and router biases add up over the chunks
    as on one device, whichever device and direction runs each chunk."""
    want, want_state = nested._train(nested._cfg("capacity", **layout), jax.devices()[:1])
    mesh = dict(stage=2, data=2, tensor=2, pipeline_schedule=schedule)
    got, got_state = nested._train(nested._cfg("capacity", **layout, **mesh), jax.devices())
    for name in ("loss", "moe_aux_loss", "moe_router_z_loss"):
        np.testing.assert_allclose(
            [m[name] for m in got], [m[name] for m in want], rtol=1e-5, err_msg=name
        )
    nested._assert_trees_close(got_state, want_state)
