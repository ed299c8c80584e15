"""ZeRO stages 1 and 2 (`mesh.zero_stage`) over the `data` axis: the memory bill per device on 8
devices against the ZeRO paper's table, the shardings, and the config errors. That stages 1
and 2 train as one device does: tests/test_sharding.py (dp8_zero2, dp2_fsdp2_tp2_zero1)."""

import jax
import numpy as np
import pytest
from conftest import abstract_state

from jaxllm import config, optim, sharding
from jaxllm.model import abstract_model
from jaxllm.plan import memory_bill
from jaxllm.train.state import grad_shardings, state_shardings

# psi = parameter count, N = 8 devices; float32 parameters and AdamW: bytes per device / psi
N = 8
TABLE = {  # setup -> (mesh overrides, parameters, gradients, optimizer state)
    "plain DP": (["mesh.data=8"], 4, 4, 8),
    "stage 1": (["mesh.data=8", "mesh.zero_stage=1"], 4, 4, 8 / N),
    "stage 2": (["mesh.data=8", "mesh.zero_stage=2"], 4, 4 / N, 8 / N),
    "stage 3 (fsdp)": (["mesh.data=1", "mesh.fsdp=8"], 4 / N, 4 / N, 8 / N),
}


@pytest.mark.parametrize("setup", list(TABLE))
def test_bill_per_device_matches_the_zero_table(setup):
    overrides, want_params, want_grads, want_opt = TABLE[setup]
    state, shardings, axes, grad_sh = abstract_state(*overrides, "model.dtype=float32")
    bill = memory_bill(state, shardings, axes, grad_sh)
    psi = sum(p.size for p in jax.tree.leaves(state.params))
    got = [bill["parameters"] / psi, bill["gradients"] / psi, bill["optimizer_state"] / psi]
    np.testing.assert_allclose(got, [want_params, want_grads, want_opt], rtol=0.10)


def test_zero_keeps_parameters_whole_and_splits_state_over_data():
    cfg = config.load(None, ["mesh.data=4", "mesh.tensor=2", "mesh.zero_stage=2"]).validate(N)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    _, _, axes = abstract_model(cfg.model)
    tx = optim.build(cfg.optim, 10, axes)
    sh = state_shardings(cfg.model, tx, mesh, zero_stage=2)
    up, up_mu = sh.params["layers"]["mlp"]["up_proj"], sh.opt_state[1][0].mu["layers"]["mlp"]
    assert "data" not in jax.tree.leaves(tuple(up.spec))  # whole on every data replica
    # the moment keeps the parameter's tensor axis and adds data on the largest dim it divides
    assert "data" in jax.tree.leaves(tuple(up_mu["up_proj"].spec))
    assert "tensor" in jax.tree.leaves(tuple(up_mu["up_proj"].spec))
    grads = grad_shardings(cfg.model, mesh, 2)["layers"]["mlp"]["up_proj"]
    assert grads == up_mu["up_proj"]
    assert grad_shardings(cfg.model, mesh, 1)["layers"]["mlp"]["up_proj"] == up


def test_config_errors():
    with pytest.raises(config.ConfigError, match="mesh.zero_stage=1 shards over mesh.data"):
        config.load(None, ["mesh.data=1", "mesh.fsdp=8", "mesh.zero_stage=1"]).validate(N)
    with pytest.raises(config.ConfigError, match="mesh.zero_stage must be one of 0, 1, 2"):
        config.load(None, ["mesh.zero_stage=3"])
