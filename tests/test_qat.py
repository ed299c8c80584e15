"""Quantization-aware training (`train.qat.*`): the fake quantization is `jaxllm quantize`'s
own code (int4 groups, fp8, mxfp4) and NVFP4 a NumPy re-derivation; gradients pass straight
through; a QAT run's evaluation equals the evaluation of its quantized run; at int4 it ends
closer to its float loss than round-to-nearest of a float run trained the same steps; the
activations (`train.qat.activations`) are rounded per token as the W8A8 kinds do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import SMALL_RUN, train_for_quantization

from jaxllm.cli import main
from jaxllm.compress import qat
from jaxllm.config.train import QATConfig
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.model import coded, fake_quant, layers, quantized
from jaxllm.model.quantized_float import E2M1_GRID


def np_nvfp4(w):
    """NVFP4 of w [K, N]: a float32 scale max|W| / (448 * 6); per output, blocks of 16 inputs
    with an E4M3 scale of their max / 6 over it; E2M1 values, nearest with ties to even."""
    w = w.astype(np.float32)
    g = np.float32(np.abs(w).max() / (448 * 6))
    b = w.reshape(-1, 16, w.shape[1])
    s = (np.abs(b).max(1, keepdims=True) / np.float32(6) / g).astype(ml_dtypes.float8_e4m3fn)
    s = s.astype(np.float32) * g
    v = np.where(s > 0, b / np.where(s > 0, s, 1), 0)
    a = np.abs(v)
    mids = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    idx = np.searchsorted(mids, a, side="left")  # a tie at a midpoint: below, unless ...
    tie = np.isin(a, mids)
    up_even = tie & (idx % 2 == 1)  # ... the upper neighbour is the even code
    idx = np.where(up_even, idx + 1, idx)
    mag = E2M1_GRID[np.minimum(idx, 7)]
    return (np.where(np.signbit(v), -mag, mag) * s).reshape(w.shape)


def test_fake_quantization_is_the_stored_kinds():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_t(4, (2, 64, 24)).astype(np.float32))  # [lead, K, N]
    cfg = QATConfig(weights="int4", group_size=32)
    want = quantized.dequantize(
        quantized.quantize(w, bits=4, group=32, symmetric=True, n_in=1, n_out=1), jnp.float32
    )
    np.testing.assert_array_equal(qat.fake(w, cfg, n_in=1, n_out=1), want)
    for kind in ("fp8", "mxfp4"):
        t = coded.encode(w, kind=kind, act="none", threshold=0.0, n_in=1, n_out=1)
        got = qat.fake(w, QATConfig(weights=kind), n_in=1, n_out=1)
        np.testing.assert_array_equal(got, coded.decode(t, jnp.float32))
    got = np.asarray(qat.fake(w, QATConfig(weights="nvfp4"), n_in=1, n_out=1))
    want = np.stack([np_nvfp4(np.asarray(w[i])) for i in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert len(np.unique(got[0, :16, 0])) <= 15  # on the grid


def test_gradients_pass_straight_through():
    abstract = {"layers": {"attn": {"q_proj": jax.ShapeDtypeStruct((64, 4, 16), jnp.float32)}}}
    axes = {"layers": {"attn": {"q_proj": ("embed", "heads", "head_dim")}}}
    apply = qat.transform(abstract, axes, QATConfig(weights="int4"))
    w = jnp.asarray(np.random.default_rng(1).normal(0, 1, (64, 4, 16)), jnp.float32)
    c = jnp.asarray(np.random.default_rng(2).normal(0, 1, w.shape), jnp.float32)
    f = lambda p: jnp.sum(apply(p)["layers"]["attn"]["q_proj"] * c)  # noqa: E731
    grads = jax.grad(f)({"layers": {"attn": {"q_proj": w}}})
    np.testing.assert_array_equal(grads["layers"]["attn"]["q_proj"], c)
    used = apply({"layers": {"attn": {"q_proj": w}}})["layers"]["attn"]["q_proj"]
    assert not np.array_equal(used, w) and len(np.unique(np.asarray(used)[:, 0, 0])) <= 16


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_fake_quantized_activations_per_token(act):
    """Through the matmul seam, each token's row of x (over the contracted dim d) is rounded
    on its own scale, as a NumPy re-derivation says; the gradient with respect to x is the
    plain matmul's (straight through)."""
    rng = np.random.default_rng(3)
    x = rng.standard_t(3, (2, 5, 48)).astype(np.float32)
    w = rng.normal(0, 0.2, (48, 3, 8)).astype(np.float32)
    s = np.abs(x).max(-1, keepdims=True) / (127.0 if act == "int8" else 448.0)
    if act == "int8":
        xq = np.clip(np.round(x / s), -127, 127) * s
    else:
        xq = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    k = fake_quant.FakeQuantKernel(jnp.asarray(w), act)
    f = lambda x: layers.matmul("bsd,dhk->bshk", x, k, jnp.float32)  # noqa: E731
    got = f(jnp.asarray(x))
    np.testing.assert_allclose(got, np.einsum("bsd,dhk->bshk", xq, w), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, np.einsum("bsd,dhk->bshk", x, w), rtol=1e-6, atol=1e-6)
    c = jnp.asarray(rng.normal(0, 1, got.shape), jnp.float32)
    gx = jax.grad(lambda x: jnp.sum(f(x) * c))(jnp.asarray(x))
    np.testing.assert_allclose(gx, np.einsum("bshk,dhk->bsd", c, w), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained():
    return train_for_quantization()


def _continue(trained, run, *extra, steps=30):
    argv = ["train", *SMALL_RUN, f"train.steps={steps}", "optim.lr=1e-3", "optim.warmup_steps=0"]
    argv += ["train.log_every=30", f"checkpoint.init_from={trained}", f"run.dir={run}"]
    assert main([*argv, *extra]) == 0


def _loss(run, batches=16) -> float:
    return evaluate_checkpoint(run, num_batches=batches)["eval_loss"]


@pytest.mark.slow
def test_qat_evaluates_as_its_quantized_run_and_beats_rtn(trained, tmp_path):
    """30 more steps of the trained run, with int4 QAT (per channel) and without: the QAT
    run's evaluation equals that of `jaxllm quantize --method rtn --bits 4` of it, and is
    below RTN int4 of the float run's; an MXFP4 QAT run (2 steps) evaluates as its mxfp4 run,
    and an fp8 one with fp8 activations as its W8A8-FP8 run (not as its weight-only fp8 run)."""
    runs = {n: tmp_path / n for n in ("float", "qat", "mx", "fp8a")}
    _continue(trained, runs["float"])
    _continue(trained, runs["qat"], "train.qat.weights=int4")
    _continue(trained, runs["mx"], "train.qat.weights=mxfp4", steps=2)
    _continue(trained, runs["fp8a"], "train.qat.weights=fp8", "train.qat.activations=fp8", steps=2)
    quantized_as = {
        "float": ["rtn", "--bits", "4"],
        "qat": ["rtn", "--bits", "4"],
        "mx": ["mxfp4"],
        "fp8a": ["fp8", "quantize.fp8_activations=true"],
    }
    for name, how in quantized_as.items():
        assert main(["quantize", str(runs[name]), f"{runs[name]}-q", "--method", *how]) == 0
    fp8a = runs["fp8a"]
    assert main(["quantize", str(fp8a), f"{fp8a}-w", "--method", "fp8"]) == 0
    few = {"mx": 2}  # an equality to 1e-6 needs no more batches
    loss = {n: _loss(r, few.get(n, 16)) for n, r in runs.items()}
    loss.update({n + "-q": _loss(f"{r}-q", few.get(n, 16)) for n, r in runs.items()})
    loss["fp8a-w"] = _loss(f"{fp8a}-w")
    assert loss["qat"] == pytest.approx(loss["qat-q"], abs=1e-6), loss
    assert loss["mx"] == pytest.approx(loss["mx-q"], abs=1e-6), loss
    assert loss["fp8a"] == pytest.approx(loss["fp8a-q"], abs=2e-6), loss
    assert abs(loss["fp8a"] - loss["fp8a-w"]) > 1e-5, loss  # the activations were rounded
    assert loss["qat"] < loss["float-q"], loss


@pytest.mark.parametrize(
    "extra,says",
    [
        (["train.qat.weights=int4", "train.qat.group_size=48"], "train.qat.group_size needs the"),
        (["train.qat.weights=fp8", "train.qat.group_size=32"], "has a fixed grid"),
        (["train.qat.weights=int8", "peft.method=lora"], "peft.method=lora freezes them"),
        (["train.qat.group_size=32"], "need train.qat.weights"),
    ],
)
def test_qat_refuses_in_one_line(extra, says, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SMALL_RUN, "train.steps=2", f"run.dir={run}", *extra]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxllm:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert not run.exists()
