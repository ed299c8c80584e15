"""`jaxllm prune`: magnitude, Wanda and SparseGPT against NumPy re-derivations of their papers
on one layer (unstructured and N:M); on a trained model, SparseGPT's held-out loss is below
magnitude's at 50% and at 2:4 and the pruned run evaluates, generates and exports; a full run
trained from it keeps its zeros through optimizer steps (docs/compression.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN, train_for_quantization
from flax import nnx

import jaxllm
from jaxllm.cli import main
from jaxllm.compress import prune
from jaxllm.compress.calibrate import calibration_rows
from jaxllm.config import PruneConfig
from jaxllm.config.prune import SparseGPTConfig
from jaxllm.evaluate import evaluate_checkpoint


def _smallest(score, count):
    mask = np.zeros(score.size, bool)
    mask[np.argsort(score.ravel(), kind="stable")[:count]] = True
    return mask.reshape(score.shape)


def _nm(score, n, m):
    """The n smallest of each m consecutive rows, per column."""
    mask = np.zeros(score.shape, bool)
    for i in range(0, score.shape[0], m):
        idx = np.argsort(score[i : i + m], axis=0, kind="stable")[:n]
        np.put_along_axis(mask[i : i + m], idx, True, axis=0)
    return mask


def np_wanda(w, h, sparsity, nm):
    score = np.abs(w) * np.sqrt(np.diag(h))[:, None]
    if nm:
        return _nm(score, *nm)
    cols = [_smallest(score[:, j], int(sparsity * w.shape[0])) for j in range(w.shape[1])]
    return np.stack(cols, 1)


def np_sparsegpt(w, h, sparsity, nm, block, damp):
    """SparseGPT's `fasterprune` in float64 on W [K, N] (our rows are its columns): (pruned W,
    mask)."""
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    k = w.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[dead] = 0
    h += np.eye(k) * damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    mask = np.zeros(w.shape, bool)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, u1, e1 = w[i1:i2].copy(), u[i1:i2, i1:i2], np.zeros((i2 - i1, w.shape[1]))
        d = np.diag(u1)
        m1 = (
            np.zeros(w1.shape, bool)
            if nm
            else _smallest(w1**2 / d[:, None] ** 2, int(sparsity * w1.size))
        )
        for j in range(i2 - i1):
            if nm and j % nm[1] == 0:
                m1[j : j + nm[1]] = _nm(w1[j : j + nm[1]] ** 2 / d[j : j + nm[1], None] ** 2, *nm)
            q = np.where(m1[j], 0.0, w1[j])
            e1[j] = (w1[j] - q) / u1[j, j]
            w1[j:] -= np.outer(u1[j, j:], e1[j])
        w[i1:i2] = np.where(m1, 0.0, w1)
        w[i2:] -= u[i1:i2, i2:].T @ e1
        mask[i1:i2] = m1
    return np.where(dead[:, None] | mask, 0.0, w), mask | dead[:, None]


def _layer(seed=0, k=48, n=24):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (400, k)) * rng.uniform(0.2, 5, k)
    x[:, 3] = 0  # a dead input channel
    w = rng.normal(0, 0.1, (k, n)).astype(np.float32)
    return w, (x.T @ x).astype(np.float32)


@pytest.mark.parametrize("nm", [None, (2, 4), (4, 8)])
def test_wanda_and_magnitude_match_numpy(nm):
    w, h = _layer()
    cfg = PruneConfig(method="wanda", sparsity=0.5, pattern=f"{nm[0]}:{nm[1]}" if nm else "")
    got = np.asarray(prune.wanda(jnp.asarray(w), jnp.asarray(h), cfg))
    np.testing.assert_array_equal(got, np_wanda(w, h, 0.5, nm))
    got = np.asarray(prune.magnitude(jnp.asarray(w), cfg))
    want = _nm(np.abs(w), *nm) if nm else _smallest(np.abs(w), int(0.5 * w.size))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "sparsity,nm,block", [(0.5, None, 16), (0.7, None, 128), (0.5, (2, 4), 16)]
)
def test_sparsegpt_matches_numpy(sparsity, nm, block):
    """The same masks, and the kept weights' updates, as the float64 transcription of the
    authors' code (blocks of 16 over 48 inputs: the last one shorter)."""
    w, h = _layer(1)
    pattern = f"{nm[0]}:{nm[1]}" if nm else ""
    cfg = PruneConfig(
        method="sparsegpt", sparsity=sparsity, pattern=pattern, sparsegpt=SparseGPTConfig(block)
    )
    got, mask = (np.asarray(a) for a in prune.sparsegpt(jnp.asarray(w), jnp.asarray(h), cfg))
    want, want_mask = np_sparsegpt(w, h, sparsity, nm, block, 0.01)
    assert np.mean(mask == want_mask) > 0.995
    same = np.all(mask == want_mask, axis=0)  # outputs whose masks agree
    assert same.mean() > 0.9
    np.testing.assert_allclose(got[:, same], want[:, same], rtol=2e-3, atol=2e-4)
    assert np.all(got[mask] == 0) and np.all(got[3] == 0)
    if nm is None:
        assert abs(mask.mean() - sparsity) < 0.03
    else:
        np.testing.assert_array_equal(mask.reshape(-1, 4, w.shape[1]).sum(1), 2)
    # it reconstructs the layer's output better than magnitude does
    err = lambda v: np.trace((w - v).T @ h @ (w - v))  # noqa: E731
    magnitude = np.where(
        _nm(np.abs(w), *nm) if nm else _smallest(np.abs(w), int(sparsity * w.size)), 0, w
    )
    assert err(got) < err(magnitude)


def test_expert_stacks_are_pruned_each_on_its_own():
    w = np.random.default_rng(3).normal(0, 1, (3, 16, 8)).astype(np.float32)  # [E, K, N]
    cfg = PruneConfig(method="magnitude", sparsity=0.25)
    got = np.asarray(prune.prune_weight(jnp.asarray(w), None, cfg, n_in=1, n_out=1))
    for e in range(3):
        np.testing.assert_array_equal(got[e] == 0, _smallest(np.abs(w[e]), 32))


@pytest.fixture(scope="module")
def trained():
    return train_for_quantization()


def _loss(run) -> float:
    return evaluate_checkpoint(run, num_batches=16)["eval_loss"]


@pytest.mark.parametrize("how", [["--sparsity", "0.5"], ["--pattern", "2:4"]])
def test_sparsegpt_beats_magnitude_on_a_trained_model(trained, tmp_path, how):
    """Calibrated on the run's held-out split, SparseGPT's held-out loss is below magnitude's;
    each chosen weight has exactly the zeros asked for; the run records prune.*."""
    runs = {m: tmp_path / m for m in ("magnitude", "sparsegpt")}
    for method, out in runs.items():
        extra = ["--samples", "32"] if method == "sparsegpt" else []
        assert main(["prune", str(trained), str(out), "--method", method, *how, *extra]) == 0
    losses = {m: _loss(r) for m, r in runs.items()}
    assert losses["sparsegpt"] < losses["magnitude"], losses
    model = jaxllm.load_model(runs["sparsegpt"])
    for w in (model.layers.attn.q_proj[...], model.layers.mlp.down_proj[...]):
        zero = np.asarray(w) == 0  # [layers, K, ...]
        if how[0] == "--pattern":
            k = zero.shape[1]
            np.testing.assert_array_equal(zero.reshape(zero.shape[0], k // 4, 4, -1).sum(2), 2)
        else:
            assert zero.mean() == 0.5
    assert np.all(np.asarray(model.layers.attn_norm.scale[...]) != 0)  # norms stay whole
    saved = jaxllm.config.load(runs["sparsegpt"] / "config.yaml").prune
    assert (saved.method, saved.samples) == ("sparsegpt", 32)


@pytest.mark.slow
def test_pruned_run_generates_exports_and_keeps_its_zeros_in_training(trained, tmp_path):
    pruned, tuned = tmp_path / "pruned", tmp_path / "tuned"
    assert main(["prune", str(trained), str(pruned), "--method", "wanda", "--pattern", "2:4"]) == 0
    assert main(["generate", str(pruned), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert main(["convert", "export", str(pruned), str(tmp_path / "hf")]) == 0
    argv = ["train", *SMALL_RUN, "train.steps=2", "optim.lr=1e-2", f"run.dir={tuned}"]
    assert main([*argv, f"checkpoint.init_from={pruned}"]) == 0
    before, after = (jaxllm.load_model(r) for r in (pruned, tuned))
    for name in ("q_proj", "o_proj"):
        a = np.asarray(getattr(before.layers.attn, name)[...])
        b = np.asarray(getattr(after.layers.attn, name)[...])
        np.testing.assert_array_equal(a == 0, b == 0)  # the zeros stayed, the rest trained
        assert np.abs(a - b)[a != 0].min() > 0
    assert jaxllm.config.load(tuned / "config.yaml").prune.pattern == "2:4"
    assert np.all(np.asarray(jaxllm.load_model(trained).layers.attn.q_proj[...]) != 0)
    # LoRA from the pruned run: its update keeps the zeros (peft.keep_zeros, set by itself),
    # so the merged model is as sparse as the pruned one and the kept weights moved
    lora_run, merged = tmp_path / "lora", tmp_path / "merged"
    peft = ["peft.method=lora", "peft.targets=[q_proj, o_proj]", "peft.rank=4"]
    assert main([*argv, f"checkpoint.init_from={pruned}", f"run.dir={lora_run}", *peft]) == 0
    assert jaxllm.config.load(lora_run / "config.yaml").peft.keep_zeros
    assert main(["convert", "export", str(lora_run), str(merged), "--merge"]) == 0
    after = jaxllm.load_model(merged)
    for name in ("q_proj", "o_proj"):
        a = np.asarray(getattr(before.layers.attn, name)[...])
        b = np.asarray(getattr(after.layers.attn, name)[...])
        np.testing.assert_array_equal(a == 0, b == 0)
        assert np.abs(a - b)[a != 0].max() > 0
    ids = jnp.asarray(IDS)  # what trained is what merged: the masked update in the forward too
    want = np.asarray(jaxllm.load_model(lora_run)(ids).logits)
    np.testing.assert_allclose(_logits(after, IDS), want, rtol=1e-4, atol=1e-4)


def _taylor(trained, samples=16):
    """(the trained model, |theta * dL/dtheta| of its parameters as a pure dict), the loss
    summed over the calibration rows, by plain jax.grad."""
    cfg = jaxllm.config.load(
        trained / "config.yaml", ["quantize.method=gptq", f"quantize.samples={samples}"]
    )
    rows = calibration_rows(cfg)
    model = jaxllm.load_model(trained)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        m = nnx.merge(graphdef, p)
        seg = rows["segment_ids"]
        logits = m(rows["inputs"], positions_BxL=rows["positions"], segment_ids_BxL=seg)
        logits = logits.logits[:, :-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, rows["inputs"][:, 1:, None], -1)[..., 0]
        return jnp.sum(jnp.where((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), nll, 0.0))

    grads = nnx.to_pure_dict(jax.grad(loss)(params))
    return model, jax.tree.map(lambda w, g: jnp.abs(w * g), nnx.to_pure_dict(params), grads)


def _logits(model, ids):
    return np.asarray(model(jnp.asarray(ids)).logits)


IDS = np.random.default_rng(0).integers(1, 256, (2, 24))


@pytest.mark.parametrize("method", ["heads", "channels"])
def test_heads_and_channels_remove_the_least_important(trained, tmp_path, method):
    """Each layer loses its key-value head group (of 2; with its 2 query heads) or its quarter
    of MLP channels of least first-order Taylor importance (recomputed here by plain
    jax.grad); the smaller model computes what the trained one does with those parts' outputs
    zeroed (o_proj rows of the heads, down_proj rows of the channels), evaluates, generates
    and exports."""
    out = tmp_path / method
    sparsity = "0.5" if method == "heads" else "0.25"
    argv = ["prune", str(trained), str(out), "--method", method, "--sparsity", sparsity]
    assert main([*argv, "--samples", "16"]) == 0
    model, scores = _taylor(trained)
    a, m = scores["layers"]["attn"], scores["layers"]["mlp"]
    layers = model.cfg.num_layers
    if method == "heads":
        qpk = model.cfg.num_heads // model.cfg.num_kv_heads
        q = (a["q_proj"].sum((1, 3)) + a["o_proj"].sum((2, 3))).reshape(layers, -1, qpk).sum(2)
        importance = q + a["k_proj"].sum((1, 3)) + a["v_proj"].sum((1, 3))  # [L, KV]
        gone = np.argmin(np.asarray(importance), axis=1)
        heads = gone[:, None] * qpk + np.arange(qpk)  # [L, qpk]
        weight, rows = model.layers.attn.o_proj, heads
    else:
        importance = sum(m[n].sum(1) for n in ("gate_proj", "up_proj")) + m["down_proj"].sum(2)
        rows = np.argsort(np.asarray(importance), axis=1, kind="stable")[
            :, : model.cfg.mlp_dim // 4
        ]
        weight = model.layers.mlp.down_proj
    zeroed = np.array(weight[...])
    np.put_along_axis(zeroed, rows.reshape(layers, -1, *([1] * (zeroed.ndim - 2))), 0.0, axis=1)
    weight[...] = jnp.asarray(zeroed)
    pruned = jaxllm.load_model(out)
    want = (1, 2, 16) if method == "heads" else (2, 4, None)
    assert (pruned.cfg.num_kv_heads, pruned.cfg.num_heads, pruned.cfg.head_dim) == want
    assert pruned.cfg.mlp_dim == (96 if method == "channels" else 128)
    np.testing.assert_allclose(_logits(pruned, IDS), _logits(model, IDS), rtol=1e-4, atol=1e-4)
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert main(["convert", "export", str(out), str(tmp_path / "hf")]) == 0


def test_layers_removes_the_least_important_layer(trained, tmp_path):
    """`--method layers --sparsity 0.5` of the 2-layer run keeps the layer of larger
    first-order Taylor importance, sum |theta * dL/dtheta| over its parameters, with the loss
    summed over the calibration rows (recomputed here by plain jax.grad), as a 1-layer run
    that evaluates, generates and exports."""
    out = tmp_path / "one"
    argv = ["prune", str(trained), str(out), "--method", "layers", "--sparsity", "0.5"]
    assert main([*argv, "--samples", "16"]) == 0
    model, scores = _taylor(trained)
    importance = sum(
        jnp.sum(s, axis=tuple(range(1, s.ndim))) for s in jax.tree.leaves(scores["layers"])
    )
    keep = int(jnp.argmax(importance))
    pruned = jaxllm.load_model(out)
    assert pruned.cfg.num_layers == 1
    np.testing.assert_array_equal(
        np.asarray(pruned.layers.attn.q_proj[...])[0],
        np.asarray(model.layers.attn.q_proj[...])[keep],
    )
    assert evaluate_checkpoint(out)["eval_loss"] > 0
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert main(["convert", "export", str(out), str(tmp_path / "hf")]) == 0
