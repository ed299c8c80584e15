"""The vision tower in `model.remat` and in `jaxllm plan`: the policy decides what the tower's
blocks save for the backward pass, and plan bills the tower's parameters, optimizer state
and the activations of an image budget."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_freeze import _cfg, vlm_model

from jaxllm.metrics import param_counts, vision_params
from jaxllm.model import abstract_model
from jaxllm.model.vision import VisionTower
from jaxllm.plan import format_plan, plan

GRIDS = [(1, 4, 4), (1, 4, 8)]


def _residuals(remat: str) -> int:
    """Bytes the tower's backward pass keeps from its forward under `remat`."""
    cfg = vlm_model().vision
    tower = VisionTower(cfg, remat=remat, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(tower)
    px = jnp.asarray(np.random.default_rng(0).normal(size=(48, 96)), jnp.float32)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(px, GRIDS) ** 2)

    _, backward = jax.vjp(loss, params)  # a pytree whose leaves are the saved residuals
    return sum(a.nbytes for a in jax.tree.leaves(backward))


def test_the_tower_follows_the_remat_policy():
    none, dots, full = (_residuals(r) for r in ("none", "dots", "full"))
    assert none > dots > full > 0, (none, dots, full)


@pytest.mark.slow
def test_plan_bills_the_vision_tower():
    vlm, text = _cfg(vlm_model()), _cfg(vlm_model(vision=None))
    _, params, _ = abstract_model(vlm.model)
    tower = sum(x.size for x in jax.tree.leaves(params["visual"]))
    assert vision_params(vlm.model.vision) == tower
    assert param_counts(vlm.model)["total"] == sum(x.size for x in jax.tree.leaves(params))
    cpu = jax.devices()[:1]
    r, t = plan(vlm, cpu, images=1), plan(text, cpu)
    assert r["params"] - t["params"] == tower and r["trainable"] - t["trainable"] == tower
    assert r["bill"]["parameters"] - t["bill"]["parameters"] == 4 * tower  # float32
    assert r["bill"]["optimizer_state"] - t["bill"]["optimizer_state"] == 8 * tower  # Adam
    vb = r["vision"]
    assert vb["params"] == tower and vb["parameters"] == 4 * tower
    assert vb["optimizer_state"] == 8 * tower and vb["activations"] > 0 and vb["trains"]
    assert t["vision"] is None and "vision tower: " in format_plan(r)
    # twice the images, more activations; a frozen tower keeps no optimizer state
    frozen = _cfg(vlm_model(), ("vision", "projector"))
    f = plan(frozen, cpu, images=2)
    assert f["vision"]["activations"] > vb["activations"] and not f["vision"]["trains"]
    assert f["vision"]["optimizer_state"] == 0 and f["trainable"] == t["trainable"]
    assert f["bill"]["optimizer_state"] == t["bill"]["optimizer_state"]
