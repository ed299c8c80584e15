"""Multimodal RoPE (`model.rope.mrope_section`, `jaxllm.model.mrope`) against transformers:
the rotation of Qwen2.5-VL (sections) and Qwen3-VL (interleaved), `mrope_positions` against
`get_rope_index` for images among text, a text-only decoder equal to plain RoPE, the config
refusals, decode after a 3-row prefill, and the Qwen2.5-VL / Qwen3-VL text models' logits given
3-row positions, on one device and on eight."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as hf
from conftest import tiny_model
from flax import nnx
from hf_models import SMALL, VOCAB, run_cli, save_hf
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5_vl
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

import jaxllm
from jaxllm import config, sharding
from jaxllm.config import GenerateConfig, MeshConfig
from jaxllm.convert import families
from jaxllm.infer import generate, kv_cache
from jaxllm.model import Transformer, apply_rope, mrope_positions, mrope_rows, rope_frequencies

IMAGE, START, END = 301, 300, 302  # placeholder, vision start and vision end token ids
MERGE = 2


def _hf_rotate(family, section, positions_3xBxL, q_BxHxLxK, k_BxHxLxK, theta=10000.0):
    """transformers' rotary module and apply_rotary_pos_emb of Qwen2.5-VL or Qwen3-VL."""
    k = q_BxHxLxK.shape[-1]
    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": list(section)}
    if family is qwen3_vl:
        rope["mrope_interleaved"] = True
        cfg = hf.Qwen3VLTextConfig(head_dim=k, rope_parameters=rope)
        rotary = qwen3_vl.Qwen3VLTextRotaryEmbedding(cfg)
    else:
        cfg = hf.Qwen2_5_VLTextConfig(
            hidden_size=4 * k, num_attention_heads=4, rope_parameters=rope
        )
        rotary = qwen2_5_vl.Qwen2_5_VLRotaryEmbedding(cfg)
    q, kk = torch.tensor(q_BxHxLxK), torch.tensor(k_BxHxLxK)
    cos, sin = rotary(q, torch.tensor(positions_3xBxL, dtype=torch.long))
    q, kk = family.apply_rotary_pos_emb(q, kk, cos, sin)
    return q.numpy(), kk.numpy()


@pytest.mark.parametrize(
    "family, section, interleaved",
    [(qwen2_5_vl, (2, 3, 3), False), (qwen2_5_vl, (5, 1, 4), False), (qwen3_vl, (4, 3, 3), True)],
    ids=["qwen2.5-vl", "qwen2.5-vl-uneven", "qwen3-vl"],
)
def test_rotation_equals_transformers(family, section, interleaved):
    rng = np.random.default_rng(0)
    b, h, length, k = 2, 3, 7, 2 * sum(section)
    positions_3xBxL = rng.integers(0, 50, (3, b, length))
    q = rng.standard_normal((b, h, length, k)).astype(np.float32)
    kk = rng.standard_normal((b, h, length, k)).astype(np.float32)
    want_q, want_k = _hf_rotate(family, section, positions_3xBxL, q, kk)
    rope = config.RopeConfig(mrope_section=section, mrope_interleaved=interleaved)
    inv_freq, _ = rope_frequencies(rope, k)
    rows = mrope_rows(section, interleaved)
    assert np.bincount(rows, minlength=3).tolist() == list(section)
    for x, want in ((q, want_q), (kk, want_k)):
        x_BxLxHxK = jnp.asarray(x.transpose(0, 2, 1, 3))
        got = apply_rope(x_BxLxHxK, jnp.asarray(positions_3xBxL), inv_freq, mrope_rows_K2=rows)
        np.testing.assert_allclose(np.asarray(got).transpose(0, 2, 1, 3), want, atol=1e-5)
    # the layouts really differ: sections read as the other layout rotate otherwise
    other = apply_rope(
        jnp.asarray(q.transpose(0, 2, 1, 3)),
        jnp.asarray(positions_3xBxL),
        inv_freq,
        mrope_rows_K2=mrope_rows(section, not interleaved),
    )
    assert not np.allclose(np.asarray(other).transpose(0, 2, 1, 3), want_q, atol=1e-3)


def _prompt(parts):
    """Token ids of text runs (ints: that many text tokens) and images ((t, h, w) grids:
    vision start, t h w / MERGE**2 placeholders, vision end)."""
    rng = np.random.default_rng(len(parts))
    ids = []
    for part in parts:
        if isinstance(part, int):
            ids += rng.integers(0, 290, part).tolist()
        else:
            t, h, w = part
            ids += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
    return ids


def _get_rope_index(family, input_ids, grids, attention_mask=None):
    """transformers' `get_rope_index` of Qwen2.5-VL or Qwen3-VL (a model method that reads only
    its vision config), on images."""
    owner = family.Qwen3VLModel if family is qwen3_vl else family.Qwen2_5_VLModel
    vision = types.SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=2)
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=vision),
        get_vision_position_ids=functools.partial(owner.get_vision_position_ids, None),
    )
    ids = torch.tensor(input_ids)
    mask = None if attention_mask is None else torch.tensor(attention_mask)
    positions, deltas = owner.get_rope_index(
        fake,
        ids,
        mm_token_type_ids=(ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids),
        attention_mask=mask,
    )
    return positions.numpy(), deltas.numpy()


@pytest.mark.parametrize("family", [qwen2_5_vl, qwen3_vl], ids=["qwen2.5-vl", "qwen3-vl"])
def test_positions_equal_get_rope_index(family):
    one = [(1, 4, 6)]  # a 2 x 3 merged grid
    two = [(1, 6, 4), (2, 2, 4)]  # 3 x 2, then a two-frame 1 x 2
    rows = [_prompt([3, one[0], 5]), _prompt([2, two[0], 4, two[1], 3])]
    length = max(map(len, rows))
    for ids, grids in zip(rows, (one, two), strict=True):
        want = _get_rope_index(family, [ids], grids)
        got = mrope_positions([ids], grids, IMAGE, START, MERGE)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert got[1][0, 0] < 0  # an image takes fewer ids than tokens
    # a batch of both, right-padded, the grids in reading order over the rows
    ids = [r + [0] * (length - len(r)) for r in rows]
    mask = [[1] * len(r) + [0] * (length - len(r)) for r in rows]
    want = _get_rope_index(family, ids, one + two, mask)
    got = mrope_positions(ids, one + two, IMAGE, START, MERGE, attention_mask=mask)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_positions_refuse_placeholders_that_disagree_with_the_grids():
    ids = _prompt([3, (1, 4, 4), 2])
    with pytest.raises(ValueError, match="placeholder tokens"):
        mrope_positions([ids], [(1, 4, 6)], IMAGE, START, MERGE)
    with pytest.raises(ValueError, match="grids for 1 images"):
        mrope_positions([ids], [(1, 4, 4), (1, 4, 4)], IMAGE, START, MERGE)
    with pytest.raises(ValueError, match="vision start"):
        mrope_positions([[IMAGE] * 4 + [5]], [(1, 4, 4)], IMAGE, START, MERGE)
    text = mrope_positions([[1, 2, 3]], None, IMAGE, START, MERGE)
    np.testing.assert_array_equal(text[0], np.broadcast_to(np.arange(3), (3, 1, 3)))


@pytest.mark.parametrize("interleaved", [False, True])
def test_text_only_decoder_equals_plain_rope(interleaved):
    """Same weights; [B, L] positions (packed: two segments) and [3, B, L] equal rows give the
    plain model's logits and gradients; unequal rows change the logits."""
    # 6 of 8 channels turn; weights large enough for positions to move the logits
    plain_cfg = tiny_model(init_std=0.3, rope=config.RopeConfig(partial_factor=0.75))
    rope = config.RopeConfig(
        partial_factor=0.75, mrope_section=(1, 1, 1), mrope_interleaved=interleaved
    )
    mrope_cfg = tiny_model(init_std=0.3, rope=rope)
    mrope_cfg.validate()
    plain = Transformer(plain_cfg, rngs=nnx.Rngs(0))
    model = Transformer(mrope_cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)))
    positions = jnp.asarray(np.concatenate([np.arange(5), np.arange(4)])[None].repeat(2, 0))
    segments = jnp.asarray([[1] * 5 + [2] * 4] * 2)
    want = plain(tokens, positions_BxL=positions, segment_ids_BxL=segments).logits
    for pos in (positions, jnp.broadcast_to(positions, (3, 2, 9))):
        got = model(tokens, positions_BxL=pos, segment_ids_BxL=segments).logits
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(model(tokens).logits, plain(tokens).logits, atol=1e-5)

    def loss(m):  # training on text: the same gradients
        logits = m(tokens, positions_BxL=positions, segment_ids_BxL=segments).logits
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = [jax.tree.leaves(nnx.grad(loss)(m)) for m in (plain, model)]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    moved = positions.at[:, 2].add(3)  # token 2 moved on the height row only
    three = jnp.stack([positions, moved, positions])
    got = model(tokens, positions_BxL=three, segment_ids_BxL=segments).logits
    diff_BxL = np.abs(np.asarray(got) - np.asarray(want)).max(-1)
    # causal, per segment: only token 2 and those after it in its segment see the move
    changed = np.zeros((2, 9), bool)
    changed[:, 2:5] = True
    assert (diff_BxL[changed] > 1e-3).all() and (diff_BxL[~changed] == 0).all(), diff_BxL


def test_decode_after_a_3d_prefill_continues_by_the_rope_delta():
    """A prompt with an image prefilled into the KV cache with its [3, B, L] positions, then
    text decoded token by token at [B, 1] positions length + delta: the logits of one forward
    pass over the whole sequence."""
    rope = config.RopeConfig(mrope_section=(1, 2, 1))
    cfg = tiny_model(vocab_size=320, init_std=0.3, rope=rope)  # sharp attention: positions tell
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    grids = [(1, 4, 6)]
    prompt = _prompt([2, grids[0], 3])
    ids = prompt + [7, 8, 9, 10]
    full_pos, _ = mrope_positions([ids], grids, IMAGE, START, MERGE)
    pos, delta = mrope_positions([prompt], grids, IMAGE, START, MERGE)
    np.testing.assert_array_equal(full_pos[:, :, : len(prompt)], pos)
    tokens = jnp.asarray([ids])
    want = np.asarray(model(tokens, positions_BxL=jnp.asarray(full_pos)).logits)
    n = len(prompt)
    kv = kv_cache.init_cache(
        num_layers=2, batch=1, num_kv_heads=2, head_dim=8, max_len=32, kind="float32"
    )
    view = kv_cache.CacheView(kv, jnp.asarray([n]), jnp.int32(0), prefill=True)
    out = model(tokens[:, :n], positions_BxL=jnp.asarray(pos), cache=view)
    np.testing.assert_allclose(np.asarray(out.logits), want[:, :n], atol=1e-5)
    for t in range(n, len(ids)):
        view = dataclasses.replace(out.cache, lengths_B=jnp.asarray([t + 1]), prefill=False)
        step_pos = jnp.asarray([[t]]) + jnp.asarray(delta)
        out = model(tokens[:, t : t + 1], positions_BxL=step_pos, cache=view)
        np.testing.assert_allclose(np.asarray(out.logits[:, 0]), want[:, t], atol=1e-5)


@pytest.mark.parametrize(
    "rope, needle",
    [
        ({"mrope_section": [4, 4]}, "three positive ints"),
        ({"mrope_section": [2, 3, 2]}, "must sum to half the rotated head width (16 // 2 = 8)"),
        ({"mrope_section": [2, 3, 3], "partial_factor": 0.5}, "(8 // 2 = 4)"),
        ({"mrope_interleaved": True}, "mrope_interleaved needs model.rope.mrope_section"),
        ({"mrope_section": [1, 4, 3], "mrope_interleaved": True}, "interleaved layout"),
        ({"mrope_section": [2, 3, 3], "scaling": "dynamic", "factor": 2.0}, "scaling=dynamic"),
    ],
)
def test_config_refusals(rope, needle):
    model = {"d_model": 64, "num_heads": 4, "num_kv_heads": 2, "rope": rope}
    with pytest.raises(config.ConfigError) as err:
        config.from_dict({"model": model}).model.validate()
    assert needle in str(err.value)


def test_config_refuses_mla_and_encoders_and_exits_2_on_the_command_line(capsys):
    mla = {"num_heads": 4, "num_kv_heads": 4, "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 8}}
    for model in (mla, {"kind": "encoder"}):
        model = {**model, "rope": {"mrope_section": [1, 2, 1]}}
        with pytest.raises(config.ConfigError, match="GQA attention, not with MLA"):
            config.from_dict({"model": model}).model.validate()
    assert run_cli("train", "model.rope.mrope_section=[1,2,3]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm: "), err
    assert "model.rope.mrope_section [1, 2, 3] must sum" in err[0]


# (text model, its config, the LM's family with its config, mrope_section, interleaved)
VL_TEXT = {
    "qwen2.5-vl": (
        qwen2_5_vl.Qwen2_5_VLTextModel,
        functools.partial(hf.Qwen2_5_VLTextConfig, rms_norm_eps=1e-6),  # Qwen2's eps
        (hf.Qwen2ForCausalLM, hf.Qwen2Config, "qwen2"),
        (2, 3, 3),
        False,
    ),
    "qwen3-vl": (
        qwen3_vl.Qwen3VLTextModel,
        hf.Qwen3VLTextConfig,
        (hf.Qwen3ForCausalLM, hf.Qwen3Config, "qwen3"),
        (4, 2, 2),
        True,
    ),
}


@pytest.mark.parametrize("name", list(VL_TEXT))
def test_vl_text_model_logits_with_3d_positions(tmp_path, name):
    """A Qwen2 (Qwen3) checkpoint imported with mrope_section, against transformers' Qwen2.5-VL
    (Qwen3-VL) text model holding the same weights, fed positions of `get_rope_index` for a
    prompt with two images (the placeholders stay ordinary tokens here: no vision tower); the
    same on 8 devices."""
    text_model, text_config, (lm_cls, lm_config, family), section, interleaved = VL_TEXT[name]
    torch.manual_seed(0)
    small = {**SMALL, "head_dim": 16, "attn_implementation": "eager"}
    lm = lm_cls(lm_config(**small)).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rope = {"rope_type": "default", "rope_theta": lm.config.rope_parameters["rope_theta"]}
    rope.update(mrope_section=list(section), mrope_interleaved=interleaved)
    vl = text_model(text_config(**small, rope_parameters=rope)).eval()
    vl.load_state_dict(lm.model.state_dict())
    src = save_hf(lm, tmp_path / "hf")
    overrides = (
        "model.dtype=float32",
        f"model.rope.mrope_section=[{','.join(map(str, section))}]",
        f"model.rope.mrope_interleaved={str(interleaved).lower()}",
    )
    assert run_cli("convert", "import", src, tmp_path / "run", *overrides) == 0
    model = jaxllm.load_model(tmp_path / "run")
    assert model.cfg.rope.mrope_section == section
    with pytest.raises(config.ConfigError, match="model.rope.mrope_section=.* cannot be expressed"):
        families.hf_config(model.cfg, families.FAMILIES[family])  # the LM has no M-RoPE

    grids = [(1, 4, 6), (1, 6, 2)]
    ids = [_prompt([3, grids[0], 4, grids[1], 2])]
    positions, _ = mrope_positions(ids, grids, IMAGE, START, MERGE)
    with torch.no_grad():
        hidden = vl(torch.tensor(ids), position_ids=torch.tensor(positions, dtype=torch.long))
        want = lm.lm_head(hidden.last_hidden_state).numpy()
    got = model(jnp.asarray(ids), positions_BxL=jnp.asarray(positions)).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    # sharded (data 2, fsdp 2, tensor 2), rows and their position rows split over the batch
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    eight = jaxllm.load_model(tmp_path / "run", mesh=mesh)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    tokens_4xL = jax.device_put(np.repeat(np.asarray(ids), 4, 0), rows)
    pos_3x4xL = jax.device_put(
        np.repeat(positions, 4, 1), NamedSharding(mesh, P(None, ("data", "fsdp")))
    )
    sharded = np.asarray(eight(tokens_4xL, positions_BxL=pos_3x4xL).logits)
    np.testing.assert_allclose(sharded, np.repeat(got, 4, 0), atol=1e-5, rtol=1e-5)
    # the same tokens with 1D positions are another computation
    flat = model(jnp.asarray(ids)).logits
    assert not np.allclose(np.asarray(flat), want, atol=1e-3)
    # text generation through the KV cache ([B, L] positions): the LM's own greedy tokens
    prompt = np.random.default_rng(3).integers(0, VOCAB, 9).tolist()
    gen = GenerateConfig(max_new_tokens=12, kv_cache_dtype="float32")
    ours = generate(model, [prompt], gen)
    with torch.no_grad():
        theirs = lm.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )
    assert ours.tokens[0] == theirs[0, len(prompt) :].tolist()
