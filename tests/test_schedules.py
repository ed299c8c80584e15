"""The learning-rate schedules against their closed forms (step, exponential, SGDR beside the
warmup + cosine / linear / constant ones), the stability knobs (clip_value, annealed gradient
noise) by their effect on an update, and lr_scaling's values."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import optim
from jaxllm.config import OptimConfig
from jaxllm.config.optim import resolved_lr

STEPS = 100


def _values(cfg: OptimConfig, steps: int = STEPS) -> np.ndarray:
    f = jax.jit(optim.schedule(cfg, steps))
    return np.array([float(f(jnp.int32(t))) for t in range(steps)])


def _warmup(cfg: OptimConfig, t: int) -> float:
    return cfg.lr * t / cfg.warmup_steps


@pytest.mark.parametrize("schedule", ["step", "exponential"])
def test_step_and_exponential_decay_follow_their_closed_forms(schedule):
    cfg = OptimConfig(
        lr=1.0, warmup_steps=5, schedule=schedule, decay_every=10, decay_rate=0.7, min_lr_ratio=0.05
    )
    got = _values(cfg)
    for t in range(STEPS):
        if t < 5:
            want = _warmup(cfg, t)
        else:
            k = (t - 5) / 10
            want = max(0.7 ** (math.floor(k) if schedule == "step" else k), 0.05)
        assert got[t] == pytest.approx(want, rel=1e-5), t
    assert got[-1] == pytest.approx(0.05)  # the floor, reached
    if schedule == "step":  # flat between decays, a drop of exactly decay_rate at each
        assert got[5] == got[14] and got[15] == pytest.approx(0.7 * got[14])


@pytest.mark.parametrize("mult", [1.0, 2.0, 1.5])
def test_cosine_restarts_is_sgdr(mult):
    cfg = OptimConfig(
        lr=2.0, warmup_steps=4, schedule="cosine_restarts", restart_steps=8, restart_mult=mult
    )
    got = _values(cfg)
    end = 2.0 * cfg.min_lr_ratio
    start, length, restarts = 0.0, 8.0, []
    for t in range(4, STEPS):
        s = t - 4
        while s >= start + length:
            start, length = start + length, length * mult
            restarts.append(t)
        cur = s - start
        want = end + (2.0 - end) * 0.5 * (1 + math.cos(math.pi * cur / length))
        assert got[t] == pytest.approx(want, rel=1e-5, abs=1e-6), t
    for t in restarts:  # each restart returns to the peak from near the bottom
        assert got[t] == pytest.approx(2.0) and got[t - 1] < 0.5
    assert len(restarts) == {1.0: 11, 2.0: 3, 1.5: 4}[mult]


def test_the_first_schedules_keep_their_shapes():
    base = dict(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    cos = _values(OptimConfig(schedule="cosine", **base))
    lin = _values(OptimConfig(schedule="linear", **base))
    const = _values(OptimConfig(schedule="constant", **base))
    for t in range(10, STEPS):
        u = (t - 10) / 90
        assert cos[t] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * u)), rel=1e-5)
        assert lin[t] == pytest.approx(1.0 - 0.9 * u, rel=1e-5)
        assert const[t] == 1.0
    assert cos[5] == lin[5] == const[5] == pytest.approx(0.5)


def _update(cfg: OptimConfig, grads, steps: int = 1):
    """The sgd updates (lr 1, constant: the processed gradient, negated) of `steps` steps."""
    tx = optim.build(cfg, 10)
    params = jax.tree.map(jnp.zeros_like, grads)
    state, out = tx.init(params), []
    for _ in range(steps):
        u, state = tx.update(grads, state, params)
        out.append(jax.tree.map(lambda x: -np.asarray(x), u))
    return out


SGD = dict(name="sgd", lr=1.0, schedule="constant", warmup_steps=0, weight_decay=0.0)


def test_clip_value_clips_each_element_before_the_norm():
    g = {"w": jnp.array([0.5, -3.0, 2.0, -0.1])}
    (plain,) = _update(OptimConfig(**SGD, clip_norm=None), g)
    np.testing.assert_array_equal(plain["w"], g["w"])
    (by_value,) = _update(OptimConfig(**SGD, clip_norm=None, clip_value=1.0), g)
    np.testing.assert_array_equal(by_value["w"], np.float32([0.5, -1.0, 1.0, -0.1]))
    (both,) = _update(OptimConfig(**SGD, clip_norm=1.0, clip_value=1.0), g)
    clipped = np.array([0.5, -1.0, 1.0, -0.1])
    np.testing.assert_allclose(both["w"], clipped / np.linalg.norm(clipped), rtol=1e-6)


def test_grad_noise_variance_anneals_and_off_changes_nothing():
    g = {"w": jnp.full((20000,), 0.25), "b": jnp.zeros((3,))}
    cfg = OptimConfig(**SGD, clip_norm=None)
    for u in _update(cfg, g, steps=2):  # off: the gradient itself, no state, no noise
        np.testing.assert_array_equal(u["w"], g["w"])
    noisy = OptimConfig(**SGD, clip_norm=None, grad_noise=0.3, grad_noise_gamma=0.55)
    off_state = jax.tree.leaves(optim.build(cfg, 10).init(g))
    assert len(jax.tree.leaves(optim.build(noisy, 10).init(g))) == len(off_state) + 2
    assert all(x.dtype != jnp.uint32 for x in off_state)  # off: no noise key kept
    ups = _update(noisy, g, steps=6)
    for t, u in enumerate(ups):  # variance eta / (1 + t)^gamma around the gradient
        noise = u["w"] - 0.25
        want = 0.3 / (1 + t) ** 0.55
        assert abs(noise.mean()) < 4 * math.sqrt(want / noise.size)
        assert noise.var() == pytest.approx(want, rel=0.05), t
    assert ups[0]["w"].var() > ups[5]["w"].var() * 2
    assert not np.array_equal(ups[0]["w"], ups[1]["w"])  # fresh noise every step
    again = _update(noisy, g, steps=1)[0]  # the same seed: the same draws
    np.testing.assert_array_equal(again["w"], ups[0]["w"])
    other = optim.build(noisy, 10, seed=1)
    u1, _ = other.update(g, other.init(g), g)
    assert not np.array_equal(-np.asarray(u1["w"]), ups[0]["w"])


@pytest.mark.parametrize(
    ("rule", "batch", "want"),
    [("linear", 64, 4e-3), ("linear", 8, 5e-4), ("sqrt", 64, 2e-3), ("sqrt", 4, 5e-4)],
)
def test_lr_scaling_scales_the_peak_and_so_the_schedule(rule, batch, want):
    cfg = OptimConfig(lr=1e-3, lr_scaling=rule, reference_batch_size=16, warmup_steps=10)
    assert resolved_lr(cfg, batch) == pytest.approx(want)
    resolved = optim.resolve(cfg, batch)
    assert resolved.lr == pytest.approx(want) and resolved.lr_scaling == "none"
    np.testing.assert_allclose(
        _values(resolved), _values(OptimConfig(lr=want, warmup_steps=10)), rtol=1e-6
    )
    assert optim.resolve(OptimConfig(lr=1e-3), batch).lr == 1e-3  # none: as given
