"""CAME, GaLore and Q-GaLore (`optim.name=came|galore|q_galore`) against plain-numpy versions of
their papers' updates on a small tree with the model's naming (a stacked matrix, an attention
kernel, an output kernel, an embedding, a norm scale), a few steps each."""

import jax
import numpy as np
import pytest

from jaxllm import config, optim
from jaxllm.optim import came, galore

AXES = {
    "w": ("layers", "embed", "mlp"),  # (2, 6, 10): m < n, P spans the rows
    "o": ("mlp", "embed"),  # (10, 6): m >= n, P spans the columns
    "q": ("embed", "heads", "head_dim"),  # (6, 2, 3): one 6 x 6 matrix
    "e": ("vocab", "embed"),  # embedding: Adam
    "scale": ("norm",),  # vector: Adam
}
SHAPES = {"w": (2, 6, 10), "o": (10, 6), "q": (6, 2, 3), "e": (12, 6), "scale": (6,)}
# (stacked dims, input dims, output dims) of the matrices, by hand
MATRIX = {"w": ((0,), (1,), (2,)), "o": ((), (0,), (1,)), "q": ((), (0,), (1, 2))}


def _tree(rng, scale=1.0):
    return {k: (rng.normal(size=s) * scale).astype(np.float32) for k, s in SHAPES.items()}


def _grads(seed, n):
    rng = np.random.default_rng(seed)
    return [_tree(rng, 10.0**i) for i in range(-1, n - 1)]


def _matrices(x, dims):
    """x as (S, m, n) matrices, and the inverse."""
    stacked, red, out = dims
    perm = stacked + red + out
    y = np.transpose(x, perm)
    s = y.shape[: len(stacked)]
    m = int(np.prod([x.shape[i] for i in red]))
    mats = y.reshape(int(np.prod(s)), m, -1)
    return mats, lambda z: np.transpose(z.reshape(y.shape), np.argsort(perm))


def _canonical(b):
    """Columns of b with their largest-magnitude entry positive."""
    idx = np.argmax(np.abs(b), axis=0)
    return b * np.sign(b[idx, np.arange(b.shape[1])])


def _adam(state, key, g, t, b1, b2, eps):
    m, v = state.get(key, (0.0, 0.0))
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    state[key] = (m, v)
    return (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)


def _quant4(b):
    s = np.abs(b).max(axis=0, keepdims=True) / 7
    return np.clip(np.round(b / s), -7, 7) * s


# ------------------------------------------------------------------------- CAME


def _numpy_came(grads_seq, b1, b2, b3):
    """Luo et al. 2023, Algorithm 1 as in the authors' code: factored over the two largest
    unstacked dims, no bias correction; vectors step by m alone."""
    eps1, eps2 = 1e-30, 1e-16
    state, out = {}, []
    for grads in grads_seq:
        step = {}
        for k, g in grads.items():
            g = g.astype(np.float64)
            st = state.setdefault(k, {})
            dims = came.factored_dims(AXES[k], g.shape)
            sq = g * g + eps1
            if dims is None:
                st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * sq
                u = g / np.sqrt(st["v"])
            else:  # factored dims last: (..., R, C)
                rest = [i for i in range(g.ndim) if i not in dims]
                perm = rest + list(dims)
                back = lambda x, perm=perm: np.transpose(x, np.argsort(perm))  # noqa: E731
                gt, sqt = np.transpose(g, perm), np.transpose(sq, perm)

                def approx(row, col):
                    r = 1 / np.sqrt(row / row.mean(-1, keepdims=True))
                    return r[..., :, None] / np.sqrt(col)[..., None, :]

                st["r"] = b2 * st.get("r", 0.0) + (1 - b2) * sqt.mean(-1)
                st["c"] = b2 * st.get("c", 0.0) + (1 - b2) * sqt.mean(-2)
                u = back(gt * approx(st["r"], st["c"]))
            u = u / max(1.0, np.sqrt(np.mean(u * u)))
            st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * u
            if dims is None:
                step[k] = st["m"]
                continue
            inst = np.transpose((u - st["m"]) ** 2 + eps2, perm)
            st["R"] = b3 * st.get("R", 0.0) + (1 - b3) * inst.mean(-1)
            st["C"] = b3 * st.get("C", 0.0) + (1 - b3) * inst.mean(-2)
            step[k] = st["m"] * back(approx(st["R"], st["C"]))
        out.append(step)
    return out


def test_came_factors_the_two_largest_unstacked_dims():
    assert came.factored_dims(("layers", "embed", "mlp"), (4, 256, 640)) == (1, 2)
    assert came.factored_dims(("embed", "heads", "head_dim"), (256, 4, 64)) == (0, 2)
    assert came.factored_dims(("layers", "norm"), (4, 256)) is None


def test_came_matches_numpy_reference():
    grads_seq = _grads(0, 5)
    tx = came.scale_by_came(AXES, b1=0.9, b2=0.99, b3=0.999)
    state = tx.init(_tree(np.random.default_rng(9)))
    for grads, want in zip(grads_seq, _numpy_came(grads_seq, 0.9, 0.99, 0.999)):
        got, state = tx.update(grads, state)
        for k in SHAPES:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=1e-6, err_msg=k)
    assert state.v_row["w"].shape == (2, 6) and state.v_col["w"].shape == (2, 10)


# ------------------------------------------------------------------------- GaLore


def _numpy_galore(grads_seq, rank, gap, scale, b1, b2, eps, int4=False):
    """Zhao et al. 2024, Algorithm 2 per matrix (and per stacked slice): P from the gradient's
    SVD every `gap` steps on its smaller side, Adam on the projection, `scale` times the
    projected-back step; Adam for the rest. int4: P quantized per column (Q-GaLore)."""
    adam, proj, out = {}, {}, []
    for t, grads in enumerate(grads_seq, start=1):
        step = {}
        for k, g in grads.items():
            if k not in MATRIX:
                step[k] = _adam(adam, k, g, t, b1, b2, eps)
                continue
            mats, back = _matrices(g.astype(np.float64), MATRIX[k])
            res = []
            for i, x in enumerate(mats):
                m, n = x.shape
                left = m < n
                if (t - 1) % gap == 0:
                    u, _, vt = np.linalg.svd(x, full_matrices=False)
                    b = _canonical(u[:, :rank] if left else vt[:rank].T)
                    proj[k, i] = _quant4(b) if int4 else b
                p = proj[k, i]
                low = _adam(adam, (k, i), p.T @ x if left else x @ p, t, b1, b2, eps)
                res.append(scale * (p @ low if left else low @ p.T))
            step[k] = back(np.stack(res))
        out.append(step)
    return out


def test_galore_matrices_from_logical_axes():
    assert galore.matrix_dims(("layers", "embed", "mlp")) == ((0,), (1,), (2,))
    assert galore.matrix_dims(("layers", "heads", "head_dim", "embed")) == ((0,), (1, 2), (3,))
    assert galore.matrix_dims(("layers", "expert", "mlp", "embed")) == ((0, 1), (2,), (3,))
    assert galore.matrix_dims(("vocab", "embed")) is None
    assert galore.matrix_dims(("layers", "norm")) is None
    for k, dims in MATRIX.items():
        assert galore.matrix_dims(AXES[k]) == dims


@pytest.mark.parametrize("int4", [False, True])
def test_galore_matches_numpy_reference(int4):
    grads_seq = _grads(1, 5)
    rank, gap, scale = 3, 2, 0.25
    tx = galore.scale_by_galore(AXES, rank, gap, scale, 0.9, 0.95, 1e-8, int4=int4)
    state = tx.init(_tree(np.random.default_rng(9)))
    ref = _numpy_galore(grads_seq, rank, gap, scale, 0.9, 0.95, 1e-8, int4)
    for grads, want in zip(grads_seq, ref):
        got, state = tx.update(grads, state)
        for k in SHAPES:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-3, atol=1e-5, err_msg=k)
    # states in the parameter's rank: P (rows x r), Adam's moments (r x columns)
    assert state.inner.mu["w"].shape == (2, 3, 10)
    assert state.inner.mu["o"].shape == (10, 3) and state.inner.mu["q"].shape == (6, 3, 1)
    if int4:  # two codes per byte along r, a float32 scale per column
        assert state.proj["w"].shape == (2, 6, 2) and state.proj["w"].dtype == np.uint8
        assert state.proj_scale["w"].shape == (2, 1, 3)
    else:
        assert state.proj["w"].shape == (2, 6, 3) and state.proj["o"].shape == (3, 6)


def test_int4_packing_round_trips():
    rng = np.random.default_rng(2)
    b = rng.normal(size=(2, 9, 5)).astype(np.float32)
    packed, s = galore.quantize_int4(b)
    assert packed.shape == (2, 9, 3) and packed.dtype == np.uint8
    want = np.stack([_quant4(x) for x in b])
    np.testing.assert_allclose(galore.dequantize_int4(packed, s), want, rtol=1e-6, atol=1e-7)


def test_q_galore_keeps_int8_weights_with_stochastic_rounding():
    """The whole q_galore optimizer (learning rate, decay on matrices) against numpy: the
    matrices step from their int8 weights and are re-quantized with stochastic rounding (the
    same uniform noise); the stored parameters are the dequantized int8 weights."""
    lr, wd, b1, b2, eps, rank, gap, scale = 0.05, 0.1, 0.9, 0.95, 1e-8, 3, 2, 0.25
    cfg = config.OptimConfig(
        name="q_galore",
        lr=lr,
        schedule="constant",
        warmup_steps=0,
        weight_decay=wd,
        clip_norm=None,
        galore_rank=rank,
        galore_update_gap=gap,
        galore_scale=scale,
    )
    tx = optim.build(cfg, 10, AXES)
    params = _tree(np.random.default_rng(3))
    state = tx.init(params)
    grads_seq = _grads(4, 4)
    ref = _numpy_galore(grads_seq, rank, gap, scale, b1, b2, eps, int4=True)
    keys = sorted(SHAPES)  # the order of the flattened tree, which seeds the noise
    want = {k: v.astype(np.float64) for k, v in params.items()}
    w8 = {}
    for k in MATRIX:  # initial int8 weights: round to nearest, absmax / 127 per row
        s = np.abs(want[k]).max(axis=-1, keepdims=True) / 127
        w8[k] = (np.round(want[k] / s), s)
    for t, (grads, direction) in enumerate(zip(grads_seq, ref)):
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        for k in SHAPES:
            if k not in MATRIX:
                decay = 0.0 if k == "scale" else wd * want[k]
                want[k] = want[k] - lr * (direction[k] + decay)
                continue
            w = w8[k][0] * w8[k][1]
            w = w - lr * (direction[k] + wd * w)
            s = np.abs(w).max(axis=-1, keepdims=True) / 127
            u = jax.random.uniform(
                galore.rounding_key(t, keys.index(k)), w.shape[:-1] + (1,) + w.shape[-1:]
            )
            q = np.clip(np.floor(w / s + np.asarray(u).reshape(w.shape)), -127, 127)
            w8[k] = (q, s)
            want[k] = q * s
        for k in SHAPES:
            np.testing.assert_allclose(params[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    for k in MATRIX:
        assert state.codes[k].dtype == np.int8
        np.testing.assert_array_equal(state.codes[k], w8[k][0].astype(np.int8))
