"""Image-text SFT of a Qwen3-VL tower (learned position embeddings resampled per image grid,
DeepStack features added to the first LM blocks) on packed rows: each packed example computes
what it computes alone, a few steps train, 1 device equals data x fsdp x tensor = 2 x 2 x 2;
the tower's blocks are rematerialised under `model.remat`; a sequence-split mesh on an image
run is refused in one line by the CLI."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

from jaxllm import config as config_lib
from jaxllm import sharding
from jaxllm.data.vision_rows import VisionRows
from jaxllm.model import build, mrope_positions
from jaxllm.objectives.lm import model_inputs
from jaxllm.train.step import BATCH_AXES
from jaxllm.train.vision import run_splits
from tests import test_vlm_sft
from tests.conftest import cpu_env
from tests.test_vlm_sft import _steps, run_cfg

data = test_vlm_sft.data  # the image-text chats fixture

QWEN3 = dict(
    window_size=0,
    fullatt_block_indexes=(),
    norm="layer",
    mlp_activation="gelu_tanh",
    patch_bias=True,
    position_embeddings=16,
    deepstack_indexes=(0, 1),
)


def qwen3_cfg(d, tok, **changes):
    cfg = run_cfg(d, tok, **changes)
    v = dataclasses.replace(cfg.model.vision, **QWEN3)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vision=v))


def perturbed(cfg):
    """The model with every parameter of the tower moved off its init (biases, norms, the
    position table and the DeepStack mergers all matter)."""
    model = build(cfg.model, seed=1)
    state = nnx.state(model.visual, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
    nnx.update(
        model.visual,
        jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), state),
    )
    return model


def rows_batch(rows):
    return {k: np.stack([rows[i][k] for i in range(len(rows))]) for k in rows[0]}


@pytest.mark.slow
def test_packed_qwen3_rows_give_each_example_what_it_computes_alone(data):
    """Every row as one batch: each packed example's logits equal the model's non-packed call
    on that example alone (the Qwen3-VL forward that matches transformers); with the DeepStack
    mergers zeroed they differ, so DeepStack lands at each row's image tokens."""
    cfg = qwen3_cfg(*data)
    rows, _ = run_splits(cfg)
    assert isinstance(rows, VisionRows)
    batch = rows_batch(rows)
    grids = [tuple(g) for ex in rows.examples for g in ex[3]]
    assert len(set(grids)) >= 4  # images of different sizes share rows: tables resampled apart
    model = perturbed(cfg)

    def packed(m):
        return m(
            jnp.asarray(batch["inputs"]),
            segment_ids_BxL=jnp.asarray(batch["segment_ids"]),
            **jax.tree.map(jnp.asarray, model_inputs(batch)),
        ).logits

    out = packed(model)
    v = cfg.model.vision
    checked = 0
    for r in range(len(rows)):
        at = 0
        for d in rows._docs[rows.rows._row_ptr[r] : rows.rows._row_ptr[r + 1]].tolist():
            ids, _, px, g, _ = rows.examples[d]
            inputs = ids[None, :-1]
            if len(g):
                pos, _ = mrope_positions(inputs, g, v.image_token_id, v.vision_start_token_id, 2)
                kw = dict(pixel_values=jnp.asarray(px), image_grid_thw=g, positions_BxL=pos)
                alone = model(jnp.asarray(inputs), **kw).logits
                checked += 1
            else:
                alone = model(jnp.asarray(inputs)).logits
            got = out[r, at : at + len(ids) - 1]
            np.testing.assert_allclose(got, alone[0], atol=3e-5, rtol=1e-5)
            at += len(ids) - 1
    assert checked >= 6
    for merger in model.visual.deepstack:
        merger.fc2_bias[...] = jnp.zeros_like(merger.fc2_bias[...])
        merger.fc2[...] = jnp.zeros_like(merger.fc2[...])
    image = batch["image_units"] >= 0
    after = np.cumsum(image, axis=1) > 0  # tokens at or after a row's first image
    gap = np.abs(np.asarray(packed(model) - out)).max(-1)
    assert gap[after].max() > 1e-3 and gap[~after].max() == 0


@pytest.mark.slow
def test_qwen3_tower_trains_and_data_fsdp_tensor_equals_one_device(data):
    """Three SFT steps on image rows with a Qwen3-VL tower, one compiled step: the loss falls,
    and data x fsdp x tensor = 2 x 2 x 2 gives the losses and every parameter (the position
    table and DeepStack mergers included) of one device."""
    cfg = qwen3_cfg(*data, train__global_batch_size=8)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_embeddings=True))
    want_losses, want = _steps(cfg, jax.devices()[:1])
    assert want_losses[-1] < want_losses[0]
    mesh = config_lib.MeshConfig(data=2, fsdp=2, tensor=2)
    got_losses, got = _steps(dataclasses.replace(cfg, mesh=mesh), jax.devices())
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-6)
    paths = []
    for path, a in jax.tree_util.tree_leaves_with_path(want):
        b = got
        for k in path:
            b = b[k.key]
        name = jax.tree_util.keystr(path)
        paths.append(name)
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-4, err_msg=name)
    assert any("pos_embed" in p for p in paths) and any("deepstack" in p for p in paths)


def _checkpoints(jaxpr) -> int:
    """The rematerialised regions (checkpoint equations) in `jaxpr` and its sub-jaxprs."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in ("checkpoint", "remat2")
        for sub in jaxprs_in_params(eqn.params):
            count += _checkpoints(sub)
    return count


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_towers_blocks_follow_model_remat(data, remat):
    """The gradient of a train step's loss on image rows: under model.remat every tower block
    (and the LM's scan body) is a checkpointed region; without it there is none."""
    cfg = qwen3_cfg(*data)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat))
    rows, _ = run_splits(cfg)
    batch = jax.tree.map(jnp.asarray, rows_batch(rows))
    model = build(cfg.model, seed=0)
    graphdef, params = nnx.split(model)

    def loss(params):
        m = nnx.merge(graphdef, params)
        out = m(batch["inputs"], segment_ids_BxL=batch["segment_ids"], **model_inputs(batch))
        return jnp.sum(out.logits**2)

    count = _checkpoints(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    depth = cfg.model.vision.depth
    assert count == (0 if remat == "none" else depth + 1), count


def test_cli_refuses_a_sequence_split_image_run_in_one_line(data, tmp_path):
    """`jaxllm train ... mesh.sequence=2` on an image run: exit 2, one `jaxllm:` line, no
    traceback, no run directory written."""
    d, tok = data
    cfg = run_cfg(d, tok, run__dir=str(tmp_path / "r"))
    config_lib.dump(cfg, tmp_path / "run.yaml")
    p = subprocess.run(
        [sys.executable, "-m", "jaxllm", "train", str(tmp_path / "run.yaml"), "mesh.sequence=2"],
        env=cpu_env(2),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in p.stderr.splitlines() if x.startswith("jaxllm")]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1 and "mesh.sequence=2: image-text batches" in lines[0], p.stderr


def test_process_rows_with_the_length_split():
    """A batch sharding that splits the length (mesh.sequence) still gives this process's rows."""
    mesh = sharding.make_mesh(config_lib.MeshConfig(data=2, sequence=2), jax.devices()[:4])
    assert sharding.process_rows(sharding.named(mesh, BATCH_AXES), 8) == slice(0, 8)
