"""`checkpoint.quantize_opt_state=int8`: the optimizer's float moments saved as blockwise 8-bit
codes (a quarter of the bytes), dequantized on resume; optimizers without moments refused."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from test_checkpoint import TINY, _losses

from jaxllm import config
from jaxllm.checkpoint import quantized, read_json_item
from jaxllm.config import ConfigError
from jaxllm.optim.master import with_master_weights
from jaxllm.train.loop import train


def test_pack_keeps_structure_and_each_moment_within_its_block_error():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(k1, (6, 512)), "b": jax.random.normal(k2, (512,))}
    tx = with_master_weights(optax.adamw(1e-3), jnp.float32)
    state = tx.init(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
    # give the moments values of very different sizes, as training does
    grads = jax.tree.map(
        lambda p: p * jnp.broadcast_to(jnp.logspace(-6, 0, p.shape[-1]), p.shape), params
    )
    _, state = tx.update(grads, state, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
    packed = quantized.pack(state)
    leaves = jax.tree.leaves(packed)
    assert {x.dtype for x in leaves} >= {jnp.dtype(jnp.uint8)}
    assert packed.master["w"].dtype == jnp.float32  # the master weights are never quantized
    abstract = jax.eval_shape(lambda: state)
    back = quantized.unpack(packed, abstract)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for path, a, b in zip(
        jax.tree_util.tree_flatten_with_path(state)[0],
        jax.tree.leaves(state),
        jax.tree.leaves(back),
        strict=True,
    ):
        assert a.dtype == b.dtype and a.shape == b.shape
        name = jax.tree_util.keystr(path[0])
        if "master" in name or a.ndim == 0:
            np.testing.assert_array_equal(a, b)  # untouched
            continue
        # the dynamic code book: ~6% of the value near the block's max, at most 0.8% of the
        # max below it (fine steps for small values, 7 decades down)
        blocks = np.asarray(a).reshape(*a.shape[:-1], -1, min(a.shape[-1], quantized.BLOCK))
        scale = np.abs(blocks).max(-1, keepdims=True)
        err = np.abs(np.asarray(b) - np.asarray(a)).reshape(blocks.shape)
        assert (err <= np.maximum(0.11 * np.abs(blocks), 0.008 * scale)).all(), name
        assert not np.array_equal(a, b) or not np.any(a), name  # it was quantized


def _run_dir_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _array_bytes(path):
    """{dtype: bytes} of the arrays an Orbax item holds, from its metadata."""
    tree = ocp.StandardCheckpointer().metadata(path.absolute()).item_metadata.tree
    out = {}
    for x in jax.tree.leaves(tree):
        out[str(x.dtype)] = out.get(str(x.dtype), 0) + int(np.prod(x.shape)) * x.dtype.itemsize
    return out


@pytest.mark.slow
def test_int8_moments_quarter_the_bytes_and_resume_close(tmp_path):
    def run(name, steps, *extra):
        cfg = config.load(
            None,
            [*TINY, f"train.steps={steps}", "checkpoint.every=4", f"run.dir={tmp_path / name}"]
            + list(extra),
        )
        train(cfg)
        return tmp_path / name

    plain = run("plain", 8)
    packed = run("int8", 8, "checkpoint.quantize_opt_state=int8")
    assert read_json_item(packed / "checkpoints", 4, quantized.CODEC_ITEM)["format"] == "int8"
    assert read_json_item(plain / "checkpoints", 4, quantized.CODEC_ITEM) is None
    full = _array_bytes(plain / "checkpoints/4/train")
    small = _array_bytes(packed / "checkpoints/4/train")
    assert small["uint8"] == full["float32"] // 4  # a byte for each float32 of mu and nu
    assert small["float32"] < full["float32"] // 50  # the block scales
    # on disk (Orbax's compression, metadata and file layout included, which vary between
    # runs: under 0.65 of the float checkpoint in most runs, 0.77 in one) smaller than it
    disk = _run_dir_bytes(packed / "checkpoints/4/train")
    assert disk < 0.9 * _run_dir_bytes(plain / "checkpoints/4/train")
    assert _losses(packed) == _losses(plain)  # saving changes nothing in the run itself
    shutil.rmtree(packed / "checkpoints/8")
    run("int8", 8, "checkpoint.quantize_opt_state=int8")  # resumes from step 4's codes
    ours, theirs = _losses(packed), _losses(plain)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[s] == theirs[s] for s in range(1, 5))  # before the resume: the same run
    for s in range(5, 9):  # after it: close, not equal (the moments were rounded)
        assert abs(ours[s] - theirs[s]) < 0.02 * theirs[s], (s, ours[s], theirs[s])
    assert any(ours[s] != theirs[s] for s in range(5, 9))
    run("int8", 10)  # 8-bit moments resume under quantize_opt_state=none too (its opt_codec)
    assert read_json_item(packed / "checkpoints", 10, quantized.CODEC_ITEM) is None
    assert sorted(_losses(packed)) == list(range(1, 11))


@pytest.mark.parametrize(
    "optim, needle, fine",
    [
        ("sgd", "optim.name=sgd without momentum keeps no float moments", "optim.momentum=0.9"),
        ("adamw_8bit", "optim.name=adamw_8bit keeps no float moments", "optim.name=adamw"),
    ],
)
def test_an_optimizer_without_float_moments_is_refused(optim, needle, fine):
    with pytest.raises(ConfigError, match=needle):
        config.load(None, [f"optim.name={optim}", "checkpoint.quantize_opt_state=int8"])
    config.load(None, [f"optim.name={optim}", fine, "checkpoint.quantize_opt_state=int8"])


@pytest.mark.slow
def test_an_offloaded_optimizer_state_saves_and_resumes_as_codes(tmp_path):
    keys = [*TINY, "checkpoint.every=1", "optim.offload=host", f"run.dir={tmp_path}"]
    keys.append("checkpoint.quantize_opt_state=int8")
    train(config.load(None, [*keys, "train.steps=2"]))
    assert _array_bytes(tmp_path / "checkpoints/2/train")["uint8"] > 0
    train(config.load(None, [*keys, "train.steps=3"]))  # restored to host memory again
    assert sorted(_losses(tmp_path)) == [1, 2, 3]
