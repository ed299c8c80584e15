"""Delayed fp8 scaling (`model.fp8_scaling=delayed`): the matmul against a NumPy re-derivation
(scales from the amax history, e4m3 operands, e5m2 output gradients), the amaxes it hands back
as the history's cotangent, and the train step recording them: the largest over microbatches,
rolled one column per step, the weights' own amax in the kernel row, untouched by the
optimizer; and its config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import SMALL_RUN, tiny_model
from test_fp8 import REPO

from jaxllm import config, optim, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.config import ConfigError, MLAConfig
from jaxllm.load import restore
from jaxllm.metrics import read_jsonl
from jaxllm.model import abstract_model, abstract_model_state, fp8_delayed, layers
from jaxllm.model import fp8 as fp8_ops
from jaxllm.model.lora import LoRAKernel
from jaxllm.objectives import next_token
from jaxllm.train import step as step_lib
from jaxllm.train.loop import to_global
from jaxllm.train.state import init_state

E4M3, E5M2 = 448.0, 57344.0


def _np_scale(past: np.ndarray, amax: float, top: float) -> np.float32:
    best = past.max()
    a = best if best > 0 else amax
    return np.float32(max(2.0 ** np.ceil(np.log2(a / top)), np.finfo(np.float32).tiny))


def _np_cast(x: np.ndarray, scale, top: float, dtype) -> np.ndarray:
    q = np.clip(x.astype(np.float32) / scale, -top, top).astype(dtype)
    return q.astype(np.float32)


def _inputs(history_amax=(0.0, 0.0, 0.0)):
    x = np.asarray(jax.random.normal(jax.random.key(0), (6, 32)), np.float32)
    w = np.asarray(jax.random.normal(jax.random.key(1), (32, 16)), np.float32) * 0.05
    g = np.asarray(jax.random.normal(jax.random.key(2), (6, 16)), np.float32) * 1e-3
    h = np.zeros((3, 8), np.float32)
    h[:, 3] = history_amax  # an older column: the scale is the history's max, wherever it is
    return x, w, g, h


@pytest.mark.parametrize("past", [(0.0, 0.0, 0.0), (6.0, 0.3, 2e-3), (1.0, 0.05, 1e-4)])
def test_delayed_einsum_matches_numpy(past):
    """Forward, both gradients and the amaxes, against the recipe written in NumPy; the last
    case's history is below the tensors' amaxes, so the cast saturates (and stays finite)."""
    x, w, g, h = _inputs(past)

    def f(x, w, h):
        return fp8_delayed.einsum("ad,df->af", x, w, h, jnp.float32, jnp.float32)

    y, vjp = jax.vjp(f, x, w, h)
    dx, dw, dh = vjp(jnp.asarray(g))

    sx = _np_scale(h[0], np.abs(x).max(), E4M3)
    sw = _np_scale(h[1], np.abs(w).max(), E4M3)
    sg = _np_scale(h[2], np.abs(g).max(), E5M2)
    qx = _np_cast(x, sx, E4M3, ml_dtypes.float8_e4m3fn)
    qw = _np_cast(w, sw, E4M3, ml_dtypes.float8_e4m3fn)
    qg = _np_cast(g, sg, E5M2, ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(y, (qx @ qw) * (sx * sw), rtol=1e-5)
    np.testing.assert_allclose(dx, (qg @ qw.T) * (sg * sw), rtol=1e-5)
    np.testing.assert_allclose(dw, (qx.T @ qg) * (sx * sg), rtol=1e-5)
    want = np.zeros_like(h)
    want[:, 0] = [np.abs(x).max(), np.abs(w).max(), np.abs(g).max()]
    np.testing.assert_array_equal(dh, want)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    if past == (1.0, 0.05, 1e-4):  # the history's scale is too small: values clip at 448
        assert np.abs(qx).max() == E4M3


def test_a_fresh_history_scales_as_current_scaling():
    x, w, g, h = _inputs()
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    got = fp8_delayed.einsum("ad,df->af", *args, jnp.asarray(h), jnp.bfloat16, jnp.bfloat16)
    ref = fp8_ops.einsum("ad,df->af", *args, jnp.bfloat16, jnp.bfloat16)
    np.testing.assert_array_equal(got, ref)


def _cfg(accum: int, **model) -> config.Config:
    m = tiny_model(vocab_size=258, matmul_dtype="float8", fp8_scaling="delayed", **model)
    return config.Config(
        model=m,
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, grad_accum_steps=accum),
        optim=config.OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
    )


def _steps(cfg: config.Config, n: int):
    """(states after each of n steps, the first state) of the train step on one device."""
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    tx = optim.build(cfg.optim, cfg.train.steps)
    step = jax.jit(
        lambda s, b: step_lib.train_step(
            s,
            b,
            graphdef=abstract_model(cfg.model)[0],
            tx=tx,
            lr_schedule=optim.schedule(cfg.optim, cfg.train.steps),
            objective=next_token(),
            grad_accum_steps=cfg.train.grad_accum_steps,
        )
    )
    state = first = init_state(cfg.model, tx, mesh, seed=0)
    batch = to_global(synthetic_batch(cfg), sharding.named(mesh, step_lib.BATCH_AXES))
    states = []
    for _ in range(n):
        state, metrics = step(state, batch)
        assert float(metrics["nonfinite"]) == 0
        states.append(state)
    return states, first


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree.leaves_with_path(tree)}


def test_train_step_records_the_amaxes():
    (one, two), first = _steps(_cfg(accum=1), 2)
    hist0 = _flat(fp8_delayed.histories(first.model_state))
    assert hist0 and all(not h.any() for h in hist0.values())  # fresh: zeros
    assert fp8_delayed.histories(first.params) == {}  # in the model state only
    h1, h2 = _flat(fp8_delayed.histories(one.model_state)), _flat(two.model_state)
    params0 = _flat(first.params)
    for key, h in h1.items():
        assert h.shape[-2:] == (3, 1024)
        assert np.all(h[..., 0] > 0), key  # every layer recorded all three amaxes
        assert not h[..., 1:].any(), key
        weight = params0[key.replace(fp8_delayed.SUFFIX, "")]  # [layers, ...]
        per_layer = np.abs(weight.astype(np.float32)).reshape(weight.shape[0], -1).max(axis=1)
        np.testing.assert_allclose(h[:, 1, 0], per_layer, rtol=1e-5)
        later = h2[key]  # step 2: rolled by one, step 1's amaxes in column 1
        np.testing.assert_array_equal(later[..., 1], h[..., 0])
        assert np.all(later[..., 0] > 0) and not later[..., 2:].any()


MLA = dict(
    mla=MLAConfig(
        kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
    )
)
HYBRID = dict(layer_pattern=["linear", "softmax"], num_layers=2)


@pytest.mark.parametrize(
    "variant",
    ["mla", pytest.param("hybrid", marks=pytest.mark.slow)],  # ~8 s each
)
def test_every_history_records(variant):
    """No history sits unused: MLA's (kv_b in its training form too) and the linear-attention
    projections' (its float32 gates have none) all record their three amaxes."""
    (one,), _ = _steps(_cfg(accum=1, **(MLA if variant == "mla" else HYBRID)), 1)
    hist = _flat(fp8_delayed.histories(one.model_state))
    assert hist
    if variant == "mla":
        assert any("kv_b_proj" in k for k in hist)
    else:
        assert not any("a_proj" in k or "b_proj" in k for k in hist)
    for key, h in hist.items():
        assert np.all(h[..., 0] > 0), key


def test_microbatches_record_their_largest_amax():
    """Two microbatches record what one batch of both records: the max, not the sum."""
    (whole,), _ = _steps(_cfg(accum=1), 1)
    (split,), _ = _steps(_cfg(accum=2), 1)
    a, b = _flat(fp8_delayed.histories(whole.model_state)), _flat(split.model_state)
    for key, h in a.items():
        np.testing.assert_allclose(b[key][..., 0], h[..., 0], rtol=1e-6, err_msg=key)


def test_histories_sit_beside_the_projections():
    cfg = _cfg(accum=1).model
    state, axes = abstract_model_state(cfg)
    names = sorted(k.split("'")[-2] for k in _flat(fp8_delayed.histories(state)))
    want = ["down_proj_fp8", "gate_proj_fp8", "k_proj_fp8", "o_proj_fp8", "q_proj_fp8"]
    assert names == sorted([*want, "up_proj_fp8", "v_proj_fp8"])
    assert axes["layers"]["attn"]["q_proj_fp8"] == ("layers", None, None)
    current = abstract_model_state(tiny_model(matmul_dtype="float8"))[0]
    assert fp8_delayed.histories(current) == {}


def test_matmul_takes_the_delayed_path_through_lora_kernels():
    """A weight with a history goes through `fp8_delayed.einsum` (its history gets a
    cotangent) also as a LoRA adapter's base."""
    x, w, _, h = _inputs()

    a = jnp.zeros((32, 2)) + 0.01
    b = jnp.zeros((2, 16)) + 0.01

    def f(h, lora):
        k = fp8_delayed.DelayedKernel(jnp.asarray(w), h)
        k = LoRAKernel(k, a, b, 1.0, 0.0, None, False, None) if lora else k
        return jnp.sum(layers.matmul("ad,df->af", x, k, jnp.float32, fp8="delayed"))

    for lora in (False, True):
        dh = jax.grad(f)(jnp.asarray(h), lora)
        assert np.all(np.asarray(dh)[:, 0] > 0) and not np.asarray(dh)[:, 1:].any()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.fp8_scaling=delayed"], "needs model.matmul_dtype=float8"),
        (
            ["model.matmul_dtype=float8", "model.fp8_amax_history=16"],
            "model.fp8_amax_history needs model.fp8_scaling=delayed",
        ),
        (
            ["model.matmul_dtype=float8", "model.fp8_scaling=delayed", "model.fp8_amax_history=0"],
            "model.fp8_amax_history must be >= 1",
        ),
        (
            ["model.matmul_dtype=float8", "model.fp8_scaling=delayed", "mesh.stage=2"],
            "model.fp8_scaling=delayed records its amaxes",
        ),
    ],
)
def test_delayed_config_errors_are_one_line(overrides, message, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as e:
        config.load(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


# SMALL_RUN (fsdp over every device) in bfloat16 with delayed fp8, two microbatches, a schedule independent of the
# number of steps (so 4 + 2 steps are 6 steps).
DELAYED_RUN = [
    *SMALL_RUN,
    "model.dtype=bfloat16",
    "model.matmul_dtype=float8",
    "model.fp8_scaling=delayed",
    "model.fp8_amax_history=16",
    "train.global_batch_size=16",  # two microbatches of 8 rows over the 8 fsdp devices
    "train.grad_accum_steps=2",
    "checkpoint.every=2",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
]


@pytest.mark.slow  # ~70 s
def test_the_histories_are_checkpointed_and_a_resume_is_bit_identical(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *DELAYED_RUN, "train.steps=6", f"run.dir={straight}"]) == 0
    assert main(["train", *DELAYED_RUN, "train.steps=4", f"run.dir={resumed}"]) == 0
    assert main(["train", *DELAYED_RUN, "train.steps=6", f"run.dir={resumed}"]) == 0
    losses = [[(r["step"], r["loss"]) for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
              for run in (straight, resumed)]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 6
    a, b = (_flat(fp8_delayed.histories(restore(run).model_state)) for run in (straight, resumed))
    assert a.keys() == b.keys() and a
    for key, h in a.items():
        np.testing.assert_array_equal(h, b[key])
        assert np.all(h[..., :6] > 0) and not h[..., 6:].any(), key  # six steps recorded


def test_export_leaves_the_histories_behind_and_import_starts_them_at_zero(tmp_path):
    """Hugging Face has no amax histories: export writes the weights alone, and importing into
    a delayed config starts every history empty (current scaling at its first step)."""
    from safetensors import safe_open

    from jaxllm.convert.export import export_hf
    from jaxllm.convert.hf import load_params
    from jaxllm.model import build, split_peft

    cfg = _cfg(accum=1)
    _, params, _, model_state = split_peft(build(cfg.model, 0), None)
    model_state = jax.tree.map(lambda h: h + 1.0, model_state)  # a trained run's, say
    export_hf(params, cfg, tmp_path / "hf", model_state=model_state)
    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        names = list(f.keys())
    assert names and not any("fp8" in n for n in names)
    mesh = sharding.make_mesh(config.MeshConfig(data=1), jax.devices()[:1])
    back, state, _ = load_params(tmp_path / "hf", cfg.model, mesh)
    hist = _flat(fp8_delayed.histories(state))
    assert hist.keys() == _flat(fp8_delayed.histories(model_state)).keys()
    assert all(not h.any() for h in hist.values())
    for key, w in _flat(params).items():
        np.testing.assert_array_equal(_flat(back)[key], w)


@pytest.mark.slow  # ~50 s
def test_a_compressed_exchange_records_the_replicas_largest_amax(tmp_path):
    """With train.grad_compression each data replica runs its own rows; the amaxes are the
    largest over the replicas (a pmax), so step 1 records what the uncompressed step does."""
    runs = {}
    for name, extra in (("plain", []), ("topk", ["train.grad_compression=topk"])):
        run = tmp_path / name
        argv = [*DELAYED_RUN, "mesh.data=-1", "mesh.fsdp=1", "train.steps=1", *extra]
        assert main(["train", *argv, f"run.dir={run}"]) == 0
        runs[name] = _flat(fp8_delayed.histories(restore(run).model_state))
    assert runs["plain"].keys() == runs["topk"].keys() and runs["plain"]
    for key, h in runs["plain"].items():
        # bfloat16 rounding differs between the sharded and the per-replica passes; a sum
        # over the 8 replicas would be several times larger
        np.testing.assert_allclose(runs["topk"][key][..., 0], h[..., 0], rtol=2e-2, err_msg=key)
        assert np.all(h[..., 0] > 0)
