"""Tests of jaxllm.optim: the learning-rate schedules, the weight-decay mask, and the optimizer
chain's behaviour (decay only on matrices, global-norm clipping on or off).

Adam normalises each update by the gradient's own scale, so clipping is observed over two steps:
a clipped huge gradient must leave the same Adam history as a unit one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxllm import optim
from jaxllm.config import OptimConfig

LR, MIN_RATIO, WARMUP, TOTAL = 1e-2, 0.1, 10, 100


def lr_at(cfg: OptimConfig, step: int, total: int = TOTAL) -> float:
    return float(optim.schedule(cfg, total)(step))


def sched_cfg(kind: str, **kw) -> OptimConfig:
    return OptimConfig(lr=LR, schedule=kind, warmup_steps=WARMUP, min_lr_ratio=MIN_RATIO, **kw)


# ------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_linearly_to_peak(kind):
    cfg = sched_cfg(kind)
    assert lr_at(cfg, 0) == 0.0
    assert lr_at(cfg, WARMUP // 2) == pytest.approx(LR / 2, rel=1e-5)
    assert lr_at(cfg, WARMUP) == pytest.approx(LR, rel=1e-5)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_schedule_decays_to_min_lr(kind):
    cfg = sched_cfg(kind)
    assert lr_at(cfg, TOTAL) == pytest.approx(MIN_RATIO * LR, rel=1e-5)
    assert lr_at(cfg, 10 * TOTAL) == pytest.approx(MIN_RATIO * LR, rel=1e-5)  # and stays there
    mid = lr_at(cfg, (WARMUP + TOTAL) // 2)
    assert MIN_RATIO * LR < mid < LR


def test_cosine_is_monotone_after_warmup():
    values = [lr_at(sched_cfg("cosine"), s) for s in range(WARMUP, TOTAL + 1)]
    assert all(b <= a for a, b in zip(values, values[1:]))
    assert values[0] > values[-1]


def test_constant_schedule_stays_at_peak():
    cfg = sched_cfg("constant")
    for step in (WARMUP, WARMUP + 1, TOTAL // 2, TOTAL - 1, TOTAL):
        assert lr_at(cfg, step) == pytest.approx(LR, rel=1e-6)


def test_schedule_without_warmup_starts_at_peak():
    assert lr_at(OptimConfig(lr=LR, warmup_steps=0), 0) == pytest.approx(LR, rel=1e-6)


# ------------------------------------------------------------------------- decay mask


def test_decay_mask_excludes_norm_scales_and_biases():
    x = jnp.ones((2, 2))
    params = {
        "layers": {
            "attn_norm": {"scale": x},
            "attn": {"q_proj": x, "o_proj": x, "sinks": x},  # sinks [N, H]: logits, not weights
            "mlp": {"up_proj": {"kernel": x, "bias": x}},
        },
        "final_norm": {"scale": x},
        "embed": {"embedding": x},
        "lm_head": x,
    }
    assert optim.decay_mask(params) == {
        "layers": {
            "attn_norm": {"scale": False},
            "attn": {"q_proj": True, "o_proj": True, "sinks": False},
            "mlp": {"up_proj": {"kernel": True, "bias": False}},
        },
        "final_norm": {"scale": False},
        "embed": {"embedding": True},
        "lm_head": True,
    }


# ------------------------------------------------------------------------- build


def build_cfg(**kw) -> OptimConfig:
    base = dict(lr=0.1, schedule="constant", warmup_steps=0, weight_decay=0.0, clip_norm=1.0)
    base.update(kw)
    return OptimConfig(**base)


def toy_params():
    return {
        "layers": {"attn": {"q_proj": jnp.ones((3, 4))}, "attn_norm": {"scale": jnp.ones((4,))}},
        "embed": {"embedding": jnp.ones((5, 4))},
    }


def unit_grad(seed=0):
    """A gradient tree with global L2 norm 1."""
    leaves, treedef = jax.tree.flatten(toy_params())
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    g = treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    return jax.tree.map(lambda x: x / optax.tree.norm(g), g)


def run_updates(cfg: OptimConfig, grads: list) -> list:
    """The updates `build(cfg)` produces for a sequence of gradients (params held fixed)."""
    tx = optim.build(cfg, total_steps=10)
    params = toy_params()
    state = tx.init(params)
    out = []
    for g in grads:
        upd, state = tx.update(g, state, params)
        out.append(upd)
    return out


def trees_close(a, b, **tol) -> bool:
    return all(np.allclose(x, y, **tol) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def scaled(tree, s):
    return jax.tree.map(lambda x: s * x, tree)


def test_weight_decay_shrinks_matrices_but_not_norm_scales():
    params = toy_params()
    tx = optim.build(build_cfg(weight_decay=0.5), total_steps=10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    upd, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, upd)
    # decoupled decay: p - lr * wd * p = 0.95 p; the scale gets no decay and no gradient
    np.testing.assert_allclose(new["layers"]["attn"]["q_proj"], 0.95, rtol=1e-6)
    np.testing.assert_allclose(new["embed"]["embedding"], 0.95, rtol=1e-6)
    np.testing.assert_array_equal(new["layers"]["attn_norm"]["scale"], 1.0)


def test_update_follows_the_schedule():
    # with warmup the first step's lr is 0; without, Adam's first step is lr * sign(g)
    g = unit_grad()
    (warm,) = run_updates(build_cfg(warmup_steps=5), [g])
    assert all(np.all(x == 0) for x in jax.tree.leaves(warm))
    (first,) = run_updates(build_cfg(), [g])
    for u, gl in zip(jax.tree.leaves(first), jax.tree.leaves(g)):
        np.testing.assert_allclose(u, -0.1 * np.sign(gl), rtol=1e-4)


def test_clipping_rescales_huge_gradients_to_the_clip_norm():
    g = unit_grad()
    huge = run_updates(build_cfg(clip_norm=1.0), [scaled(g, 1e4), g])
    unit = run_updates(build_cfg(clip_norm=1.0), [g, g])
    for a, b in zip(huge, unit):
        assert trees_close(a, b, rtol=1e-5, atol=1e-7)


def test_clipping_leaves_small_gradients_alone():
    # a gradient already inside the clip norm must not be scaled up to it
    g = unit_grad()
    grads = [scaled(g, 0.1), g]
    clipped = run_updates(build_cfg(clip_norm=1.0), grads)
    unclipped = run_updates(build_cfg(clip_norm=None), grads)
    for a, b in zip(clipped, unclipped):
        assert trees_close(a, b, rtol=1e-5, atol=1e-7)


def test_no_clip_norm_means_no_clipping():
    # unclipped, a huge first gradient dominates Adam's second moment and shrinks the next update
    g = unit_grad()
    huge = run_updates(build_cfg(clip_norm=None), [scaled(g, 1e4), g])
    unit = run_updates(build_cfg(clip_norm=None), [g, g])
    assert trees_close(huge[0], unit[0], rtol=1e-5)  # Adam's first step ignores the scale
    assert not trees_close(huge[1], unit[1], rtol=1e-2)
    assert float(optax.tree.norm(huge[1])) < 0.9 * float(optax.tree.norm(unit[1]))
