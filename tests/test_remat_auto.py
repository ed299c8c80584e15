"""`model.remat=auto` with `train.memory_budget`: the first policy, least recomputation first,
whose compiled train step fits the budget (`jaxllm.train.remat_auto`). The budgets are taken
from the memory each policy's step measures here, so the test holds whatever XLA plans."""

import functools

import jax
import pytest
import yaml
from conftest import SMALL_RUN

from jaxllm import config, sharding
from jaxllm.cli import main
from jaxllm.model.remat import AUTO_ORDER
from jaxllm.plan import fmt_bytes as _size
from jaxllm.plan import format_plan, parse_bytes, plan
from jaxllm.train import remat_auto

AUTO = ["model.remat=auto", "train.device_memory=64GiB"]


def _cfg(*overrides):
    cfg = config.load(None, [*SMALL_RUN, *AUTO, *overrides])
    return cfg.validate(1), sharding.make_mesh(cfg.mesh, jax.devices()[:1])


def test_budgets_force_each_policy_and_the_choice_is_said():
    cfg, mesh = _cfg()
    measure = functools.cache(lambda c, m: remat_auto.step_bytes(c, m))
    mem = {name: measure(remat_auto.with_remat(cfg, name), mesh) for name in AUTO_ORDER}
    assert mem["none"] > mem["dots"] > mem["full"], mem  # remat does save memory here
    chosen = set()
    for name in AUTO_ORDER:
        expected = next(p for p in AUTO_ORDER if mem[p] <= mem[name])  # the first that fits
        assert remat_auto.choose(cfg, mesh, mem[name], measure) == (expected, mem[expected])
        chosen.add(expected)
    assert {"none", "dots_with_no_batch_dims", "full"} <= chosen
    assert chosen & {"dots_attention", "dots"}
    with pytest.raises(config.ConfigError, match="even full needs"):
        remat_auto.choose(cfg, mesh, mem["full"] - 1, measure)
    lines = []  # the budget is memory_budget x device_memory
    budget = mem["dots"] / 2**30 / 64
    cfg, mesh = _cfg(f"train.memory_budget={budget}")
    resolved = remat_auto.resolve(cfg, mesh, log=lines.append, measure=measure)
    assert resolved.model.remat == "dots_attention" and resolved.train == config.TrainConfig(
        **{**cfg.train.__dict__, "memory_budget": 0.9, "device_memory": None}
    )
    assert lines == [
        f"model.remat=auto: chose dots_attention ({_size(mem['dots'])} of "
        f"{_size(int(budget * 64 * 2**30))})"
    ]


def test_train_records_the_chosen_policy(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SMALL_RUN, *AUTO, "train.steps=1", f"run.dir={run}"]) == 0
    assert "model.remat=auto: chose none (" in capsys.readouterr().err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["remat"] == "none"
    assert config.TrainConfig.memory_budget == saved["train"]["memory_budget"]


def test_a_budget_under_the_state_exits_2_in_one_line(tmp_path, capsys):
    argv = ["train", *SMALL_RUN, "model.remat=auto", "train.device_memory=64KiB"]
    assert main([*argv, f"run.dir={tmp_path / 'run'}"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("jaxllm:")]
    assert len(err) == 1 and "model.remat=auto: the train state alone needs" in err[0]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.remat=auto", "train.memory_budget=1.5"], "train.memory_budget must be in (0, 1]"),
        (["model.remat=dots", "train.memory_budget=0.5"], "no effect with model.remat=dots"),
        (["train.device_memory=80GiB"], "no effect with model.remat=none"),
        (["model.remat=auto", "train.device_memory=lots"], "train.device_memory 'lots'"),
    ],
)
def test_budget_keys_are_checked(overrides, words):
    with pytest.raises(config.ConfigError) as e:
        config.load(None, overrides)
    assert words in str(e.value)


def test_a_cpu_without_device_memory_is_told_to_give_it():
    cfg, mesh = _cfg("train.device_memory=null")
    with pytest.raises(config.ConfigError, match="train.device_memory"):
        remat_auto.resolve(cfg, mesh)


def test_plan_takes_auto_with_hbm_and_reports_the_choice():
    cfg = config.load(None, [*SMALL_RUN, "model.remat=auto", "mesh.fsdp=1"])
    report = plan(cfg, jax.devices()[:1], parse_bytes("64GiB"))
    assert report["remat_auto"].startswith("model.remat=auto: chose none (")
    assert report["remat_auto"].endswith(f"of {_size(int(0.9 * 64 * 2**30))})")
    assert report["remat_auto"] in format_plan(report) and report["fits"]


def test_auto_compiles_the_step_of_an_objective_with_its_own_arrays():
    """Prefix LM's rows carry a `prefix`: the abstract batch of the step has it too."""
    cfg, mesh = _cfg("train.objective=prefix_lm", "train.memory_budget=0.5")
    assert remat_auto.resolve(cfg, mesh, log=lambda line: None).model.remat == "none"
