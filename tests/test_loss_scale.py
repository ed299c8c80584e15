"""Loss scaling: float16 gradients that underflow without it, the overflow guard and backoff,
growth after clean steps, exactness in float32, checkpoint/resume of the scale, and its config."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from conftest import SMALL_RUN, tiny_model

from jaxllm import JaxllmWarning, config, optim, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.metrics import read_jsonl
from jaxllm.model import abstract_model
from jaxllm.objectives import next_token
from jaxllm.train import loss_scale
from jaxllm.train import step as step_lib
from jaxllm.train.loop import to_global
from jaxllm.train.state import init_state


def _cfg(dtype: str, **optim_kw) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=258, dtype=dtype),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8),
        optim=config.OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant", **optim_kw),
    )


def _weighted(weight: float):
    """next_token with its loss multiplied by `weight`: a small weight makes every gradient of
    the backward pass small, as a loss term with a small coefficient does."""
    base = next_token()

    def objective(model, batch, rng):
        out = base(model, batch, rng)
        return out._replace(loss_sum=out.loss_sum * weight)

    return objective


def _setup(cfg: config.Config, objective=None):
    """(jitted step, fresh state, batch) on one device, as `compile_steps` builds them."""
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    tx = optim.build(cfg.optim, cfg.train.steps)
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    step = jax.jit(
        lambda s, b: step_lib.train_step(
            s,
            b,
            graphdef=abstract_model(cfg.model)[0],
            tx=tx,
            lr_schedule=optim.schedule(cfg.optim, cfg.train.steps),
            objective=objective or next_token(),
            loss_scaling=scaling,
        )
    )
    state = init_state(cfg.model, tx, mesh, seed=0, loss_scaling=scaling)
    batch = to_global(synthetic_batch(cfg), sharding.named(mesh, step_lib.BATCH_AXES))
    return step, state, batch


def _grad_norm(cfg, objective) -> float:
    step, state, batch = _setup(cfg, objective)
    return float(step(state, batch)[1]["grad_norm"])


def test_float16_gradients_underflow_without_scaling_and_dynamic_scaling_recovers_them():
    # Every gradient 2**-30 times its usual size: below float16's smallest subnormal (6e-8).
    objective = _weighted(2.0**-30)
    reference = _grad_norm(_cfg("float32"), objective)
    assert reference > 0
    with pytest.warns(JaxllmWarning, match="loss_scale=none"):
        unscaled = _cfg("float16", loss_scale="none").validate()
    assert _grad_norm(unscaled, objective) < 1e-3 * reference  # flushed to zero
    # auto is dynamic for float16; a scale that brings the gradients back to their usual size
    # (S is per token: 2**30 times the 8 * 32 token positions of the batch)
    scaled = _grad_norm(_cfg("float16", loss_scale_init=2.0**38), objective)
    assert scaled == pytest.approx(reference, rel=0.05)


def test_a_step_that_overflows_backs_the_scale_off_and_changes_no_parameter():
    # 2**40 times the loss overflows float16 in the backward pass (max 65504).
    cfg = _cfg("float16", loss_scale_init=2.0**40, loss_scale_backoff=0.25)
    step, state, batch = _setup(cfg)
    state = state.replace(loss_scale=state.loss_scale.replace(good_steps=np.int32(7)))
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = step(state, batch)
    assert float(metrics["nonfinite"]) == 1.0 and float(metrics["loss_scale"]) == 2.0**40
    assert np.isfinite(float(metrics["loss"]))  # the forward pass was fine
    assert float(state.loss_scale.scale) == 2.0**38 and int(state.loss_scale.good_steps) == 0
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get((state.params, state.opt_state)), before
    )
    assert int(state.step) == 1

    # It keeps backing off until the gradients fit, then trains with a finite update.
    for _ in range(20):
        state, metrics = step(state, batch)
        if not float(metrics["nonfinite"]):
            break
    assert not float(metrics["nonfinite"]) and float(state.loss_scale.scale) < 2.0**38
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), jax.device_get(state.params), before[0]
    )
    assert all(jax.tree.leaves(changed))


def test_the_scale_grows_after_clean_steps_and_never_falls_below_one():
    scaling = loss_scale.LossScaling(
        dynamic=True, init=4.0, growth_interval=3, growth=2.0, backoff=0.5
    )
    state = scaling.initial()
    seen = []
    for finite in [True, True, True, True, False, True, True, True]:
        state = scaling.update(state, np.bool_(finite))
        seen.append((float(state.scale), int(state.good_steps)))
    assert seen == [(4, 1), (4, 2), (8, 0), (8, 1), (4, 0), (4, 1), (4, 2), (8, 0)]
    state = scaling.update(scaling.initial().replace(scale=np.float32(1.5)), np.bool_(False))
    assert float(state.scale) == 1.0  # the floor: below 1 scaling only shrinks gradients


@pytest.mark.slow  # ~25 s
def test_a_power_of_two_scale_is_exact_in_float32():
    """Scaling by 2**k and unscaling commute with every rounding of a float32 backward pass,
    so a scaled float32 run is bit-identical to an unscaled one, growth included."""
    runs = []
    for kw in ({}, dict(loss_scale="dynamic", loss_scale_growth_interval=2)):
        step, state, batch = _setup(_cfg("float32", **kw))
        metrics = []
        for _ in range(5):
            state, m = step(state, batch)
            metrics.append(m)
        runs.append((jax.device_get(state.params), [float(m["loss"]) for m in metrics]))
        if kw:
            assert [float(m["loss_scale"]) for m in metrics] == [
                2.0**15,
                2.0**15,
                2.0**16,
                2.0**16,
                2.0**17,
            ]
    jax.tree.map(np.testing.assert_array_equal, runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


FP16_RUN = [
    *SMALL_RUN,
    "model.dtype=float16",
    "optim.loss_scale_growth_interval=2",  # the scale moves within a few steps
    "checkpoint.every=2",
    # a schedule that does not depend on train.steps, so 4 + 2 steps are 6 steps
    "optim.schedule=constant",
    "optim.warmup_steps=0",
]


def _scales(run) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["loss_scale"]) for r in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.slow  # ~25 s; resuming bit-identically is tested by default in test_checkpoint
def test_the_scale_is_checkpointed_and_a_resume_is_bit_identical(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *FP16_RUN, "train.steps=6", f"run.dir={straight}"]) == 0
    assert main(["train", *FP16_RUN, "train.steps=4", f"run.dir={resumed}"]) == 0
    assert main(["train", *FP16_RUN, "train.steps=6", f"run.dir={resumed}"]) == 0
    logged = _scales(straight)
    assert logged == _scales(resumed)
    assert len({scale for _, _, scale in logged}) > 1, "the scale never moved"
    saved = loss_scale_item(resumed / "checkpoints" / "6")
    assert saved == loss_scale_item(straight / "checkpoints" / "6")


def loss_scale_item(step_dir) -> dict:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(step_dir.absolute() / "loss_scale")
    return {k: np.asarray(v).item() for k, v in restored.items()}


@pytest.mark.slow  # ~20 s
def test_a_checkpoint_without_a_scale_resumes_with_the_initial_one(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SMALL_RUN, "train.steps=2", f"run.dir={run}"]) == 0
    assert not (run / "checkpoints" / "2" / "loss_scale").exists()
    assert (
        main(["train", *SMALL_RUN, "train.steps=3", "optim.loss_scale=dynamic", f"run.dir={run}"])
        == 0
    )
    assert "the checkpoint has no loss scale; starting at 32768" in capsys.readouterr().err
    rows = read_jsonl(run / "metrics.jsonl")
    assert "loss_scale" not in rows[1] and rows[2]["loss_scale"] == 2.0**15


def _load(*overrides: str) -> config.Config:
    return config.load(None, overrides)


def test_loss_scale_config():
    assert loss_scale.from_config(_load().optim, _load().model) is None  # bfloat16: none
    fp16 = _load("model.dtype=float16")
    assert loss_scale.from_config(fp16.optim, fp16.model).dynamic
    static = _load("model.dtype=float16", "optim.loss_scale=static", "optim.loss_scale_init=128")
    scaling = loss_scale.from_config(static.optim, static.model)
    assert not scaling.dynamic and scaling.initial() is None and float(scaling.scale(None)) == 128
    with pytest.warns(JaxllmWarning, match="model.dtype=float16 with optim.loss_scale=none"):
        _load("model.dtype=float16", "optim.loss_scale=none")
    bad = {
        "optim.loss_scale_backoff=1.0": "optim.loss_scale_backoff must be in (0, 1)",
        "optim.loss_scale_growth_interval=0": "optim.loss_scale_growth_interval must be >= 1",
        "optim.loss_scale_growth=1.0": "optim.loss_scale_growth must be a finite number > 1",
        "optim.loss_scale_init=0.5": "never goes below 1",
    }
    for override, message in bad.items():
        with pytest.raises(config.ConfigError, match=re.escape(message)):
            _load("model.dtype=float16", override)
    with pytest.raises(config.ConfigError, match="loss_scale_init must be a finite number > 0"):
        _load("optim.loss_scale=static", "optim.loss_scale_init=-1")
    with pytest.raises(config.ConfigError, match="loss_scale"):
        _load("optim.loss_scale=sometimes")
    # A key that would do nothing is refused, naming what would make it count.
    with pytest.raises(config.ConfigError, match="loss_scale_backoff has no effect"):
        _load("optim.loss_scale_backoff=0.25")  # bfloat16: no scaling
    with pytest.raises(config.ConfigError, match="loss_scale_growth_interval has no effect"):
        _load("optim.loss_scale=static", "optim.loss_scale_growth_interval=10")
