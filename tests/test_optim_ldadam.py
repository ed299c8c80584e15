"""LDAdam against a plain-numpy version of its update; CAME, LDAdam, GaLore and Q-GaLore: sharded
steps over fsdp x tensor (4 x 2) equal to one device, their state bytes per parameter in `plan`
from the shapes, and their keys' checks."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from conftest import abstract_state
from test_optim_came_galore import AXES, MATRIX, SHAPES, _adam, _canonical, _grads, _matrices

from jaxllm import config, optim, sharding
from jaxllm.optim import came, galore, ldadam
from jaxllm.plan import memory_bill
from jaxllm.train.state import opt_state_shardings

NEW = ["came", "ldadam", "galore", "q_galore"]


def _numpy_ldadam(grads_seq, rank, b1, b2, eps):
    """Robert et al. 2024 as in the authors' code, per matrix (left projection when m < n):
    subspace from rho * previous momentum + (1 - rho) * (g + error), rho = b1 (an exact SVD);
    projection-aware moments; the error keeps the dropped gradient and the dropped momentum."""
    adam, st, out = {}, {}, []
    for t, grads in enumerate(grads_seq, start=1):
        step = {}
        c1p, c2p = (1 - b1 ** (t - 1), 1 - b2 ** (t - 1)) if t > 1 else (1.0, 1.0)
        for k, g in grads.items():
            if k not in MATRIX:
                step[k] = _adam(adam, k, g, t, b1, b2, eps)
                continue
            mats, back = _matrices(g.astype(np.float64), MATRIX[k])
            res, errs = [], []
            for i, x in enumerate(mats):
                m_dim, n_dim = x.shape
                left, r = m_dim < n_dim, min(rank, m_dim, n_dim)
                lo = (r, n_dim) if left else (m_dim, r)
                p0, m0, v0, e0 = st.get((k, i), (None, np.zeros(lo), np.zeros(lo), 0.0))
                a = x + e0
                if p0 is None:
                    p0, y = np.zeros((m_dim if left else n_dim, r)), a
                else:
                    prev = p0 @ m0 if left else m0 @ p0.T
                    y = b1 * prev / c1p + (1 - b1) * a
                u, _, vt = np.linalg.svd(y, full_matrices=False)
                p = _canonical(u[:, :r] if left else vt[:r].T)
                low = p.T @ a if left else a @ p
                c = p.T @ p0 if left else p0.T @ p
                m1 = c @ m0 if left else m0 @ c
                core = v0 / c2p - m0**2 / c1p**2
                v1 = np.abs(
                    c2p * ((c * c) @ core if left else core @ (c * c)) + c2p * m1**2 / c1p**2
                )
                full = lambda z, p=p, left=left: p @ z if left else z @ p.T  # noqa: E731
                full0 = p0 @ m0 if left else m0 @ p0.T
                e = a - full(low) + b1 / (1 - b1) * (full0 - full(m1))
                m = b1 * m1 + (1 - b1) * low
                v = b2 * v1 + (1 - b2) * low**2
                st[k, i] = (p, m, v, e)
                res.append(full((m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)))
                errs.append(e)
            step[k] = back(np.stack(res))
        out.append(step)
    return out


@pytest.mark.parametrize("rank", [2, 100])  # 100: full rank, the error buffer stays ~0
def test_ldadam_matches_numpy_reference(rank):
    grads_seq = _grads(5, 5)
    tx = ldadam.scale_by_ldadam(AXES, rank, 0.9, 0.95, 1e-8)
    state = tx.init({k: np.zeros(s, np.float32) for k, s in SHAPES.items()})
    for grads, want in zip(grads_seq, _numpy_ldadam(grads_seq, rank, 0.9, 0.95, 1e-8)):
        got, state = tx.update(grads, state)
        for k in SHAPES:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-3, atol=2e-5, err_msg=k)
    assert state.err["w"].shape == SHAPES["w"] and state.mu["w"].shape[1] == min(rank, 6)


# ------------------------------------------------------------------------- sharded == 1 device

# the model's kinds of kernels, with dims every mesh axis divides
SH_AXES = {
    "layers": {
        "q_proj": ("layers", "embed", "heads", "head_dim"),
        "o_proj": ("layers", "heads", "head_dim", "embed"),
        "up_proj": ("layers", "embed", "mlp"),
        "down_proj": ("layers", "mlp", "embed"),
        "scale": ("layers", "norm"),
    },
    "embedding": ("vocab", "embed"),
}
SH_SHAPES = {
    "layers": {
        "q_proj": (2, 16, 2, 4),
        "o_proj": (2, 2, 4, 16),
        "up_proj": (2, 16, 24),
        "down_proj": (2, 24, 16),
        "scale": (2, 16),
    },
    "embedding": (12, 16),
}
is_axes = lambda x: isinstance(x, tuple)  # noqa: E731


@pytest.mark.parametrize("name", NEW)
def test_sharded_steps_equal_single_device_steps(name):
    """Three jitted steps with parameters and state split over fsdp x tensor (4 x 2), a
    projection refresh between them, give the single-device result."""
    keys = iter(jax.random.split(jax.random.key(7), 16))
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s), SH_SHAPES, is_leaf=is_axes)
    targets = jax.tree.map(lambda s: jax.random.normal(next(keys), s), SH_SHAPES, is_leaf=is_axes)
    cfg = config.OptimConfig(name=name, lr=0.01, schedule="constant", warmup_steps=0)
    if name != "came":
        cfg = dataclasses.replace(cfg, galore_rank=4)
    if "galore" in name:
        cfg = dataclasses.replace(cfg, galore_update_gap=2)
    tx = optim.build(cfg, total_steps=10, axes=SH_AXES)
    mesh = sharding.make_mesh(config.MeshConfig(data=1, fsdp=4, tensor=2), jax.devices())
    param_sh = sharding.tree_shardings(mesh, SH_AXES)
    opt_sh = opt_state_shardings(tx, jax.eval_shape(lambda: params), param_sh)

    def steps(params):
        state = tx.init(params)
        for _ in range(3):
            grads = jax.tree.map(lambda p, t: 2 * (p - t), params, targets)
            updates, state = tx.update(grads, state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
        return params, state

    want = jax.jit(steps)(params)
    got = jax.jit(steps, in_shardings=(param_sh,), out_shardings=(param_sh, opt_sh))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if a.dtype in (np.int8, np.uint8):  # rounding codes: at most one step apart
            assert np.mean(np.asarray(a) != np.asarray(b)) < 0.01
            continue
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-4, atol=1e-5
        )
    # no state leaf larger than a dim is replicated
    for leaf, sh in zip(jax.tree.leaves(got[1]), jax.tree.leaves(opt_sh)):
        assert leaf.size <= 24 or not sh.is_fully_replicated, (name, leaf.shape)


# ------------------------------------------------------------------------- plan's bytes


def _expected(name, params, axes, rank):
    """Bytes of optimizer state per parameter, from the shapes: per matrix (its smaller side q,
    larger p, r = min(rank, q), per stacked slice) and 8 (Adam) for the rest."""
    total = n = 0
    for p, ax in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=is_axes)):
        n += p.size
        d = galore.matrix_dims(ax)
        if name == "came":
            dims = came.factored_dims(ax, p.shape)
            if dims is None:
                total += 8 * p.size
            else:
                r, c = dims
                total += 4 * p.size + 8 * p.size // p.shape[c] + 8 * p.size // p.shape[r]
            continue
        if d is None:
            total += 8 * p.size
            continue
        stack = math.prod(p.shape[i] for i in d.stacked)
        m, k = (math.prod(p.shape[i] for i in dd) for dd in (d.red, d.out))
        q, big = min(m, k), max(m, k)
        r = min(rank, q)
        if name == "galore":
            total += stack * 4 * (q * r + 2 * big * r)
        elif name == "ldadam":
            total += stack * 4 * (q * r + 2 * big * r) + 4 * p.size
        else:  # packed int4 P + a scale per column; int8 weights + a scale per row of 256
            total += stack * (q * math.ceil(r / 2) + 4 * r + 8 * big * r)
            total += p.size + 4 * (p.size // p.shape[-1]) * math.ceil(p.shape[-1] / 256)
    return total / n


@pytest.mark.parametrize(
    "name,rank",
    [("came", 128), ("ldadam", 128), ("galore", 128), ("galore", 32), ("q_galore", 128)],
)
def test_state_bytes_per_parameter_match_the_shapes(name, rank):
    extra = [] if name == "came" else [f"optim.galore_rank={rank}"]
    state, shardings, axes = abstract_state(f"optim.name={name}", *extra)[:3]
    bill = memory_bill(state, shardings, axes)
    want = _expected(name, state.params, axes, rank)
    assert bill["opt_bytes_per_param"] == pytest.approx(want, abs=1e-4), (name, want)


# ------------------------------------------------------------------------- config


def test_new_keys_are_checked():
    bad = [
        (["optim.name=galore", "optim.galore_rank=0"], "galore_rank and"),
        (["optim.name=galore", "optim.galore_update_gap=0"], "galore_update_gap must be"),
        (["optim.name=q_galore", "optim.galore_scale=0"], "galore_scale must be"),
        (["optim.name=came", "optim.came_b3=1"], "came_b3 must be in"),
        (["optim.name=came", "optim.galore_rank=8"], "galore_rank does nothing"),
        (["optim.name=ldadam", "optim.galore_update_gap=8"], "galore_update_gap does nothing"),
        (["optim.came_b3=0.99"], "came_b3 does nothing with optim.name=adamw"),
    ]
    for overrides, message in bad:
        with pytest.raises(config.ConfigError, match=message):
            config.load(None, overrides)
    cfg = config.load(None, ["optim.name=ldadam", "optim.galore_rank=16"])
    assert cfg.optim.galore_rank == 16


# ------------------------------------------------------------------------- resume


# about 40 s each on 2 CPU cores (-m slow): a resume across a projection refresh
@pytest.mark.slow
@pytest.mark.parametrize("name", ["came"])
def test_resume_is_bit_identical(tmp_path, name):
    from test_optimizers import RUN, _losses

    from jaxllm.cli import main

    args = [*RUN, f"optim.name={name}"]
    if name != "came":
        args += ["optim.galore_rank=8"] + (
            ["optim.galore_update_gap=3"] if "galore" in name else []
        )
    assert main(["train", *args, "train.steps=4", f"run.dir={tmp_path / 'straight'}"]) == 0
    assert main(["train", *args, "train.steps=2", f"run.dir={tmp_path / 'cut'}"]) == 0
    assert main(["train", *args, "train.steps=4", f"run.dir={tmp_path / 'cut'}"]) == 0
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "straight")
    assert len(_losses(tmp_path / "cut")) == 4
