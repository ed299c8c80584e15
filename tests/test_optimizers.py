"""The optimizer zoo (`optim.name`): every optimizer trains, the two written here (Adam-mini,
8-bit AdamW) match plain-numpy versions of their papers' updates, the optimizer-state bill per
parameter matches the formula, states shard like their parameters on an 8-device mesh, and a
resume is bit-identical."""

import json
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN, abstract_state

from jaxllm import config, optim, sharding
from jaxllm.cli import main
from jaxllm.optim import adam_mini, adamw_8bit
from jaxllm.plan import memory_bill
from jaxllm.train.state import opt_state_shardings

NAMES = list(config.OPTIM_READS)

# A tiny problem with the model's naming: a stacked matrix, an embedding, a norm scale.
AXES = {
    "layers": {"mlp": {"up_proj": ("layers", "embed", "mlp")}, "norm": {"scale": ("norm",)}},
    "embed": {"embedding": ("vocab", "embed")},
}
SHAPES = {"layers": {"mlp": {"up_proj": (2, 16, 8)}, "norm": {"scale": (16,)}}}
SHAPES["embed"] = {"embedding": (12, 16)}
is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
LR = {"sgd": 0.3, "adagrad": 0.3, "sm3": 0.3}  # the rest: 0.03


def _problem(seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s), SHAPES, is_leaf=is_axes)
    targets = jax.tree.map(lambda s: jax.random.normal(next(keys), s), SHAPES, is_leaf=is_axes)
    return params, targets


@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_reduces_the_loss(name):
    params, targets = _problem()

    def loss(p):
        return sum(
            jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(targets))
        )

    cfg = config.OptimConfig(
        name=name, lr=LR.get(name, 0.03), schedule="constant", warmup_steps=0, weight_decay=0.0
    )
    tx = optim.build(cfg, total_steps=100, axes=AXES)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), state

    first = loss(params)
    for _ in range(60):
        params, state = step(params, state)
    assert loss(params) < 0.5 * first, (name, first, loss(params))


def test_keys_an_optimizer_ignores_are_config_errors():
    with pytest.raises(
        config.ConfigError, match="optim.momentum does nothing with optim.name=adamw"
    ):
        config.load(None, ["optim.momentum=0.9"])
    with pytest.raises(config.ConfigError, match="optim.amsgrad does nothing.*lion"):
        config.load(None, ["optim.name=lion", "optim.amsgrad=true"])
    with pytest.raises(config.ConfigError, match="optim.block_size"):
        config.load(None, ["optim.name=adam_mini", "optim.block_size=256"])
    with pytest.raises(config.ConfigError, match="nesterov=true needs optim.momentum"):
        config.load(None, ["optim.name=sgd", "optim.nesterov=true"])
    config.load(None, ["optim.name=sgd", "optim.momentum=0.9", "optim.nesterov=true"])


def test_readme_lists_every_optimizer_and_its_examples_load():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Optimizers\n") : text.index("## Data\n")]
    for name, keys in config.OPTIM_READS.items():
        row = next(r for r in section.splitlines() if r.startswith("|") and f"`{name}`" in r)
        assert all(f"`{k}`" in row for k in keys - {"weight_decay"}), (name, row)
    lines = [line for line in section.splitlines() if line.startswith("jaxllm ")]
    examples = [shlex.split(line)[2:] for line in lines]
    assert len(examples) == 8  # 3 of schedules and batch-size scaling, 4 of optimizers, 1 of groups
    for keys in examples:
        config.load(None, [k for k in keys if "=" in k])


# ------------------------------------------------------------------------- Adam-mini


def test_adam_mini_blocks_from_logical_axes():
    assert adam_mini.block_dims(("layers", "embed", "heads", "head_dim")) == (0, 2)  # per head
    assert adam_mini.block_dims(("vocab", "embed")) == (0,)  # per token
    assert adam_mini.block_dims(("layers", "embed", "mlp")) == (0, 2)  # per output neuron
    assert adam_mini.block_dims(("layers", "expert", "mlp", "embed")) == (0, 1, 3)
    assert adam_mini.block_dims(("layers", "norm")) == (0,)  # one per layer's vector


def _numpy_adam_mini(params, grads_seq, b1, b2, eps):
    """Zhang et al. 2024, Algorithm 1 per block: m <- b1 m + (1-b1) g; v <- b2 v + (1-b2)
    mean_block(g*g); update = m_hat / (sqrt(v_hat) + eps)."""
    out = []
    m = {k: np.zeros_like(p) for k, p in params.items()}
    v = {k: None for k in params}
    for t, grads in enumerate(grads_seq, start=1):
        step = {}
        for k, g in grads.items():
            keep = adam_mini.block_dims(FLAT_AXES[k])
            red = tuple(i for i in range(g.ndim) if i not in keep)
            m[k] = b1 * m[k] + (1 - b1) * g
            gm = np.mean(g * g, axis=red, keepdims=True)
            v[k] = (1 - b2) * gm if v[k] is None else b2 * v[k] + (1 - b2) * gm
            step[k] = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
        out.append(step)
    return out


FLAT_AXES = {"q": ("layers", "embed", "heads", "head_dim"), "w": ("embed", "mlp"), "n": ("norm",)}


def test_adam_mini_matches_numpy_reference():
    rng = np.random.default_rng(0)
    shapes = {"q": (2, 8, 4, 3), "w": (8, 5), "n": (8,)}
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads_seq = [
        {k: rng.normal(size=s).astype(np.float32) * 10.0**i for k, s in shapes.items()}
        for i in range(-2, 3)
    ]
    tx = adam_mini.scale_by_adam_mini(FLAT_AXES, b1=0.9, b2=0.95, eps=1e-8)
    state = tx.init(params)
    ref = _numpy_adam_mini(params, grads_seq, 0.9, 0.95, 1e-8)
    for grads, want in zip(grads_seq, ref):
        got, state = tx.update(grads, state)
        for k in shapes:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7)
    assert state.nu["q"].shape == (2, 1, 4, 1)  # one second moment per layer and head


# ------------------------------------------------------------------------- 8-bit AdamW


def _numpy_quantize(x, code, block):
    """bitsandbytes blockwise quantization: absmax per block, nearest code (brute force)."""
    rows = x.reshape(-1, x.shape[-1])
    size = min(block, x.shape[-1])
    q, scales = np.zeros(rows.shape, np.uint8), []
    for r, row in enumerate(rows):
        row_scales = []
        for s in range(0, row.size, size):
            chunk = row[s : s + size]
            absmax = np.abs(chunk).max()
            normed = chunk / (absmax if absmax else 1.0)
            q[r, s : s + size] = np.argmin(np.abs(normed[:, None] - code[None, :]), axis=1)
            row_scales.append(absmax)
        scales.append(row_scales)
    return q.reshape(x.shape), np.array(scales, np.float32).reshape(*x.shape[:-1], -1)


def _numpy_dequantize(q, scales, code, block):
    size = min(block, q.shape[-1])
    return code[q] * np.repeat(scales, size, axis=-1)[..., : q.shape[-1]]


@pytest.mark.parametrize("quantization", ["dynamic", "linear"])
@pytest.mark.parametrize("block", [256, 2048])
def test_adamw_8bit_matches_numpy_reference(quantization, block):
    make = adamw_8bit.dynamic_code if quantization == "dynamic" else adamw_8bit.linear_code
    signed, unsigned = make(True), make(False)
    rng = np.random.default_rng(1)
    shapes = {"wide": (3, 600), "narrow": (4, 16)}  # 600 > 256: several blocks per row
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    b1, b2, eps = 0.9, 0.95, 1e-8
    tx = adamw_8bit.scale_by_adam_8bit(b1, b2, eps, block, quantization)
    state = tx.init(params)
    mq = {k: _numpy_quantize(np.zeros(s, np.float32), signed, block) for k, s in shapes.items()}
    vq = {k: _numpy_quantize(np.zeros(s, np.float32), unsigned, block) for k, s in shapes.items()}
    for t in range(1, 6):
        grads = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
        got, state = tx.update(grads, state)
        for k, g in grads.items():
            mk = b1 * _numpy_dequantize(*mq[k], signed, block) + (1 - b1) * g
            vk = b2 * _numpy_dequantize(*vq[k], unsigned, block) + (1 - b2) * g * g
            want = (mk / (1 - b1**t)) / (np.sqrt(vk / (1 - b2**t)) + eps)
            mq[k], vq[k] = _numpy_quantize(mk, signed, block), _numpy_quantize(vk, unsigned, block)
            np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(state.mu[k], mq[k][0])
            np.testing.assert_array_equal(state.nu[k], vq[k][0])
            np.testing.assert_allclose(state.nu_scale[k], vq[k][1], rtol=1e-6)
    assert state.mu["wide"].dtype == np.uint8
    assert state.mu_scale["wide"].shape == (3, 1 if block == 2048 else 3)


def test_dynamic_code_is_the_bitsandbytes_map():
    signed, unsigned = adamw_8bit.dynamic_code(True), adamw_8bit.dynamic_code(False)
    assert signed.shape == unsigned.shape == (256,)
    assert unsigned.min() == 0 and unsigned.max() == 1 and len(np.unique(unsigned)) == 256
    assert signed.max() == 1 and signed.min() == pytest.approx(-0.99297, abs=1e-5)
    # the smallest decade, 1e-6, holds the means of 2 (signed) or 3 (unsigned) even fractions
    assert signed[signed > 0].min() == pytest.approx(0.55e-6, rel=1e-5)
    assert unsigned[unsigned > 0].min() == pytest.approx(0.325e-6, rel=1e-5)


# ------------------------------------------------------------------------- memory bill


def _state_and_shardings(name, *overrides):
    return abstract_state(f"optim.name={name}", *overrides)[:3]


def _expected_8bit(params, block):
    """2 bytes of codes per parameter plus two float32 scales per block of a row."""
    blocks = sum(
        int(np.prod(p.shape[:-1])) * adamw_8bit.blocks_per_row(p.shape[-1], block)[0]
        for p in jax.tree.leaves(params)
    )
    return 2 + 8 * blocks / sum(p.size for p in jax.tree.leaves(params))


# optimizer -> (overrides, bytes of state per parameter expected, measured over matrices only)
BILL = {
    "sgd": ([], 0.0, False),
    "momentum": (["optim.name=sgd", "optim.momentum=0.9"], 4.0, False),
    "adamw": ([], 8.0, False),
    "lion": ([], 4.0, False),
    "adafactor": ([], 0.0, True),
    "adam_mini": ([], 4.0, False),
    "adamw_8bit": ([], None, False),  # 2 + scales, from the shapes
}


@pytest.mark.parametrize("row", list(BILL))
def test_optimizer_state_bytes_per_parameter_match_the_formula(row):
    overrides, want, matrices = BILL[row]
    name = row if row in config.OPTIM_READS else "sgd"
    state, shardings, axes = _state_and_shardings(name, *overrides)
    bill = memory_bill(state, shardings, axes)
    got = bill["opt_bytes_per_matrix_param" if matrices else "opt_bytes_per_param"]
    if want is None:
        want = _expected_8bit(state.params, config.OptimConfig().block_size)
        assert 2 < want < 2.1
    # 5% of the value, or 5% of a byte where the formula says 0 (step counters, factors)
    assert abs(got - want) <= 0.05 * max(want, 1.0), (row, got, want)
    params_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(state.params))
    assert bill["parameters"] == bill["gradients"] == params_bytes  # one device holds all


def test_bill_per_device_divides_by_the_fsdp_degree():
    state, shardings, axes = _state_and_shardings("adam_mini", "mesh=fsdp")
    bill = memory_bill(state, shardings, axes)
    total = sum(p.size * 4 for p in jax.tree.leaves(state.params))
    assert bill["parameters"] == pytest.approx(total / 8, rel=0.05)
    assert bill["optimizer_state"] == pytest.approx(total / 8, rel=0.05)  # ~4 bytes/param


# ------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("layout", [["mesh=fsdp"], ["mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2"]])
@pytest.mark.parametrize("name", NAMES)
def test_no_large_state_leaf_is_replicated(name, layout):
    state, shardings, _ = _state_and_shardings(name, *layout, "model.num_heads=8")
    largest_dim = max(max(p.shape) for p in jax.tree.leaves(state.params))
    for leaf, sh in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(shardings.opt_state)):
        assert leaf.size <= largest_dim or not sh.is_fully_replicated, (name, leaf.shape)


def test_reduced_states_keep_their_parameters_mesh_axes():
    layout = ["mesh.fsdp=4", "mesh.tensor=2"]
    q_spec = lambda sh: tuple(sh.opt_state[1][0].nu["layers"]["attn"]["q_proj"].spec)  # noqa: E731
    _, sh, _ = _state_and_shardings("adam_mini", *layout)
    # one per layer and head: heads over tensor, the averaged embed dim's fsdp moved to layers
    assert q_spec(sh) == ("fsdp", None, "tensor", None)
    state, sh, _ = _state_and_shardings("adamw_8bit", *layout)
    up = state.params["layers"]["mlp"]["up_proj"]  # (layers, embed, mlp)
    assert tuple(sh.opt_state[1][0].mu["layers"]["mlp"]["up_proj"].spec) == (None, "fsdp", "tensor")
    # one scale per row (mlp = 640 < 2048): mlp's tensor axis joins fsdp on the embed dim
    scale_sh = sh.opt_state[1][0].mu_scale["layers"]["mlp"]["up_proj"]
    assert tuple(scale_sh.spec) == (None, ("fsdp", "tensor"), None)
    assert state.opt_state[1][0].mu_scale["layers"]["mlp"]["up_proj"].shape == (*up.shape[:2], 1)
    state, sh, _ = _state_and_shardings("adafactor", *layout)
    for factor in ("v_row", "v_col"):  # each factor still split over all 8 devices
        shape = getattr(state.opt_state[1][0][0], factor)["layers"]["mlp"]["up_proj"].shape
        sh_f = getattr(sh.opt_state[1][0][0], factor)["layers"]["mlp"]["up_proj"]
        assert np.prod(sh_f.shard_shape(shape)) * 8 == np.prod(shape), (factor, sh_f.spec)


# SOAP's and Shampoo's preconditioners of this problem's 16 x 8 matrices are rank-deficient,
# where float32 rounding picks the basis: tests/test_soap_shampoo.py proves their layouts equal
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("soap", "shampoo")])
def test_sharded_steps_equal_single_device_steps(name):
    """Three jitted steps with parameters and state split over fsdp x tensor (4 x 2) give the
    single-device result: every state sharding is one XLA can run the update under."""
    params, targets = _problem(1)
    cfg = config.OptimConfig(name=name, lr=0.01, schedule="constant", warmup_steps=0)
    tx = optim.build(cfg, total_steps=10, axes=AXES)
    mesh = sharding.make_mesh(config.MeshConfig(data=1, fsdp=4, tensor=2), jax.devices())
    param_sh = sharding.tree_shardings(mesh, AXES)
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
    # LDAdam's subspace is an SVD of sums of sharded matmuls, here at full rank (8) where its
    # error buffer is rounding alone: the summation order shows at 1e-3 (rank 4:
    # tests/test_optim_ldadam.py)
    tol = dict(rtol=1e-3, atol=2e-5) if name == "ldadam" else dict(rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


# ------------------------------------------------------------------------- resume

RUN = [*SMALL_RUN, "optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.every=2"]


def _losses(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


# about 40 s each on 2 CPU cores (-m slow); a bit-identical resume of the default optimizer:
# tests/test_checkpoint.py
@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw_8bit", "adam_mini", "adafactor"])
def test_resume_is_bit_identical(tmp_path, name):
    args = [*RUN, f"optim.name={name}"]
    assert main(["train", *args, "train.steps=4", f"run.dir={tmp_path / 'straight'}"]) == 0
    assert main(["train", *args, "train.steps=2", f"run.dir={tmp_path / 'cut'}"]) == 0
    assert main(["train", *args, "train.steps=4", f"run.dir={tmp_path / 'cut'}"]) == 0
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "straight")
    assert len(_losses(tmp_path / "cut")) == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam_mini", "adamw_8bit", "adafactor"])
def test_resume_on_another_mesh(tmp_path, name):
    args = [*RUN, f"optim.name={name}", "mesh.fsdp=8"]
    assert main(["train", *args, "train.steps=4", f"run.dir={tmp_path / 'straight'}"]) == 0
    assert main(["train", *args, "train.steps=2", f"run.dir={tmp_path / 'moved'}"]) == 0
    moved = [*RUN, f"optim.name={name}", "mesh.fsdp=1", "mesh.data=4", "mesh.tensor=2"]
    assert main(["train", *moved, "train.steps=4", f"run.dir={tmp_path / 'moved'}"]) == 0
    got, want = _losses(tmp_path / "moved"), _losses(tmp_path / "straight")
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-5)
