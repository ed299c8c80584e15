"""SOAP and Shampoo (`optim.name=soap|shampoo`) against plain-NumPy (float64) versions of their
papers' updates, the same steps on 1 device and on fsdp4 x tensor2, their state bytes per
parameter as `jaxllm plan` bills them, their config checks; and AMSGrad (`optim.amsgrad`)
normalising by the running maximum of the second moment.

The matrices here are square and the gradients random, so the preconditioners' statistics have
full rank from the first step: a rank-deficient statistic has no unique eigenbasis on its null
space (SOAP) and float32 rounding decides there."""

import jax
import numpy as np
import pytest
from conftest import abstract_state

from jaxllm import config, optim, sharding
from jaxllm.optim import shampoo, soap
from jaxllm.plan import memory_bill
from jaxllm.train.state import opt_state_shardings

# every kernel already in (batch, rows, cols) order, so the reference needs only a reshape
AXES = {
    "q": ("layers", "embed", "heads", "head_dim"),  # 8 x (2 * 4) per layer
    "o": ("layers", "heads", "head_dim", "embed"),  # (2 * 4) x 8 per layer
    "w": ("embed", "mlp"),  # one 8 x 8 matrix
    "e": ("vocab", "embed"),  # embedding: Adam
    "n": ("layers", "norm"),  # vectors: Adam
}
SHAPES = {"q": (2, 8, 2, 4), "o": (2, 2, 4, 8), "w": (8, 8), "e": (16, 8), "n": (2, 8)}
B1, B2, EPS = 0.9, 0.95, 1e-8


def _grads(steps, seed=0):
    """Random gradients, the 8 x 8 matrices among them well conditioned (noise + 4 I: an
    ill-conditioned G G^T would test float32's eigh instead of the update)."""
    rng = np.random.default_rng(seed)

    def one(k, s, scale):
        g = rng.normal(size=s)
        if k not in ("e", "n"):
            g = (g.reshape(-1, 8, 8) + 4 * np.eye(8)).reshape(s)
        return (g * scale).astype(np.float32)

    return [{k: one(k, s, 10.0 ** (t % 3 - 1)) for k, s in SHAPES.items()} for t in range(steps)]


def _mat(x):
    return x.reshape(-1, *x.shape[-2:]) if x.ndim == 3 else x.reshape(-1, 8, 8)


def _adam(m, v, g, t):
    m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
    return (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS), m, v


def _numpy_soap(grads_seq, every):
    """Vyas et al. 2024, Algorithm 3 with the code's first step (statistics only) and one
    eigh per refresh; float64."""
    st, out = {}, []
    for t, grads in enumerate(grads_seq, start=1):
        step = {}
        for k, g in grads.items():
            g = g.astype(np.float64)
            s = st.setdefault(k, {"m": np.zeros_like(g), "v": np.zeros_like(g)})
            if k in ("e", "n"):  # Adam, also from the second step on
                step[k] = np.zeros_like(g)
                if t > 1:
                    step[k], s["m"], s["v"] = _adam(s["m"], s["v"], g, t - 1)
                continue
            gm = _mat(g)
            if t > 1:
                ql, qr = s["ql"], s["qr"]
                rot = lambda x: np.swapaxes(ql, 1, 2) @ x @ qr  # noqa: E731, B023
                s["m"] = B1 * s["m"] + (1 - B1) * g
                s["v"] = B2 * s["v"] + (1 - B2) * (rot(gm) ** 2).reshape(g.shape)
                n = (rot(_mat(s["m"])) / (1 - B1 ** (t - 1))) / (
                    np.sqrt(_mat(s["v"]) / (1 - B2 ** (t - 1))) + EPS
                )
                step[k] = (ql @ n @ np.swapaxes(qr, 1, 2)).reshape(g.shape)
            else:
                step[k] = np.zeros_like(g)
            s["l"] = B2 * s.get("l", 0) + (1 - B2) * gm @ np.swapaxes(gm, 1, 2)
            s["r"] = B2 * s.get("r", 0) + (1 - B2) * np.swapaxes(gm, 1, 2) @ gm
            if (t - 1) % every == 0:
                s["ql"], s["qr"] = np.linalg.eigh(s["l"])[1], np.linalg.eigh(s["r"])[1]
        out.append(step)
    return out


def _root(a):
    w, q = np.linalg.eigh(a)
    w = np.maximum(w, 0)
    w = (w + shampoo.RIDGE * w.max(-1, keepdims=True) + 1e-30) ** -0.25
    return (q * w[:, None, :]) @ np.swapaxes(q, 1, 2)


def _numpy_shampoo(grads_seq, every):
    """Gupta et al. 2018 (L += G G^T, R += G^T G, L^-1/4 G R^-1/4, roots every `every` steps)
    with Adam grafting per matrix and momentum; float64."""
    st, out = {}, []
    for t, grads in enumerate(grads_seq, start=1):
        step = {}
        for k, g in grads.items():
            g = g.astype(np.float64)
            s = st.setdefault(k, {"m": np.zeros_like(g), "v": np.zeros_like(g)})
            if k in ("e", "n"):
                step[k], s["m"], s["v"] = _adam(s["m"], s["v"], g, t)
                continue
            gm = _mat(g)
            s["l"] = s.get("l", 0) + gm @ np.swapaxes(gm, 1, 2)
            s["r"] = s.get("r", 0) + np.swapaxes(gm, 1, 2) @ gm
            if (t - 1) % every == 0:
                s["pl"], s["pr"] = _root(s["l"]), _root(s["r"])
            s["v"] = B2 * s["v"] + (1 - B2) * g * g
            graft = _mat(g / (np.sqrt(s["v"] / (1 - B2**t)) + EPS))
            d = s["pl"] @ gm @ s["pr"]
            norm = lambda x: np.sqrt((x * x).sum(axis=(1, 2), keepdims=True))  # noqa: E731
            s["m"] = B1 * s["m"] + (1 - B1) * (d * norm(graft) / norm(d)).reshape(g.shape)
            step[k] = s["m"] / (1 - B1**t)
        out.append(step)
    return out


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_update_matches_numpy_reference(name, every):
    make = soap.scale_by_soap if name == "soap" else shampoo.scale_by_shampoo
    tx = make(AXES, B1, B2, EPS, every)
    grads_seq = _grads(6)
    state = tx.init(grads_seq[0])
    ref = (_numpy_soap if name == "soap" else _numpy_shampoo)(grads_seq, every)
    update = jax.jit(tx.update)
    for t, (grads, want) in enumerate(zip(grads_seq, ref), start=1):
        got, state = update(grads, state)
        for k in SHAPES:
            scale = np.abs(want[k]).max() + 1e-12
            np.testing.assert_allclose(got[k] / scale, want[k] / scale, atol=2e-4, err_msg=(t, k))
    if name == "soap":  # the first step only set up the statistics
        assert int(state.count) == 6
    assert state.stat_l["q"].shape == (2, 8, 8, 1)  # kept at the parameter's rank
    assert state.stat_r["o"].shape == (2, 8, 8, 1) and state.stat_l["e"].shape == ()


def test_matrices_from_logical_axes():
    md = shampoo.matrix_dims
    assert md(("layers", "embed", "heads", "head_dim")) == ((0,), (1,), (2, 3))
    assert md(("layers", "heads", "head_dim", "embed")) == ((0,), (1, 2), (3,))
    assert md(("layers", "expert", "embed", "mlp")) == ((0, 1), (2,), (3,))
    assert md(("vocab", "embed")) is None and md(("embed", "vocab")) is None
    assert md(("layers", "norm")) is None
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    dims = ((2,), (0,), (1, 3))  # a transposed layout round-trips
    m = shampoo.to_matrix(x, dims)
    assert m.shape == (4, 2, 15)
    np.testing.assert_array_equal(m[1, 0], x[0, :, 1, :].reshape(-1))
    np.testing.assert_array_equal(shampoo.from_matrix(m, dims, x.shape), x)


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_sharded_steps_equal_single_device_steps(name):
    """Four jitted steps (two refreshes, weight decay, the schedule) with parameters and state
    split over fsdp x tensor (4 x 2) give the single-device result."""
    rng = np.random.default_rng(3)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads_seq = _grads(4, seed=4)
    cfg = config.OptimConfig(
        name=name, lr=0.01, schedule="constant", warmup_steps=0, precondition_every=2
    )
    tx = optim.build(cfg, total_steps=10, axes=AXES)
    mesh = sharding.make_mesh(config.MeshConfig(data=1, fsdp=4, tensor=2), jax.devices())
    param_sh = sharding.tree_shardings(mesh, AXES)
    opt_sh = opt_state_shardings(tx, jax.eval_shape(lambda: params), param_sh)
    assert not opt_sh[1][0].stat_l["q"].is_fully_replicated

    def steps(params):
        state = tx.init(params)
        for grads in grads_seq:
            updates, state = tx.update(grads, state, params)
            params = jax.tree.map(lambda p, u: p + u, params, updates)
        return params, state

    want = jax.jit(steps)(params)
    got = jax.jit(steps, in_shardings=(param_sh,), out_shardings=(param_sh, opt_sh))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_state_bytes_per_parameter_match_the_formula(name):
    """8 bytes (two moments) per parameter, plus four float32 k x k matrices (two statistics,
    two bases or roots) per side of each matrix: 8 B (m^2 + n^2) / (B m n) for a stack of B."""
    state, shardings, axes = abstract_state(f"optim.name={name}")[:3]
    bill = memory_bill(state, shardings, axes)
    flat = zip(
        jax.tree.leaves(state.params), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    )
    n_params = extra = 0
    for p, ax in flat:
        n_params += p.size
        dims = shampoo.matrix_dims(ax)
        if dims is not None:
            b = int(np.prod([p.shape[d] for d in dims[0]]))
            m, n = (int(np.prod([p.shape[d] for d in ds])) for ds in dims[1:])
            extra += 2 * 4 * b * (m * m + n * n)
    want = 8 + extra / n_params
    assert abs(bill["opt_bytes_per_param"] - want) < 1e-3 * want, (bill, want)
    assert 20 < want < 40  # the default model: square 256 x 256 attention, 256 x 640 MLP


def test_precondition_every_is_checked():
    with pytest.raises(config.ConfigError, match="optim.precondition_every must be >= 1"):
        config.load(None, ["optim.name=soap", "optim.precondition_every=0"])
    with pytest.raises(config.ConfigError, match="precondition_every does nothing.*shampoo"):
        config.load(None, ["optim.precondition_every=5"])
    assert config.load(None, ["optim.name=shampoo", "optim.precondition_every=5"])


# ------------------------------------------------------------------------- AMSGrad


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_amsgrad_normalises_by_the_running_max_of_v(name):
    """Gradients that shrink 10x a step make v fall; AMSGrad (Reddi et al. 2018) divides by
    the largest bias-corrected v seen, Adam by the current one."""
    b1, b2, eps, lr = 0.9, 0.95, 1e-8, 0.1
    base = dict(name=name, lr=lr, schedule="constant", warmup_steps=0, clip_norm=None)
    base |= dict(b1=b1, b2=b2, eps=eps, weight_decay=0.0)
    ams = optim.build(config.OptimConfig(amsgrad=True, **base), 10)
    plain = optim.build(config.OptimConfig(**base), 10)
    params = {"w": np.zeros((3, 4), np.float32)}
    rng = np.random.default_rng(5)
    base = rng.normal(size=(3, 4))
    grads_seq = [{"w": (base * 10.0**-t).astype(np.float32)} for t in range(5)]
    sa, sp = ams.init(params), plain.init(params)
    m = v = v_max = np.zeros((3, 4))
    for t, grads in enumerate(grads_seq, start=1):
        g = grads["w"].astype(np.float64)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        v_max = np.maximum(v_max, v_hat)
        ua, sa = ams.update(grads, sa, params)
        up, sp = plain.update(grads, sp, params)
        np.testing.assert_allclose(ua["w"], -lr * m_hat / (np.sqrt(v_max) + eps), rtol=1e-5)
        np.testing.assert_allclose(up["w"], -lr * m_hat / (np.sqrt(v_hat) + eps), rtol=1e-5)
        if t > 1:  # v fell, so the max differs and AMSGrad's step is the smaller one
            assert np.all(v_max > v_hat)
            assert np.all(np.abs(ua["w"]) < np.abs(up["w"]))
