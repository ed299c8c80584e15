"""`train.deterministic`: two CPU runs bit-identical, float32 matmuls traced at full precision,
XLA:GPU's determinism options set for a GPU compile only, and an XLA without them refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import SMALL_RUN, cpu_env

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.metrics import read_jsonl
from jaxllm.train import determinism, loss_scale
from jaxllm.train.compiled import compile_steps
from jaxllm.train.state import init_state, layout

REPO = Path(__file__).resolve().parents[1]


def test_two_deterministic_runs_on_cpu_are_bit_identical(tmp_path):
    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-m", "jaxllm", "train", *SMALL_RUN, "train.steps=4"]
            + ["train.deterministic=true", "optim.grad_noise=0.01", f"run.dir={run}"],
            cwd=REPO,
            env=cpu_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        runs.append([r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r])
    keys = ("loss", "grad_norm", "param_norm", "lr")
    first, second = ([[r[k] for k in keys] for r in rows] for rows in runs)
    assert len(first) == 4 and first == second  # exact: every float, every step


def _lowered(*overrides: str) -> str:
    cfg = config.load(None, [*SMALL_RUN, "model.num_layers=1", *overrides])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    jit_train, _, tx, _, _ = compile_steps(cfg, mesh)
    scaling = loss_scale.from_config(cfg.optim, cfg.model)
    state = jax.eval_shape(lambda: init_state(cfg.model, tx, mesh, 0, scaling, **layout(cfg)))
    batch = jax.tree.map(jnp.asarray, synthetic_batch(cfg))
    return jit_train.lower(state, batch).as_text()


def test_the_step_takes_float32_matmuls_at_full_precision():
    exact, plain = _lowered("train.deterministic=true"), _lowered()
    dots = len(re.findall(r"dot_general", exact))
    assert dots > 4 and dots == len(re.findall(r"dot_general", plain))
    assert len(re.findall("HIGHEST", exact)) >= dots  # both operands of every dot
    assert "HIGHEST" not in plain
    assert jax.config.jax_default_matmul_precision is None  # nothing set process-wide


def test_gpu_compiles_take_the_determinism_options_and_cpu_none(monkeypatch):
    assert determinism.compiler_options(True, "gpu") == {
        "xla_gpu_deterministic_ops": True,
        "xla_gpu_exclude_nondeterministic_ops": True,
    }
    assert determinism.compiler_options(True, "cpu") == {}
    assert determinism.compiler_options(False, "gpu") == {}
    for name in determinism.GPU_OPTIONS:  # XLA:CPU takes them too, so the names are real
        assert determinism.known_option(name), name
    monkeypatch.setattr(determinism, "known_option", lambda name: False)
    with pytest.raises(config.ConfigError, match=r"^train\.deterministic=true: this XLA") as e:
        determinism.compiler_options(True, "gpu")
    assert "\n" not in str(e.value)


def test_full_precision_only_when_asked():
    def f(a, b):
        return a @ b

    x = jnp.ones((4, 4))
    assert "HIGHEST" in jax.jit(determinism.full_precision(f, True)).lower(x, x).as_text()
    assert "HIGHEST" not in jax.jit(determinism.full_precision(f, False)).lower(x, x).as_text()
    assert determinism.full_precision(f, False) is f
