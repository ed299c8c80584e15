"""Mixture-of-experts on a mesh: experts split over the `expert` axis, expert-parallel training
(dropless, capacity by annotations and by all-to-all) against one device, and, on the same
single-device reference runs, the train step's MoE metrics and losses and the checkpointed
balancing bias; presets trained with the CLI and planned on expert-parallel meshes."""

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cpu_env, tiny_model
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxllm
from jaxllm import checkpoint, config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.metrics import param_counts
from jaxllm.model import abstract_model
from jaxllm.model.moe import RouterBias
from jaxllm.objectives import next_token
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state
from jaxllm.train.step import objective_value

REPO = Path(__file__).resolve().parent.parent


def test_experts_must_split_over_the_expert_axis():
    cfg = config.load(None, ["model.moe.num_experts=6", "mesh=expert"])
    with pytest.raises(ConfigError, match="mesh.expert"):
        cfg.validate(8)


# ------------------------------------------------------------------ training on a mesh


def _train_cfg(dispatch: str, **mesh) -> config.Config:
    moe = MoEConfig(
        num_experts=8,
        experts_per_token=2,
        dispatch=dispatch,
        capacity_factor=1.0,
        num_shared_experts=1,
        first_dense_layers=1,
        bias_update_rate=0.01,
    )
    return config.Config(
        model=tiny_model(vocab_size=258, num_layers=2, moe=moe),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=16),
        train=config.TrainConfig(global_batch_size=8, steps=2),
        # eps well above float32 noise: Adam would otherwise blow ~1e-9 gradient noise up to lr
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, devices, initial=None):
    """Two steps from `initial` (a host copy of a state; fresh init when None)."""
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    state = (
        init_state(cfg.model, tx, mesh, 0)
        if initial is None
        else jax.device_put(initial, shardings)
    )
    start = jax.device_get(state)
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state, metrics, start


@pytest.fixture(scope="module")
def single_device_runs():
    dropless = _train(_train_cfg("dropless"), jax.devices()[:1])
    initial = dropless[3]  # both modes have the same parameters: initialise once
    return {
        "dropless": dropless,
        "capacity": _train(_train_cfg("capacity"), jax.devices()[:1], initial),
    }


@pytest.mark.parametrize(
    "dispatch, mesh",
    [
        ("dropless", dict(expert=8)),
        pytest.param(
            "capacity", dict(expert=8, expert_dispatch="annotations"), marks=pytest.mark.slow
        ),
        pytest.param("dropless", dict(expert=2, fsdp=2, tensor=2), marks=pytest.mark.slow),
        ("capacity", dict(expert=2, fsdp=2, tensor=2, expert_dispatch="all_to_all")),
    ],
    ids=[
        "ep8-dropless",
        "ep8-capacity-annotations",
        "ep2_fsdp2_tp2-dropless",
        "ep2_fsdp2_tp2-capacity-all_to_all",
    ],
)
def test_expert_parallel_training_matches_single_device(dispatch, mesh, single_device_runs):
    ref_losses, ref_state, ref_metrics, initial = single_device_runs[dispatch]
    cfg = _train_cfg(dispatch, **mesh)
    losses, state, metrics, _ = _train(cfg, jax.devices(), initial)
    # float32 end to end; only the order of cross-device sums differs
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)),
        jax.tree.leaves(jax.device_get(ref_state.params)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    bias, ref_bias = (
        jax.device_get(s.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
        for s in (state, ref_state)
    )
    np.testing.assert_allclose(bias, ref_bias, atol=1e-7)
    assert np.abs(bias).max() > 0
    for k in ("moe_load_cv", "moe_dropped_frac", "moe_aux_loss", "moe_router_z_loss"):
        assert float(metrics[k]) == pytest.approx(float(ref_metrics[k]), rel=1e-5, abs=1e-7), k
    if dispatch == "capacity":
        assert float(metrics["moe_dropped_frac"]) > 0  # capacity factor 1: some are dropped
    # the experts really are split: each device holds E / ep of them (and its fsdp / tensor
    # slice), and so do their Adam moments
    ep, fsdp, tp = mesh["expert"], mesh.get("fsdp", 1), mesh.get("tensor", 1)
    gate = state.params["moe_layers"]["moe"]["mlp"]["gate_proj"]  # [1, E, D, F]
    assert gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (1, 8 // ep, 32 // fsdp, 64 // tp)
    mu = state.opt_state[1][0].mu["moe_layers"]["moe"]["mlp"]["gate_proj"]
    assert mu.sharding == gate.sharding
    down = state.params["moe_layers"]["moe"]["mlp"]["down_proj"]
    assert down.addressable_shards[0].data.shape == (1, 8 // ep, 64 // tp, 32 // fsdp)


# ------------------------------------------------------------------ train step, checkpoints


@pytest.fixture(scope="module")
def one_step(single_device_runs):
    """The single-device dropless run: (config, host state before, state after 2 steps, the
    last step's metrics, a batch)."""
    _, after, metrics, start = single_device_runs["dropless"]
    cfg = _train_cfg("dropless")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    batch = to_global(synthetic_batch(cfg), sharding.named(mesh, ("batch", "length")))
    return cfg, start.model_state, after, metrics, batch


def test_train_step_logs_moe_metrics_and_moves_the_bias_outside_the_optimizer(one_step):
    cfg, before, after, metrics, batch = one_step
    for k in (
        "moe_load_min",
        "moe_load_max",
        "moe_load_cv",
        "moe_dropped_frac",
        "moe_aux_loss",
        "moe_router_z_loss",
    ):
        assert np.isfinite(float(metrics[k])), k
    assert 0 < float(metrics["moe_load_min"]) <= 1 / 8 <= float(metrics["moe_load_max"])
    assert float(metrics["moe_dropped_frac"]) == 0.0  # dropless
    # the bias moved by +-rate per step (or 0 where an expert had exactly the mean load) ...
    path = ("moe_layers", "moe", "mlp", "router_bias")
    delta = (
        np.asarray(after.model_state[path[0]][path[1]][path[2]][path[3]])
        - (before[path[0]][path[1]][path[2]][path[3]])
    )
    assert set(np.round(np.abs(delta) / 0.01, 5).ravel()) <= {0.0, 1.0, 2.0}
    assert np.abs(delta).max() > 0
    # ... and is no parameter: not in params, no optimizer moments, no weight decay
    assert "router_bias" not in str(jax.tree_util.tree_structure(after.params))
    adam = after.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(after.params)


def test_aux_and_router_z_losses_reach_the_objective(one_step):
    cfg, before, after, _, batch = one_step
    params = jax.device_get(after.params)

    def objective(aux_w, z_w):  # the weights are part of the model's config: one compile each
        moe = dataclasses.replace(cfg.model.moe, aux_loss_weight=aux_w, router_z_loss_weight=z_w)
        graphdef = abstract_model(dataclasses.replace(cfg.model, moe=moe))[0]
        value = functools.partial(
            objective_value,
            graphdef=graphdef,
            objective=next_token(),
            model_state=after.model_state,
        )
        return jax.jit(value)(params, batch, None)

    base, out = objective(0.0, 0.0)
    with_aux, _ = objective(0.5, 0.0)
    with_z, _ = objective(0.0, 0.25)
    count, sums = out.tokens, out.metrics
    assert float(sums["moe_aux_loss"] / count) == pytest.approx(1.0, abs=0.2)  # near balanced
    assert float(with_aux - base) == pytest.approx(0.5 * float(sums["moe_aux_loss"]), rel=1e-4)
    assert float(with_z - base) == pytest.approx(0.25 * float(sums["moe_router_z_loss"]), rel=1e-4)


def test_checkpoint_round_trips_the_balancing_bias(one_step, tmp_path):
    cfg, _, after, _, _ = one_step
    cfg = dataclasses.replace(cfg, run=config.RunConfig(dir=str(tmp_path)))
    config.dump(cfg, tmp_path / "config.yaml")
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints", cfg.checkpoint)
    ckpt.save(after, data_state={}, config={}, tokenizer={})
    ckpt.close()
    assert (tmp_path / "checkpoints" / "2" / "model_state").is_dir()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), after
    )
    restored, _, step = checkpoint.Checkpointer(
        tmp_path / "checkpoints", cfg.checkpoint
    ).restore_latest(abstract)
    assert step == 2
    bias = jax.device_get(after.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
    got = jax.device_get(restored.model_state)["moe_layers"]["moe"]["mlp"]["router_bias"]
    np.testing.assert_array_equal(got, bias)
    # inference gets it too: the loaded model routes with the trained bias
    model = jaxllm.load_model(tmp_path)
    np.testing.assert_array_equal(
        nnx.state(model, RouterBias)["moe_layers"]["moe"]["mlp"]["router_bias"][...], bias
    )


# ------------------------------------------------------------------ presets


def _jaxllm(*args, devices=1):
    env = cpu_env(devices)
    return subprocess.run(
        [sys.executable, "-m", "jaxllm", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _train_preset(preset, run_dir, *extra):
    proc = _jaxllm(
        "train",
        f"model={preset}",
        f"run.dir={run_dir}",
        "train.steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "train.global_batch_size=8",
        "data.seq_len=64",
        "data.max_files=40",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {
            "moe_load_min",
            "moe_load_max",
            "moe_load_cv",
            "moe_dropped_frac",
            "moe_aux_loss",
            "moe_router_z_loss",
        } <= set(r)
    assert rows[-1]["loss"] < rows[0]["loss"]
    return rows, proc


@pytest.mark.slow  # a 30 s CLI run; the bias checkpoint round trip is tested in-process above
def test_tiny_deepseek_preset_trains_with_the_cli(tmp_path):
    rows, _ = _train_preset("tiny_deepseek", tmp_path / "run")
    cfg = config.load(tmp_path / "run" / "config.yaml")
    assert cfg.model.moe.router_score == "sigmoid" and cfg.model.moe.num_shared_experts == 1
    assert (tmp_path / "run" / "checkpoints" / "4" / "model_state").is_dir()


@pytest.mark.slow
def test_tiny_mixtral_preset_trains_with_the_cli(tmp_path):
    rows, _ = _train_preset("tiny_mixtral", tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints" / "4" / "model_state").exists()


def _plan_preset(preset, *overrides):
    from jaxllm.plan import plan

    cfg = config.load(
        None,
        [
            f"model={preset}",
            "mesh=expert",
            "model.remat=full",
            "train.global_batch_size=8",
            "data.seq_len=256",
            *overrides,
        ],
    )
    return plan(cfg, jax.devices())


@pytest.mark.slow  # ~20 s: a full-size plan compile; the expert-parallel layouts train above
def test_mixtral_8x7b_plans_on_an_expert_parallel_mesh():
    r = _plan_preset("mixtral_8x7b", "model.moe.dispatch=capacity")
    assert r["params"] == 46_702_792_704  # Mixtral-8x7B's published count
    assert r["mesh"]["expert"] == 8
    rows = {row["name"]: row for row in r["param_rows"]}
    gate = rows["moe_layers/moe/mlp/gate_proj"]
    assert tuple(gate["spec"]) == (None, "expert", "fsdp", "tensor")
    assert gate["bytes_per_device"] == 32 * 4096 * 14336 * 4  # one expert per device
    assert r["collectives"]["all-to-all"]["count"] > 0  # tokens travel to their experts
    assert param_counts(config.load(None, ["model=mixtral_8x7b"]).model)["active"] == (
        12_879_925_248
    )


@pytest.mark.slow
def test_qwen3_30b_a3b_plans_on_an_expert_parallel_mesh():
    r = _plan_preset("qwen3_30b_a3b")
    assert r["params"] == 30_532_110_336  # the published count less q/k-norm scales (12,288)
    rows = {row["name"]: row for row in r["param_rows"]}
    assert rows["moe_layers/moe/mlp/up_proj"]["shape"] == (48, 128, 2048, 768)
    # dropless: tokens gathered over `expert`, partial outputs reduce-scattered back
    assert r["collectives"]["reduce-scatter"]["count"] > 0


@pytest.mark.slow
def test_deepseek_v3_plans_on_an_expert_parallel_mesh():
    r = _plan_preset("deepseek_v3")
    assert r["params"] == 671_026_404_352  # the routing biases are model state, not counted
    rows = {row["name"]: row for row in r["param_rows"]}
    assert rows["moe_layers/moe/mlp/gate_proj"]["shape"] == (58, 256, 7168, 2048)
    assert rows["layers/attn/q_b_proj"]["shape"] == (3, 1536, 128, 192)
    assert r["mesh"]["expert"] == 8


def test_plan_does_not_count_collectives_over_single_devices():
    # shard_map leaves all-reduces over mesh axes of size 1 in the program: they move nothing
    from jaxllm.plan import collectives

    hlo = """
  %a = f32[8,64]{1,0} all-reduce(%x), replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %b = f32[8,64]{1,0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %c = f32[8,64]{1,0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %d = f32[8,64]{1,0} all-reduce(%x), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_1'}, to_apply=%add
  %e = f32[8,64]{1,0} all-to-all(%x), replica_groups=[8,1]<=[8], dimensions={0}
"""
    assert collectives(hlo) == {"all-reduce": {"count": 2, "bytes": 2 * 8 * 64 * 4}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,params", [("gpt_oss_20b", 20_914_757_184), ("gpt_oss_120b", 116_829_156_672)]
)
def test_gpt_oss_plans_on_an_expert_parallel_mesh(preset, params):
    """The published shapes (sinks, attention and expert biases included)."""
    r = _plan_preset(preset)
    assert (
        r["params"] == params == param_counts(config.load(None, [f"model={preset}"]).model)["total"]
    )
    rows = {row["name"]: row for row in r["param_rows"]}
    assert tuple(rows["moe_layers/moe/mlp/gate_bias"]["spec"])[1] == "expert"
    assert rows["moe_layers/moe/attn/sinks"]["shape"][1] == 64
