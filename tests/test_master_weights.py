"""Float32 master weights of bfloat16 parameters (`optim.master_weights`): the memory bill of
mixed-precision Adam (the seeds' 16 bytes per parameter) and updates that bfloat16 alone would
round away. Their offload to host memory: tests/test_offload.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import abstract_state

from jaxllm import config, optim
from jaxllm.plan import memory_bill


def test_mixed_precision_adam_is_the_16_bytes_per_parameter_rule():
    """bfloat16 weights and gradients, float32 master weights and two float32 moments."""
    mixed = ["model.param_dtype=bfloat16", "optim.master_weights=float32"]
    state, shardings, axes, _ = abstract_state(*mixed)
    bill = memory_bill(state, shardings, axes)
    psi = sum(p.size for p in jax.tree.leaves(state.params))
    assert bill["parameters"] == bill["gradients"] == 2 * psi
    assert bill["optimizer_state"] == pytest.approx(12 * psi, rel=1e-3)  # master 4 + m, v 8
    total = bill["parameters"] + bill["gradients"] + bill["optimizer_state"]
    assert total / psi == pytest.approx(16.0, rel=1e-3)
    master = state.opt_state.master["layers"]["mlp"]["up_proj"]
    assert master.dtype == jnp.float32
    assert (
        shardings.opt_state.master["layers"]["mlp"]["up_proj"]
        == (shardings.params["layers"]["mlp"]["up_proj"])
    )


def test_master_weights_keep_the_updates_bfloat16_rounds_away():
    """lr * g = 1e-4 per step is below half a bfloat16 step at 1.0 (2^-9): the parameters alone
    never move; with a float32 master they follow it, rounded."""
    params = {"w": jnp.ones((4,), jnp.bfloat16)}
    grads = {"w": jnp.ones((4,), jnp.bfloat16)}
    results = {}
    for master in ("none", "float32"):
        cfg = config.OptimConfig(
            name="sgd",
            lr=1e-4,
            schedule="constant",
            warmup_steps=0,
            weight_decay=0.0,
            clip_norm=None,
            master_weights=master,
        )
        tx = optim.build(cfg, total_steps=100)
        p, state = params, tx.init(params)
        for _ in range(100):
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        results[master] = p["w"], state
    assert results["none"][0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(results["none"][0], params["w"])
    w, state = results["float32"]
    assert w.dtype == jnp.bfloat16
    np.testing.assert_allclose(state.master["w"], 1.0 - 100 * 1e-4, rtol=1e-5)
    np.testing.assert_array_equal(w, state.master["w"].astype(jnp.bfloat16))
    assert float(w[0]) < 1.0


def test_master_weights_need_narrower_parameters():
    with pytest.raises(config.ConfigError, match="already float32"):
        config.load(None, ["optim.master_weights=float32"])
