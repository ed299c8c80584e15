"""Bottleneck adapters (`peft.method=adapter`, Houlsby et al. 2019): h + up(act(down(h))) on
every block's attention and MLP output, the only thing that trains; the base model at step 0;
checkpoints that hold the adapters alone, resume, init_from, generation, eval; no export."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from ast import literal_eval

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_env, tiny_model
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxllm
from jaxllm import cli, config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.infer import generate
from jaxllm.model import build, lora
from jaxllm.train.loop import compile_steps, to_global, train
from jaxllm.train.state import init_state, layout

ADAPTER = PeftConfig(method="adapter", adapter_size=8)
SITES = ("attn", "mlp")
PARTS = ("down", "down_bias", "up", "up_bias")


def _randomize(model, seed=0, scale=0.3):
    """Non-zero adapters (up and both biases start at zero), so they change the outputs."""
    for i, (path, v) in enumerate(nnx.to_flat_state(nnx.state(model, lora.AdapterParam))):
        v.set_value(scale * jax.random.normal(jax.random.key(seed + i), v.shape, v.dtype))


@pytest.mark.parametrize("family", ["dense", "moe_sandwich"])
def test_adapters_start_at_the_base(family):
    cfg = tiny_model()
    if family == "moe_sandwich":  # an MoE group's dense blocks are stacked twice
        moe = config.MoEConfig(num_experts=4, expert_mlp_dim=32, first_dense_layers=1, moe_every=2)
        cfg = tiny_model(num_layers=5, moe=moe, norm_placement="sandwich")
    tokens = jnp.arange(24).reshape(2, 12) % cfg.vocab_size
    model = build(cfg, 0, ADAPTER)
    adapters = nnx.to_flat_state(nnx.state(model, lora.AdapterParam))
    # 4 tensors per site, 2 sites per block, every layer: D m + m + m D + D each
    assert len(adapters) == 8 * (1 + 2 * (family != "dense"))
    count = sum(math.prod(v.shape) for _, v in adapters)
    assert count == cfg.num_layers * 2 * (2 * cfg.d_model * 8 + 8 + cfg.d_model)
    np.testing.assert_array_equal(model(tokens).logits, build(cfg, 0)(tokens).logits)
    _randomize(model)
    assert np.abs(model(tokens).logits - build(cfg, 0)(tokens).logits).max() > 1e-3


def _np_act(name, z):
    return {
        "relu": lambda: np.maximum(z, 0),
        "gelu": lambda: 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2))),
        "silu": lambda: z / (1 + np.exp(-z)),
        "tanh": lambda: np.tanh(z),
    }[name]()


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "tanh"])
def test_one_layer_against_numpy(activation):
    """Layer 0 of a model with random adapters: attention and MLP outputs each pass through
    h + act(h W_down + b_down) W_up + b_up before their residual add, as NumPy computes it."""
    cfg = tiny_model()
    peft = PeftConfig(method="adapter", adapter_size=8, adapter_activation=activation)
    model = build(cfg, 0, peft)
    _randomize(model, seed=3)
    graphdef, state = nnx.split(model.layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    seg = jnp.ones((2, 6), jnp.int32)
    got = block(x, pos, seg)[0]

    def adapter(site, h):
        w = {p: np.asarray(getattr(block, f"{site}_adapter_{p}")[...], np.float64) for p in PARTS}
        z = _np_act(activation, h @ w["down"] + w["down_bias"])
        return h + z @ w["up"] + w["up_bias"]

    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    attn = f64(block.attn(block.attn_norm(x), pos, seg, None, None, None)[0])
    h1 = f64(x) + adapter("attn", attn)
    mlp = f64(block.mlp(block.mlp_norm(jnp.asarray(h1, jnp.float32))))
    want = h1 + adapter("mlp", mlp)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _cfg(**mesh) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=4),
        optim=config.OptimConfig(lr=3e-2, warmup_steps=0, eps=1e-6),
        peft=PeftConfig(method="adapter", adapter_size=16, dropout=0.1),
    )


def _train(cfg, devices):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    start, base = jax.device_get(state.params), jax.device_get(state.frozen)
    losses, batch = [], to_global(synthetic_batch(cfg, seed=0), batch_sh)
    for _ in range(cfg.train.steps):  # one batch again and again: its loss must fall
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state, start, base


def test_only_adapters_train_and_shard_like_the_model():
    """1 device vs data 2 x fsdp 2 x tensor 2 (with adapter dropout): the same losses, which
    fall; every adapter tensor moved, the base none; Adam's moments cover the adapters alone."""
    ref_losses, ref, _, _ = _train(_cfg(), jax.devices()[:1])
    losses, state, start, base = _train(_cfg(data=2, fsdp=2, tensor=2), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert losses[-1] < losses[0]
    # Adam divides by the gradients' size: the reductions' other order shows at ~1e-5 of lr
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(jax.device_get(ref.params))):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-4)
    layers = state.params["layers"]
    assert set(state.params) == {"layers"}
    assert set(layers) == {f"{s}_adapter_{p}" for s in SITES for p in PARTS}
    for name, value in layers.items():
        assert np.abs(np.asarray(value) - start["layers"][name]).max() > 0, name
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(base)):
        np.testing.assert_array_equal(a, b)
    assert "attn_adapter_down" not in state.frozen["layers"]
    adam = state.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(state.params)
    assert layers["attn_adapter_down"].sharding.spec == P(None, "fsdp", None)
    assert layers["mlp_adapter_up"].sharding.spec == P(None, None, "fsdp")


TINY = [
    "data.max_files=40",
    "data.seq_len=64",
    "model.num_layers=2",
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "optim.warmup_steps=0",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def _run(run_dir, *overrides):
    return train(config.load(None, [*TINY, f"run.dir={run_dir}", *overrides]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(a base run, an adapter run of 4 steps on it, its arguments)."""
    tmp = tmp_path_factory.mktemp("bottleneck")
    _run(tmp / "base", "train.steps=2")
    args = ["peft.method=adapter", "peft.adapter_size=8", "optim.lr=1e-2"]
    args += [f"checkpoint.init_from={tmp / 'base'}", "checkpoint.every=2"]
    _run(tmp / "adapter", *args, "train.steps=4")
    return tmp / "base", tmp / "adapter", args


def _stored(item) -> dict:
    """A checkpoint item's tensors by key path: the shapes Orbax records (one shard's)."""
    tree = json.loads((item / "_METADATA").read_text())["tree_metadata"]
    return {k: leaf["value_metadata"].get("write_shape") or [] for k, leaf in tree.items()}


def test_checkpoints_hold_adapters_resume_exactly_and_generate(runs, tmp_path, capsys):
    base, run, args = runs

    def evals(r):
        rows = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]
        return [row["eval_loss"] for row in rows if "eval_loss" in row]

    assert evals(run)[-1] < evals(base)[-1]  # the same held-out batch, base vs adapted
    names = {f"{s}_adapter_{p}" for s in SITES for p in PARTS}
    params = _stored(run / "checkpoints/4/params")
    assert {literal_eval(k)[-1] for k in params} == names and {
        literal_eval(k)[0] for k in params
    } == {"layers"}
    size = sum(math.prod(s) for s in params.values())  # of 4,384 adapter values, one in 8
    assert size * 20 < sum(math.prod(s) for s in _stored(base / "checkpoints/2/params").values())
    moments = [
        literal_eval(k) for k in _stored(run / "checkpoints/4/train") if "mu" in k or "nu" in k
    ]
    assert len(moments) == 16 and {k[-1] for k in moments} == names  # Adam's, adapters alone
    record = jaxllm.checkpoint.read_json_item(run / "checkpoints", 4, "base")
    assert record["source"] == str((base / "checkpoints/2").resolve())
    # resume from step 2 gives the same adapters as the run straight through
    shutil.copytree(run, tmp_path / "split")
    shutil.rmtree(tmp_path / "split/checkpoints/4")
    _run(tmp_path / "split", *args, "train.steps=4")
    a, b = jaxllm.load_model(run), jaxllm.load_model(tmp_path / "split")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(x, y)
    # the loaded model is the base (unchanged) with the trained adapters applied
    plain = jaxllm.load_model(base)
    trained = nnx.to_pure_dict(nnx.state(a, nnx.Param))
    adapters = {k: trained["layers"].pop(k) for k in list(trained["layers"]) if "_adapter_" in k}
    assert len(adapters) == 8 and np.abs(adapters["mlp_adapter_up"]).max() > 0
    frozen = nnx.to_pure_dict(nnx.state(plain, nnx.Param))
    for x, y in zip(jax.tree.leaves(trained), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(x, y)
    tokens = jnp.asarray([[72, 101, 108, 108, 111, 32]])
    logits = a(tokens).logits
    assert np.abs(logits - plain(tokens).logits).max() > 1e-4
    # generation (prefill, then the KV cache) is greedy decoding of the adapted model
    out = generate(a, [tokens[0].tolist()], config.GenerateConfig(max_new_tokens=4)).tokens[0]
    seq = tokens
    for _ in range(4):
        nxt = jnp.argmax(a(seq).logits[:, -1], -1)
        seq = jnp.concatenate([seq, nxt[:, None]], axis=1)
    assert list(out) == seq[0, 6:].tolist()
    assert cli.main(["eval", str(run), "train.eval_batches=1"]) == 0
    assert "step 4" in capsys.readouterr().out


def _fails(capsys, *argv) -> str:
    assert cli.main([str(a) for a in argv]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("jaxllm:") and len(err.strip().splitlines()) == 1, err
    return err


def test_export_is_refused_and_writes_nothing(runs, tmp_path, capsys):
    _, run, _ = runs
    for flags in (["--peft"], ["--merge"], ["--merge", "--format", "gguf"]):
        out = tmp_path / "out"
        err = _fails(capsys, "convert", "export", run, out, *flags)
        assert "bottleneck-adapter run (peft.method=adapter)" in err and "merge into no" in err
        assert not out.exists() and not any(tmp_path.iterdir())


def test_init_from_an_adapter_run(runs, tmp_path):
    """continue: its adapters train on over its base (here at lr 0: the same model); a run that
    would merge them, or continue them at another size, is refused at start-up."""
    base, run, _ = runs
    keep = ["peft.method=adapter", "peft.adapter_size=8", f"checkpoint.init_from={run}"]
    keep += ["checkpoint.init_adapters=continue", "optim.lr=0", "train.steps=1"]
    _run(tmp_path / "cont", *keep)
    tokens = jnp.asarray([[1, 2, 3, 4, 5]])
    a, b = jaxllm.load_model(run), jaxllm.load_model(tmp_path / "cont")
    np.testing.assert_array_equal(a(tokens).logits, b(tokens).logits)
    record = jaxllm.checkpoint.read_json_item(tmp_path / "cont/checkpoints", 1, "base")
    assert record["source"] == str((base / "checkpoints/2").resolve())
    with pytest.raises(ConfigError, match="is a bottleneck-adapter run .* merge into no weight"):
        _run(tmp_path / "m", "peft.method=lora", f"checkpoint.init_from={run}", "train.steps=1")
    with pytest.raises(ConfigError, match="has peft.adapter_size=8, where this run has peft.a"):
        _run(tmp_path / "c", *keep, "peft.adapter_size=4")
    with pytest.raises(ConfigError, match="has peft.method=adapter, where this run has peft.m"):
        _run(tmp_path / "c", *keep, "peft.method=lora")
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()


def test_bad_values_are_one_line_and_exit_2(tmp_path):
    for args, message in [
        (["peft.adapter_size=0"], "peft.adapter_size must be >= 1, not 0."),
        (["peft.adapter_activation=sigmoid"], "peft.adapter_activation must be one of relu,"),
        (["peft.dropout=1.0"], "peft.dropout must be in [0, 1), not 1.0."),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.load(None, ["peft.method=adapter", *args])
    env = cpu_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "jaxllm", "train", "peft.method=adapter", "peft.adapter_size=0"]
    proc = subprocess.run(
        [*cmd, f"run.dir={tmp_path / 'r'}"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "jaxllm: config error: peft.adapter_size must be >= 1, not 0."
    ), proc.stderr
    assert not (tmp_path / "r").exists()
    # a model without the blocks adapters go into: refused when the model is built
    t5 = tiny_model(kind="encoder_decoder", position="relative", num_kv_heads=4)
    with pytest.raises(ConfigError, match="model.kind=encoder_decoder has none it can adapt"):
        build(t5, 0, ADAPTER)
