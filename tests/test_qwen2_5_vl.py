"""Qwen2.5-VL (`qwen2_5_vl`): `model.vision` builds the decoder with its vision tower, whose
features replace the image tokens' embeddings; a tiny odd-shaped
`Qwen2_5_VLForConditionalGeneration` imports with transformers' logits for one and two images
(positions from `mrope_positions`), exports to the same bytes and a config transformers loads,
and a `model.vision` the model cannot run is refused in one line."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as hf
from flax import nnx
from hf_models import run_cli, save_hf, stderr_of_failure
from safetensors.numpy import load_file

import jaxllm
from jaxllm import config as config_lib
from jaxllm import sharding
from jaxllm.config import GenerateConfig
from jaxllm.config.errors import ConfigError
from jaxllm.config.sections import MeshConfig
from jaxllm.infer import generate, greedy_continue
from jaxllm.model import build, logical_axes, mrope_positions
from jaxllm.model.vlm import VisionLanguageModel

IMAGE, START, END = 293, 291, 292
TEXT = dict(
    vocab_size=301,
    hidden_size=60,
    intermediate_size=76,
    num_hidden_layers=3,
    num_attention_heads=5,
    num_key_value_heads=1,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 1]},
    tie_word_embeddings=False,
)
VISION = dict(
    depth=3,
    hidden_size=36,
    num_heads=3,
    intermediate_size=44,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=16,
    fullatt_block_indexes=[1],
    out_hidden_size=60,
)
ONE = [(1, 4, 6)]
TWO = [(1, 4, 6), (1, 6, 8)]


def qwen2_5_vl(seed=0):
    torch.manual_seed(seed)
    cfg = hf.Qwen2_5_VLConfig(
        text_config=TEXT,
        vision_config=VISION,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=294,
        attn_implementation="eager",
    )
    model = hf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # perturb everything: unit norms and zero biases would hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def prompt(grids, seed=0):
    """Token rows [2, L]: row 0 holds the images (text around each), row 1 is text only."""
    rng = np.random.default_rng(seed)
    row = list(rng.integers(0, 290, 3))
    for t, h, w in grids:
        row += [START] + [IMAGE] * (t * h * w // 4) + [END] + list(rng.integers(0, 290, 2))
    return np.stack([row, rng.integers(0, 290, len(row))]).astype(np.int32)


def pixels(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).normal(size=(n, 3 * 2 * 4 * 4)).astype(np.float32)


def hf_vl_logits(model, tokens, px, grids):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            pixel_values=torch.from_numpy(px),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=torch.tensor(tokens == IMAGE, dtype=torch.int32),  # else 1-D ids
        )
    return out.logits.numpy()


def our_logits(model, tokens, px, grids):
    v = model.cfg.vision
    positions, _ = mrope_positions(tokens, grids, v.image_token_id, v.vision_start_token_id, 2)
    out = model(tokens, pixel_values=px, image_grid_thw=grids, positions_BxL=positions)
    return np.asarray(out.logits)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen2_5_vl")
    model = qwen2_5_vl()
    src = save_hf(model, tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return model, src, tmp


@pytest.mark.parametrize("grids", [ONE, TWO], ids=["one_image", "two_images"])
def test_logits_match_transformers(imported, grids):
    model, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    assert isinstance(ours, VisionLanguageModel)
    assert ours.cfg.rope.mrope_section == (2, 3, 1) and ours.cfg.vision.image_token_id == IMAGE
    tokens, px = prompt(grids), pixels(grids)
    want = hf_vl_logits(model, tokens, px, grids)
    np.testing.assert_allclose(our_logits(ours, tokens, px, grids), want, atol=1e-4, rtol=1e-4)


def test_images_change_the_logits_only_from_their_tokens_on(imported):
    """Causal decoder: the text before the first image does not see it; after it, it does."""
    _, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    tokens = prompt(ONE)
    a = our_logits(ours, tokens, pixels(ONE, 1), ONE)
    b = our_logits(ours, tokens, pixels(ONE, 2), ONE)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    np.testing.assert_array_equal(a[1], b[1])
    assert np.abs(a[0, 4:] - b[0, 4:]).min() > 0


def test_text_only_call_is_the_decoders(imported):
    model, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    tokens = np.random.default_rng(3).integers(0, 290, (2, 9))
    with torch.no_grad():
        want = model(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(tokens).logits), want, atol=1e-4, rtol=1e-4)


def test_imported_model_generates_text_with_its_kv_cache(imported):
    _, _, tmp = imported
    model = jaxllm.load_model(tmp / "run")
    prompt_ids = [7, 3, 99, 41, 5, 18, 260]
    gen = GenerateConfig(max_new_tokens=5, temperature=0.0, kv_cache_dtype="float32")
    want = greedy_continue(model, prompt_ids, 5).tolist()
    assert generate(model, [prompt_ids], gen).tokens[0] == want


def test_export_round_trip_is_byte_identical(imported, tmp_path):
    model, src, tmp = imported
    assert run_cli("convert", "export", tmp / "run", tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name
    back = hf.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    tokens, px = prompt(TWO), pixels(TWO)
    np.testing.assert_allclose(
        hf_vl_logits(back, tokens, px, TWO), hf_vl_logits(model, tokens, px, TWO), atol=1e-5
    )


def test_image_token_count_must_match_the_features(imported):
    _, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    tokens = prompt(ONE)[:, :-4]  # two image tokens cut off
    with pytest.raises(ValueError, match="image tokens for 6 image features"):
        ours(tokens, pixel_values=pixels(ONE), image_grid_thw=ONE)


TINY_VISION = dict(
    patch_size=4,
    depth=2,
    width=32,
    heads=2,
    mlp_dim=40,
    window_size=16,
    fullatt_block_indexes=[1],
    out_dim=48,
)


def model_cfg(**changes):
    fields = dict(
        vocab_size=96,
        d_model=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=72,
        rope={"mrope_section": [2, 2, 2]},
        vision={**TINY_VISION, "image_token_id": 90, "vision_start_token_id": 88},
    )
    return config_lib.from_dict({"model": {**fields, **changes}}).model


def test_model_vision_builds_the_tower_with_logical_axes():
    cfg = model_cfg()
    model = build(cfg)
    assert isinstance(model, VisionLanguageModel) and len(model.visual.blocks) == 2
    assert model.visual.patch_embed.axes == ("vision_patch", "embed")
    assert model.visual.blocks[0].attn.q_proj.axes == ("embed", "heads", "head_dim")
    assert not isinstance(build(model_cfg(vision=None)), VisionLanguageModel)


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(rope={}), "model.rope.mrope_section"),
        (
            dict(d_model=60, num_heads=5, num_kv_heads=5),  # 5 heads do not share 2 kv heads
            "model.vision.out_dim=48 must equal model.d_model=60",
        ),
        (
            dict(vision={**TINY_VISION, "image_token_id": 96}),
            "model.vision.image_token_id=96 is outside",
        ),
        (dict(vision={**TINY_VISION, "heads": 3}), "model.vision.width=32 must split"),
    ],
)
def test_bad_model_vision_is_refused_in_one_line(changes, words):
    with pytest.raises(ConfigError) as e:
        model_cfg(**changes).validate()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_gradients_reach_the_tower_through_the_image_tokens_only():
    model = build(model_cfg())
    grids = [(1, 4, 4)]
    tokens = np.array([[5, 88] + [90] * 4 + [7, 8]], np.int32)
    px = jnp.asarray(np.random.default_rng(0).normal(size=(16, 96)), jnp.float32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, with_image):
        m = nnx.merge(graphdef, params, rest)
        kw = dict(pixel_values=px, image_grid_thw=grids) if with_image else {}
        return m(jnp.asarray(tokens), **kw).logits[0, -1].sum()

    patch = [jax.grad(loss)(params, w)["visual"]["patch_embed"][...] for w in (True, False)]
    assert np.abs(np.asarray(patch[0])).max() > 0 and not np.asarray(patch[1]).any()


def test_model_vision_survives_dump_and_load(tmp_path):
    cfg = config_lib.from_dict({"model": dataclasses.asdict(model_cfg())})
    config_lib.dump(cfg, tmp_path / "config.yaml")
    assert config_lib.load(tmp_path / "config.yaml").model == cfg.model


def test_cli_refuses_a_vision_model_without_mrope_in_one_line(capsys):
    err = stderr_of_failure(capsys, "train", "model.vision.out_dim=256")
    assert "model.rope.mrope_section" in err and err.count("\n") == 1


def test_sharded_model_with_images_equals_one_device():
    """Decoder and tower laid out by their logical axes on data x fsdp x tensor = 2 x 2 x 2,
    an image in each row: the same logits and gradients as on one device."""
    vision = {**TINY_VISION, "heads": 4, "mlp_dim": 48, "image_token_id": 90}
    cfg = model_cfg(vision={**vision, "vision_start_token_id": 88}, dtype="float32")
    model = build(cfg, seed=2)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    graphdef, params = nnx.split(model)
    state = nnx.to_pure_dict(params)
    placed = jax.device_put(state, sharding.tree_shardings(mesh, logical_axes(params)))
    grids = [(1, 4, 4), (1, 4, 4)]
    tokens = np.array([[5, 88] + [90] * 4 + [7, 8], [88] + [90] * 4 + [9, 6, 4]], np.int32)
    positions, _ = mrope_positions(tokens, grids, 90, 88, 2)
    px = jnp.asarray(np.random.default_rng(0).normal(size=(32, 96)), jnp.float32)

    def loss(state, p):
        out = nnx.merge(graphdef, state)(
            jnp.asarray(tokens), pixel_values=p, image_grid_thw=grids, positions_BxL=positions
        )
        return jnp.sum(jnp.sin(out.logits)), out.logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, want), want_g = step(state, px)
    with sharding.active(sharding.Parallel(mesh=mesh)):
        (_, got), got_g = step(placed, px)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # The embedding table's gradient is left out: on this layout it differs for the text-only
    # decoder as well (rows of the batch's tokens and row 0), a matter of the decoder's lookup.
    for key in ("visual", "layers", "final_norm"):
        for a, b in zip(jax.tree.leaves(got_g[key]), jax.tree.leaves(want_g[key])):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
