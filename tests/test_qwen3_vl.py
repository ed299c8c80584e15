"""Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`): tiny odd-shaped
transformers models import with its logits for one and two images (DeepStack, learned
positions resampled to each grid, interleaved M-RoPE, QK-norm, MoE), export to the same bytes
and a checkpoint transformers loads, and the processor's files travel with the run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as hf
from flax import nnx
from hf_models import run_cli, save_hf, stderr_of_failure
from safetensors.numpy import load_file, save_file
from test_qwen2_5_vl import TWO as TWO_2_5
from test_qwen2_5_vl import hf_vl_logits, our_logits, pixels, prompt, qwen2_5_vl

import jaxllm
from jaxllm import config as config_lib
from jaxllm import sharding
from jaxllm.config.errors import ConfigError
from jaxllm.config.sections import MeshConfig
from jaxllm.convert.families import guess_family
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
    head_dim=16,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)
MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, decoder_sparse_step=1)
VISION = dict(
    depth=3,
    hidden_size=36,
    num_heads=3,
    intermediate_size=44,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=60,
    num_position_embeddings=25,
    deepstack_visual_indexes=[0, 2],
)
ONE = [(1, 4, 6)]
TWO = [(1, 4, 6), (1, 6, 8)]
FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]


def qwen3_vl(family, seed=0):
    torch.manual_seed(seed)
    moe = family == "qwen3_vl_moe"
    config, model = (
        (hf.Qwen3VLMoeConfig, hf.Qwen3VLMoeForConditionalGeneration)
        if moe
        else (hf.Qwen3VLConfig, hf.Qwen3VLForConditionalGeneration)
    )
    cfg = config(
        text_config={**TEXT, **(MOE if moe else {})},
        vision_config=VISION,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=294,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = model(cfg).eval()
    with torch.no_grad():  # perturb everything: unit norms and zero biases would hide mistakes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


PROCESSOR = {
    "preprocessor_config.json": '{"size": {"shortest_edge": 4096, "longest_edge": 65536}}\n',
    "processor_config.json": '{"processor_class": "Qwen3VLProcessor"}\n',
    "chat_template.json": '{"chat_template": "{{ messages }}"}\n',
}


@pytest.fixture(scope="module", params=FAMILIES)
def imported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    model = qwen3_vl(request.param)
    src = save_hf(model, tmp / "hf")
    for name, text in PROCESSOR.items():
        (src / name).write_text(text)
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return request.param, model, src, tmp


@pytest.mark.parametrize("grids", [ONE, TWO], ids=["one_image", "two_images"])
def test_logits_match_transformers(imported, grids):
    family, model, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    assert isinstance(ours, VisionLanguageModel) and guess_family(ours.cfg).name == family
    v = ours.cfg.vision
    assert v.deepstack_indexes == (0, 2) and v.position_embeddings == 25 and v.window_size == 0
    assert (v.min_pixels, v.max_pixels) == (4096, 65536)  # preprocessor_config.json's
    assert ours.cfg.rope.mrope_interleaved and ours.cfg.qk_norm
    assert ours.cfg.moe.enabled == (family == "qwen3_vl_moe")
    tokens, px = prompt(grids), pixels(grids)
    want = hf_vl_logits(model, tokens, px, grids)
    np.testing.assert_allclose(our_logits(ours, tokens, px, grids), want, atol=1e-4, rtol=1e-4)


def test_deepstack_features_reach_the_decoder(imported):
    """Without DeepStack's additions (its mergers' outputs zeroed) the logits after the image
    change: the parity above depends on them."""
    _, _, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    tokens, px = prompt(ONE), pixels(ONE)
    before = our_logits(ours, tokens, px, ONE)
    for merger in ours.visual.deepstack:
        merger.fc2[...] = merger.fc2[...] * 0
        merger.fc2_bias[...] = merger.fc2_bias[...] * 0
    after = our_logits(ours, tokens, px, ONE)
    np.testing.assert_array_equal(before[:, :4], after[:, :4])
    np.testing.assert_array_equal(before[1], after[1])
    assert np.abs(before[0, 4:] - after[0, 4:]).min() > 0


def test_text_only_call_is_the_decoders(imported):
    _, model, _, tmp = imported
    ours = jaxllm.load_model(tmp / "run")
    tokens = np.random.default_rng(3).integers(0, 290, (2, 9))
    with torch.no_grad():
        want = model(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(tokens).logits), want, atol=1e-4, rtol=1e-4)


def test_export_round_trip_is_byte_identical_and_loads_in_transformers(imported, tmp_path):
    family, model, src, tmp = imported
    assert run_cli("convert", "export", tmp / "run", tmp_path / "out") == 0
    original, exported = (load_file(str(p / "model.safetensors")) for p in (src, tmp_path / "out"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and exported[name].tobytes() == t.tobytes(), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == family
    cls = type(model)
    back = cls.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens, px = prompt(TWO), pixels(TWO)
    np.testing.assert_allclose(
        hf_vl_logits(back, tokens, px, TWO), hf_vl_logits(model, tokens, px, TWO), atol=1e-5
    )
    for name, text in PROCESSOR.items():  # the processor's files travel: run, then export
        assert (tmp / "run" / name).read_text() == text
        assert (tmp_path / "out" / name).read_text() == text


def test_moe_imports_the_released_expert_layout(tmp_path):
    """Released Qwen3-VL-MoE files hold experts as [E, D, 2F] and [E, F, D]."""
    model = qwen3_vl("qwen3_vl_moe", seed=4)
    src = save_hf(model, tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if ".experts." in n]:
        tensors[name] = np.ascontiguousarray(np.swapaxes(tensors[name], 1, 2))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert run_cli("convert", "import", src, tmp_path / "run", "model.dtype=float32") == 0
    ours = jaxllm.load_model(tmp_path / "run")
    tokens, px = prompt(TWO), pixels(TWO)
    want = hf_vl_logits(model, tokens, px, TWO)
    np.testing.assert_allclose(our_logits(ours, tokens, px, TWO), want, atol=1e-4, rtol=1e-4)


def test_qwen2_5_vl_processor_files_and_pixel_budget_travel(tmp_path):
    """The pixel budget of preprocessor_config.json is model.vision's; a changed one is
    written back into the exported file."""
    src = save_hf(qwen2_5_vl(), tmp_path / "hf")
    for name, text in PROCESSOR.items():
        (src / name).write_text(text)
    budget = "model.vision.max_pixels=50176"
    assert run_cli("convert", "import", src, tmp_path / "run", "model.dtype=float32", budget) == 0
    v = config_lib.load(tmp_path / "run" / "config.yaml").model.vision
    assert (v.min_pixels, v.max_pixels) == (4096, 50176)
    assert run_cli("convert", "export", tmp_path / "run", tmp_path / "out") == 0
    for name, text in PROCESSOR.items():
        if name != "preprocessor_config.json":
            assert (tmp_path / "out" / name).read_text() == text
    pre = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert pre == {"size": {"shortest_edge": 4096, "longest_edge": 50176}}
    back = hf.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert hf_vl_logits(back, prompt(TWO_2_5), pixels(TWO_2_5), TWO_2_5).shape[0] == 2


TINY = dict(
    patch_size=4,
    depth=2,
    width=32,
    heads=2,
    mlp_dim=40,
    window_size=0,
    fullatt_block_indexes=[],
    out_dim=48,
    norm="layer",
    mlp_activation="gelu_tanh",
    patch_bias=True,
    position_embeddings=16,
    deepstack_indexes=[1],
    image_token_id=90,
    vision_start_token_id=88,
)


def model_cfg(**vision):
    fields = dict(
        vocab_size=96,
        d_model=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=72,
        qk_norm=True,
        dtype="float32",
        rope={"mrope_section": [2, 2, 2], "mrope_interleaved": True},
        vision={**TINY, **vision},
    )
    return config_lib.from_dict({"model": fields}).model


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(fullatt_block_indexes=[1]), "fullatt_block_indexes needs windows"),
        (dict(position_embeddings=15), "position_embeddings=15 must be 0 (none) or a square"),
        (dict(deepstack_indexes=[2]), "deepstack_indexes has 2, outside"),
        (dict(deepstack_indexes=[1, 1]), "repeats a block"),
        (dict(depth=3, deepstack_indexes=[0, 1, 2]), "for model.num_layers=2 decoder layers"),
        (dict(norm="batch"), "model.vision.norm='batch' is not one of"),
        (dict(mlp_activation="relu"), "model.vision.mlp_activation='relu'"),
        (dict(window_size=12), "window_size=12 must be 0 (no windows) or"),
    ],
)
def test_bad_qwen3_tower_options_are_refused_in_one_line(changes, words):
    with pytest.raises(ConfigError) as e:
        model_cfg(**changes).validate()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_bad_tower_options_in_one_line(capsys):
    err = stderr_of_failure(capsys, "train", "model.vision.position_embeddings=3")
    assert "model.vision.position_embeddings=3" in err and err.count("\n") == 1


def test_tower_options_build_their_parameters_and_run_under_jit():
    model = build(model_cfg())
    tower = model.visual
    assert tower.pos_embed.shape == (16, 32) and tower.patch_bias.shape == (32,)
    assert len(tower.deepstack) == 1 and tower.deepstack[0].norm.scale.shape == (128,)
    assert tower.blocks[0].norm1.bias.shape == (32,) and not hasattr(
        tower.blocks[0].mlp, "gate_proj"
    )
    grids = [(1, 4, 6), (2, 2, 2)]
    tokens = np.array([[5, 88] + [90] * 6 + [7, 88] + [90] * 2 + [8]], np.int32)
    positions, _ = mrope_positions(tokens, grids, 90, 88, 2)
    px = np.random.default_rng(0).normal(size=(32, 96)).astype(np.float32)
    eager = model(tokens, pixel_values=px, image_grid_thw=grids, positions_BxL=positions).logits
    got = nnx.jit(
        lambda m, t, p: m(t, pixel_values=p, image_grid_thw=grids, positions_BxL=positions).logits
    )(model, jnp.asarray(tokens), jnp.asarray(px))
    np.testing.assert_allclose(np.asarray(got), np.asarray(eager), atol=1e-5, rtol=1e-5)


def test_sharded_qwen3_tower_and_deepstack_equal_one_device():
    """Qwen3-VL's tower options and DeepStack on data x fsdp x tensor = 2 x 2 x 2, an image in
    each row: the same logits and gradients as on one device."""
    cfg = model_cfg(heads=4, mlp_dim=48, deepstack_indexes=[0, 1])
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
    assert np.abs(np.asarray(want_g["visual"]["deepstack"][0]["fc2"])).max() > 0
    for key in ("visual", "layers", "final_norm"):  # the embedding's: see test_qwen2_5_vl
        for a, b in zip(jax.tree.leaves(got_g[key]), jax.tree.leaves(want_g[key])):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
