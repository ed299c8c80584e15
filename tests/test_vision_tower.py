"""The Qwen2.5-VL vision tower (`jaxllm.model.vision`) against transformers'
`Qwen2_5_VisionTransformerPretrainedModel`: a tiny odd-shaped tower (patches of 3 pixels, heads
of 8, an MLP of 37, windows of 2 x 2 merged units, one full-attention block among three) with
every weight perturbed, its weights carried over by `jaxllm.convert.qwen2_5_vl_vision`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_vl
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

from jaxllm import sharding
from jaxllm.config.errors import ConfigError
from jaxllm.config.sections import MeshConfig
from jaxllm.config.vision import VisionConfig
from jaxllm.convert.qwen2_5_vl_vision import vision_config_from_hf, vision_from_hf, vision_to_hf
from jaxllm.model.layers import logical_axes
from jaxllm.model.vision import VisionTower

HF = dict(
    depth=3,
    hidden_size=40,
    intermediate_size=37,
    num_heads=5,
    in_channels=3,
    patch_size=3,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=12,  # 2 x 2 merged units of 2 x 2 patches of 3 pixels
    fullatt_block_indexes=[1],
    out_hidden_size=24,
)
ONE = [(1, 6, 10)]  # 3 x 5 merged units: windows of 2 x 2, 2 x 1, 1 x 2 and 1 x 1
MANY = [(1, 4, 8), (2, 6, 4), (1, 2, 2)]  # different grids, one of two frames


def hf_tower(seed=0, **changes):
    torch.manual_seed(seed)
    cfg = Qwen2_5_VLVisionConfig(**{**HF, **changes})
    cfg._attn_implementation = "eager"
    model = hf_vl.Qwen2_5_VisionTransformerPretrainedModel(cfg).float().eval()
    with torch.no_grad():  # perturb everything: unit norms and zero biases would hide mistakes
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def pixels(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    width = HF["in_channels"] * HF["temporal_patch_size"] * HF["patch_size"] ** 2
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def hf_out(model, grids, px):
    with torch.no_grad():
        out = model(torch.from_numpy(px), grid_thw=torch.tensor(grids))
    return out.pooler_output.numpy()


def ours(model, **kw) -> VisionTower:
    cfg = vision_config_from_hf(model.config.to_dict())
    tower = VisionTower(cfg, rngs=nnx.Rngs(0), **kw)
    vision_from_hf(tower, {k: v.numpy() for k, v in model.state_dict().items()}, prefix="")
    return tower


@pytest.fixture(scope="module")
def pair():
    model = hf_tower()
    return model, ours(model)


@pytest.mark.parametrize("grids", [ONE, MANY], ids=["one_image", "three_grids"])
def test_merged_tokens_match_transformers(pair, grids):
    model, tower = pair
    px = pixels(grids)
    want = hf_out(model, grids, px)
    got = np.asarray(jax.jit(lambda p: tower(p, grids))(jnp.asarray(px)))
    units = sum(t * h * w for t, h, w in grids) // 4
    assert got.shape == want.shape == (units, HF["out_hidden_size"])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_images_in_one_call_do_not_see_each_other(pair):
    _, tower = pair
    px = pixels(MANY)
    together = np.asarray(nnx.jit(lambda t, p: t(p, MANY))(tower, jnp.asarray(px)))
    start, parts = 0, []
    for t, h, w in MANY:
        n = t * h * w
        run = nnx.jit(lambda tw, p, g=(t, h, w): tw(p, [g]))
        parts.append(np.asarray(run(tower, jnp.asarray(px[start : start + n]))))
        start += n
    np.testing.assert_allclose(together, np.concatenate(parts), atol=1e-5, rtol=1e-5)


def test_window_and_full_blocks_both_matter(pair):
    """The image of 3 x 5 units spans several windows: with every block full (or every block
    windowed) the tokens change, and transformers agrees in each case."""
    model, tower = pair
    lay = tower.layout(ONE)
    assert len(np.unique(lay["window_ids"])) == 6 and len(np.unique(lay["frame_ids"])) == 1
    px = pixels(ONE)
    run = nnx.jit(lambda t, p: t(p, ONE))
    base = np.asarray(run(tower, jnp.asarray(px)))
    for full in ([0, 1, 2], []):
        other = hf_tower(fullatt_block_indexes=full)
        got = np.asarray(run(ours(other), jnp.asarray(px)))
        np.testing.assert_allclose(got, hf_out(other, ONE, px), atol=1e-4, rtol=1e-4)
        assert np.abs(got - base).max() > 1e-2


def test_flash_kernel_takes_the_window_and_image_segments(pair):
    """The Pallas flash kernel (interpreted on CPU) masks by the same segment ids as xla."""
    model, tower = pair
    flash = ours(model, attention_impl="flash")
    px = jnp.asarray(pixels(MANY))
    run = nnx.jit(lambda t, p: t(p, MANY))
    np.testing.assert_allclose(run(flash, px), run(tower, px), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_attention", "dots_with_no_batch_dims"])
def test_remat_keeps_values_and_gradients(pair, remat):
    model, tower = pair
    rematted = ours(model, remat=remat)
    px = jnp.asarray(pixels(MANY))

    def loss(t, p):
        return jnp.sum(jnp.sin(t(p, MANY)))

    (v0, g0), (v1, g1) = (
        nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(t, px) for t in (tower, rematted)
    )
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(g0[1]).sum()) > 0


def test_round_trip_to_hf_is_exact(pair):
    model, tower = pair
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    got = vision_to_hf(tower, prefix="")
    assert set(got) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    with pytest.raises(ValueError, match=r"missing: \['blocks.1.attn.qkv.bias'\]"):
        vision_from_hf(tower, {k: v for k, v in got.items() if k != "blocks.1.attn.qkv.bias"}, "")
    with pytest.raises(ValueError, match="no place in the tower: \\['extra'\\]"):
        vision_from_hf(tower, {**got, "extra": np.zeros(1)}, "")


def test_every_parameter_has_a_sharding_rule(pair):
    _, tower = pair
    axes = nnx.state(tower, nnx.Param)
    for path, p in jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: hasattr(x, "axes")):
        assert len(p.axes) == p[...].ndim, path
        sharding.spec(p.axes)  # unknown logical names raise


def test_sharded_tower_equals_one_device():
    """Parameters laid out by their logical axes on data x fsdp x tensor = 2 x 2 x 2 (a tower
    whose heads and MLP split evenly): the same tokens and gradients as on one device."""
    cfg = dataclasses.replace(vision_config_from_hf(HF), width=32, heads=4, mlp_dim=48)
    tower = VisionTower(cfg, rngs=nnx.Rngs(3))
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, params = nnx.split(tower)
    state = nnx.to_pure_dict(params)
    placed = jax.device_put(state, sharding.tree_shardings(mesh, logical_axes(params)))
    assert placed["merger"]["fc1"].sharding.spec == PartitionSpec("fsdp", "tensor")
    px = jnp.asarray(pixels(MANY))

    def loss(state, p):
        out = nnx.merge(graphdef, state)(p, MANY)
        return jnp.sum(jnp.sin(out)), out

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, want), want_g = step(state, px)
    with sharding.active(sharding.Parallel(mesh=mesh)):
        (_, got), got_g = step(placed, px)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_bad_shapes_are_refused():
    with pytest.raises(ConfigError, match="model.vision.window_size"):
        VisionConfig(window_size=100).validate()
    with pytest.raises(ConfigError, match="model.vision.fullatt_block_indexes"):
        dataclasses.replace(VisionConfig(), depth=4).validate()
    with pytest.raises(ConfigError, match="model.vision.heads"):
        VisionConfig(heads=3).validate()
    tower = VisionTower(vision_config_from_hf(HF), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="spatial_merge"):
        tower.layout([(1, 3, 4)])
    with pytest.raises(ValueError, match="do not match grids"):
        tower(jnp.zeros((10, 54)), [(1, 2, 2)])
