"""Image rollouts on the inference engine: greedy samples equal the static generator's and the
cache-free reference with the same pixels, one engine request per group; a Qwen3-VL tower
(learned position table, DeepStack) samples as `greedy_continue` does and its pi_old and loss
log-probabilities are the model's full forward with the pixels; a short `jaxllm train` GRPO
run of each tower logs its reward, sampled on the engine."""

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import config as config_lib
from jaxllm import sharding
from jaxllm.config import GenerateConfig
from jaxllm.infer.engine import Engine, SamplingParams
from jaxllm.infer.generate import generate as static_generate
from jaxllm.infer.reference import greedy_continue
from jaxllm.model import build, mrope_positions
from jaxllm.model.transformer import Transformer
from jaxllm.objectives.base import token_logps
from jaxllm.objectives.rollout.sampling import Rollouts
from jaxllm.train.step import BATCH_AXES
from tests import test_vlm_grpo
from tests.hf_models import run_cli
from tests.test_vlm_grpo import run_cfg
from tests.test_vlm_qwen3_sft import QWEN3, perturbed

data = test_vlm_grpo.data  # shapes-vqa chats and a tokenizer with the vision specials
one_device = test_vlm_grpo.one_device


def qwen3(cfg):
    """`cfg` with a Qwen3-VL tower: a learned position table resampled per grid, DeepStack
    features added after the first two decoder layers."""
    v = dataclasses.replace(cfg.model.vision, **QWEN3)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vision=v))


def sharpened(model):
    """`model` with its decoder's layers x2 and the tower's mergers (DeepStack's too) x10, so
    that its greedy answers depend on the prompt and on the image (at init they are all one)."""
    state = nnx.state(model, nnx.Param)

    def scale(path, a):
        names = [str(getattr(k, "key", k)) for k in path]
        if "visual" in names:
            return a * 10.0 if any(w in n for n in names for w in ("merger", "deep")) else a
        if "layers" in names and not any("norm" in n for n in names):
            return a * 2.0
        return a

    nnx.update(model, jax.tree_util.tree_map_with_path(scale, state))
    return model


def rollouts(cfg, model):
    """`Rollouts` of `cfg` on one device, and a policy state holding `model`'s weights."""
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    _, params, rest = nnx.split(model, nnx.Param, ...)
    state = SimpleNamespace(
        params=nnx.to_pure_dict(params), frozen={}, model_state=nnx.to_pure_dict(rest), others={}
    )
    return Rollouts(cfg, mesh, sharding.named(mesh, BATCH_AXES), slice(None)), state


@pytest.fixture
def requests(monkeypatch):
    """The images of every request the engine takes (None for a text one)."""
    seen, add = [], Engine.add_request

    def spy(self, prompt, params=None, images=None, **kw):
        seen.append(images)
        return add(self, prompt, params, images=images, **kw)

    monkeypatch.setattr(Engine, "add_request", spy)
    return seen


def test_greedy_image_rollouts_on_the_engine_are_the_static_generators(data, requests):
    """Four prompts, each twice in a row (GRPO groups of 2): one engine request with its
    pixels per group, and greedy completions equal the static generator's and
    `greedy_continue`'s with the same pixels, stops included."""
    cfg = run_cfg(*data)
    model = sharpened(build(cfg.model, seed=1))
    roll, state = rollouts(cfg, model)
    prompts = [p for p in roll.prompts[:4] for _ in range(2)]
    out, seqs = roll._generate(state, prompts, 0.0, 0)
    assert len(requests) == 4 and all(im is not None for im in requests)

    gen = GenerateConfig(max_new_tokens=6, temperature=0.0, kv_cache_dtype="float32")
    ids, pixels = [p.ids for p in prompts], [p.pixels for p in prompts]
    stops = dict(stop_tokens=roll.stops, stop_sequences=roll.stop_sequences)
    static = static_generate(model, ids, gen, images=pixels, **stops)
    assert out.tokens == static.tokens and out.ends == static.ends
    assert out.stopped == static.stopped
    for p, got, end, seq in zip(prompts, out.tokens, out.ends, seqs):
        want = greedy_continue(model, p.ids, 6, pixels=p.pixels).tolist()
        assert got + list(end) == want[: len(got) + len(end)], (got, end, want)
        np.testing.assert_array_equal(seq, np.concatenate([p.ids, got + list(end)]))
    # the image decides the answer: another prompt's image (the same grid) changes it
    swapped = [greedy_continue(model, p.ids, 6, pixels=prompts[0].pixels) for p in prompts[2::2]]
    assert any(list(s[: len(t)]) != t for s, t in zip(swapped, out.tokens[2::2]))


def _reference_logps(model, p, tokens_1xM, deepstack=True):
    """Log p(next token) [M] of prompt + completion from the model's full forward with the
    prompt's pixels: the tower's features (and DeepStack's) at the prompt's image tokens,
    M-RoPE ids of the prompt, then n + rope delta for the completion (a sampled image pad is
    text, as in the decode)."""
    v = model.cfg.vision
    n, m = len(p.ids), tokens_1xM.shape[1]
    grids = np.asarray(p.pixels.image_grid_thw).reshape(-1, 3)
    pos_3x1xM, delta = mrope_positions(
        tokens_1xM[:, :n], grids, v.image_token_id, v.vision_start_token_id, v.spatial_merge
    )
    after = np.arange(n, m) + delta[0, 0]
    pos_3x1xM = np.concatenate([pos_3x1xM, np.broadcast_to(after, (3, 1, m - n))], 2)
    grids_t = tuple(tuple(int(x) for x in g) for g in grids)
    x_1xPxD, deep = model.image_inputs(
        jnp.asarray(tokens_1xM[:, :n]), jnp.asarray(p.pixels.pixel_values_NxP), grids_t
    )
    x_1xMxD = jnp.concatenate([x_1xPxD, model._embed(jnp.asarray(tokens_1xM[:, n:]))], 1)
    if deep is not None:  # DeepStack's inputs at the prompt's image tokens only
        feats, index_1xP, mask_1xP = deep
        pad = ((0, 0), (0, m - n))
        deep = (feats, jnp.pad(index_1xP, pad), jnp.pad(mask_1xP, pad)) if deepstack else None
    logits = Transformer.__call__(
        model, embeddings_BxLxD=x_1xMxD, positions_BxL=jnp.asarray(pos_3x1xM), deepstack=deep
    ).logits[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def test_qwen3_vl_rollouts_sample_and_score_with_their_images(data, requests):
    """A Qwen3-VL tower (its parameters moved off their init, so the position table and the
    DeepStack mergers matter): greedy rollouts on the engine equal `greedy_continue` with the
    pixels, and the engine's log-probabilities of its tokens, each row's pi_old and the loss's
    `token_logps` equal the full forward with the pixels within 1e-5; without DeepStack that
    forward differs by more (the checks can fail)."""
    cfg = qwen3(run_cfg(*data))
    model = sharpened(perturbed(cfg))
    roll, state = rollouts(cfg, model)
    assert roll.units is not None
    prompts = roll.prompts[:4]
    out, _ = roll._generate(state, prompts, 0.0, 0)
    assert len(requests) == 4 and all(im is not None for im in requests)
    for p, got, end in zip(prompts, out.tokens, out.ends):
        want = greedy_continue(model, p.ids, 6, pixels=p.pixels).tolist()
        assert got + list(end) == want[: len(got) + len(end)], (got, end, want)

    # the engine's log-probabilities of its greedy tokens (prefill chunks cut through the
    # image) are the full forward's, DeepStack included
    p, engine = prompts[0], Engine(model, max_num_seqs=1, num_pages=16, chunk_size=16)
    engine.add_request(p.ids, SamplingParams(max_tokens=6, logprobs=True), images=p.pixels)
    done = []
    while engine.has_unfinished():
        done += engine.step().finished
    (got,) = done
    tokens_1xM, at = np.asarray([[*p.ids, *got.tokens]], np.int32), len(p.ids) - 1
    step = np.arange(at, at + len(got.tokens)), got.tokens
    np.testing.assert_allclose(
        got.logprobs, _reference_logps(model, p, tokens_1xM)[step], atol=1e-5
    )
    flat = _reference_logps(model, p, tokens_1xM, deepstack=False)[step]
    apart = [float(np.abs(flat - np.asarray(got.logprobs)).max())]

    roll.policy = state
    batch = next(roll)
    assert batch["pixel_tap_weights"].any()  # the rows carry the position table's taps
    drawn = roll._draw(0)[0]
    mask = batch["loss_mask"].astype(bool)
    assert mask.any(axis=1).all()
    for i, p in enumerate(drawn):
        m = int(batch["segment_ids"][i].sum())
        tokens_1xM = batch["inputs"][i : i + 1, :m]
        targets = batch["targets"][i, :m, None]
        want = np.take_along_axis(_reference_logps(model, p, tokens_1xM), targets, 1)[:, 0]
        np.testing.assert_allclose(batch["old_logps"][i, :m], want * mask[i, :m], atol=1e-5)
        flat = _reference_logps(model, p, tokens_1xM, deepstack=False)
        flat = np.take_along_axis(flat, targets, 1)[:, 0]
        apart.append(float(np.abs((flat - want) * mask[i, :m]).max()))
    # without DeepStack the engine's and the rows' log-probs miss by 5x the tolerance
    assert apart[0] > 5e-5 and max(apart[1:]) > 5e-5, apart
    direct = token_logps(model, jax.tree.map(jnp.asarray, batch))[0]
    np.testing.assert_allclose(np.asarray(direct), batch["old_logps"], atol=1e-5)


@pytest.mark.parametrize("tower", ["qwen2_5_vl", "qwen3_vl"])
def test_a_grpo_run_samples_its_images_on_the_engine(
    data, tmp_path, one_device, requests, capsys, tower
):
    """`jaxllm train` with grpo on shapes-vqa chats, each tower: 2 steps whose rollouts go
    through the engine with their images (one request per group), the reward logged."""
    d, tok = data
    run = tmp_path / "run"
    cfg = run_cfg(d, tok, run__dir=str(run))
    cfg = qwen3(cfg) if tower == "qwen3_vl" else cfg
    config_lib.dump(cfg, tmp_path / "run.yaml")
    assert run_cli("train", tmp_path / "run.yaml") == 0, capsys.readouterr().err
    groups = cfg.train.global_batch_size // cfg.train.num_generations
    assert len(requests) == 2 * groups and all(im is not None for im in requests)
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 and np.isfinite(r["loss"]) for r in m)
    assert all(r["completions/mean_length"] > 0 for r in m)
