"""GRPO on image prompts: shapes-vqa chats as `format: rollout` prompts, sampled by the VLM with
their images (greedy = the no-cache full forward with the images), pi_old = the VLM's own
log-probabilities of prompt + completion with the images, a short `jaxllm train` run that logs
its reward, and what image prompts do not train under refused in one line."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import config as config_lib
from jaxllm import sharding
from jaxllm.config import ConfigError, JaxllmWarning
from jaxllm.data import shapes_vqa
from jaxllm.data.rollout import prompt_splits
from jaxllm.data.vision_rows import KEYS
from jaxllm.infer.reference import greedy_continue
from jaxllm.model import build, mrope_positions
from jaxllm.model.transformer import Transformer
from jaxllm.objectives.base import token_logps
from jaxllm.objectives.rollout import images as image_prompts
from jaxllm.objectives.rollout.sampling import Rollouts
from jaxllm.train.loop import train
from jaxllm.train.step import BATCH_AXES
from tests.hf_models import run_cli, stderr_of_failure
from tests.test_vision_chat import tokenizer
from tests.test_vlm_sft import VISION


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tokenizer with Qwen-VL's image tokens and a few shapes-vqa chats."""
    d = tmp_path_factory.mktemp("vlm_grpo")
    tok = tokenizer(d)
    shapes_vqa.write_shapes_vqa(d / "shapes", samples=10, seed=0, size=72, test_fraction=0.2)
    return d, tok


def run_cfg(d, tok, **changes):
    pad, start = (
        tok.encode_offsets(s, specials=True)[0][0] for s in ("<|image_pad|>", "<|vision_start|>")
    )
    source = {"path": str(d / "shapes" / "train.jsonl"), "format": "rollout"}
    tree = {
        "model": dict(
            vocab_size=320,
            d_model=48,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            mlp_dim=72,
            dtype="float32",
            max_seq_len=160,
            rope={"mrope_section": [2, 2, 2]},
            vision={**VISION, "image_token_id": int(pad), "vision_start_token_id": int(start)},
        ),
        "data": dict(
            sources=[{**source, "prompt_field": "messages"}],
            tokenizer=str(d / "tok" / "tokenizer.json"),
            seq_len=160,
            eval_fraction=0.0,
        ),
        "generate": dict(kv_cache_dtype="float32"),
        "train": dict(
            objective="grpo",
            beta=0.0,
            global_batch_size=4,
            num_generations=2,
            max_completion_tokens=6,
            reward="exact_match",
            steps=2,
            sample_tokens=0,
            log_every=1,
            eval_every=0,
        ),
        "checkpoint": dict(save_final=False),
        "optim": dict(lr=3e-3, warmup_steps=0),
    }
    for key, value in changes.items():
        section, name = key.split("__")
        tree.setdefault(section, {})[name] = value
    return config_lib.from_dict(tree)


@pytest.fixture
def one_device(monkeypatch):
    """`train` on the first device alone: it lays its mesh over `jax.devices()`."""
    first = jax.devices()[:1]
    monkeypatch.setattr(jax, "devices", lambda *a: first)


def lowercase_share(prompts, completions, answers):
    """A dense reward for a random model (exact match gives it 0 everywhere, no gradient)."""
    return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


DENSE = f"{__name__}:lowercase_share"


def _rollouts(cfg):
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    model = build(cfg.model, seed=1)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    state = SimpleNamespace(
        params=nnx.to_pure_dict(params), frozen={}, model_state=nnx.to_pure_dict(rest), others={}
    )
    return Rollouts(cfg, mesh, sharding.named(mesh, BATCH_AXES), slice(None)), model, state


def test_greedy_samples_are_the_vlms_generation_and_pi_old_its_logps(data):
    """The chat rows' prompts hold their image (pad expanded) and their answer; greedy
    rollouts equal `greedy_continue` with the images (tower at every step, positions + rope
    delta); and each row's pi_old, as the loss's `token_logps` computes it, equals the VLM's
    own log-probabilities of prompt + completion, computed with its eager image path (the
    tower on the prompt's pixels and grids, positions as the decode's)."""
    cfg = run_cfg(*data)
    roll, model, state = _rollouts(cfg)
    v = cfg.model.vision
    assert roll.images is not None and all(p.pixels is not None for p in roll.prompts)
    rows = [json.loads(x) for x in (data[0] / "shapes" / "train.jsonl").read_text().splitlines()]
    assert [p.answer for p in roll.prompts] == [r["messages"][-1]["content"] for r in rows]
    assert all((p.ids == v.image_token_id).sum() > 0 for p in roll.prompts)

    prompts = roll.prompts[:4]
    out, _ = roll._generate(state, prompts, 0.0, 0)
    for p, got, end in zip(prompts, out.tokens, out.ends):
        want = greedy_continue(model, p.ids, 6, pixels=p.pixels).tolist()
        assert got + list(end) == want[: len(got) + len(end)], (got, end, want)

    roll.policy = state
    batch = next(roll)
    assert set(KEYS) <= set(batch) and batch["pixel_values"].shape[1] == roll.units * 4
    drawn = roll._draw(0)[0]
    mask = batch["loss_mask"].astype(bool)
    assert mask.any(axis=1).all()
    for i, p in enumerate(drawn):
        m = int(batch["segment_ids"][i].sum())
        grids = np.asarray(p.pixels.image_grid_thw)
        tokens_1xM = batch["inputs"][i : i + 1, :m]
        pos_3x1xM, delta = mrope_positions(
            tokens_1xM[:, : len(p.ids)], grids, v.image_token_id, v.vision_start_token_id, 2
        )
        after = np.arange(len(p.ids), m) + delta[0, 0]  # decode steps: n + rope delta
        pos_3x1xM = np.concatenate([pos_3x1xM, np.broadcast_to(after, (3, 1, len(after)))], 2)
        # the prompt's embeddings with its image's features, then the completion's tokens
        # (a sampled image pad is text to the model, as in the decode)
        grids_t = tuple(tuple(int(x) for x in g) for g in grids)
        prompt_1xP = jnp.asarray(tokens_1xM[:, : len(p.ids)])
        x_1xPxD = model.embed_images(prompt_1xP, jnp.asarray(p.pixels.pixel_values_NxP), grids_t)
        x_1xMxD = jnp.concatenate(
            [x_1xPxD, model._embed(jnp.asarray(tokens_1xM[:, len(p.ids) :]))], 1
        )
        logits = Transformer.__call__(
            model, embeddings_BxLxD=x_1xMxD, positions_BxL=jnp.asarray(pos_3x1xM)
        ).logits[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        want = np.take_along_axis(np.asarray(logp), batch["targets"][i, :m, None], 1)[:, 0]
        np.testing.assert_allclose(batch["old_logps"][i, :m], want * mask[i, :m], atol=1e-5)
    direct = token_logps(model, jax.tree.map(jnp.asarray, batch))[0]
    np.testing.assert_allclose(np.asarray(direct), batch["old_logps"], atol=1e-5)


def test_prompt_forms_read_alike_and_text_prompts_stay_text(data, tmp_path):
    """A prompt field holding the user turn's parts reads as the messages form; a string prompt
    in the same VLM run keeps no pixels and its row plain positions, no patches; an image
    record without an answer is a bad record."""
    d, tok = data
    first = json.loads((d / "shapes" / "train.jsonl").read_text().splitlines()[0])
    user, answer = first["messages"][0]["content"], first["messages"][1]["content"]
    for part in user:
        if part.get("type") == "image":
            part["image"] = str(d / "shapes" / part["image"])
    records = [
        {"prompt": user, "answer": answer},
        {"prompt": [{"role": "user", "content": user}], "answer": answer},
        {"prompt": "plain text", "answer": "x"},
        {"prompt": [{"role": "user", "content": user}]},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    source = [{"path": str(tmp_path / "p.jsonl"), "format": "rollout"}]
    cfg = run_cfg(d, tok, data__sources=source)
    inp = image_prompts.inputs(cfg)
    with pytest.warns(JaxllmWarning, match="skipped 1 record.*line 4 has no field .answer"):
        parts, messages, plain = prompt_splits(cfg.data, tok, inp)[0]
    np.testing.assert_array_equal(parts.ids, messages.ids)
    np.testing.assert_array_equal(parts.pixels.pixel_values_NxP, messages.pixels.pixel_values_NxP)
    assert parts.answer == answer and plain.pixels is None
    units = image_prompts.budget([parts, plain], cfg.model.vision)
    seqs = [np.concatenate([p.ids, [5, 6]]).astype(np.int32) for p in (parts, plain)]
    got = image_prompts.image_fields([parts, plain], seqs, 160, inp, units)
    np.testing.assert_array_equal(got["mrope_positions"][1], np.arange(160)[:, None].repeat(3, 1))
    assert (got["image_units"][1] == -1).all() and (got["pixel_frames"][1] == -1).all()
    n = int((parts.ids == cfg.model.vision.image_token_id).sum())
    assert sorted(got["image_units"][0][got["image_units"][0] >= 0]) == list(range(n))


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_grpo_run_on_shapes_vqa_logs_its_reward(data, tmp_path, one_device, capsys):
    """`jaxllm train` with train.objective=grpo on shapes-vqa chats (a generated train and test
    split): 2 steps with the images, the exact-match reward logged, and the greedy eval
    reward of the test prompts (their images too)."""
    d, tok = data
    run = tmp_path / "run"
    test = {"path": str(d / "shapes" / "test.jsonl"), "format": "rollout"}
    evals = [{**test, "prompt_field": "messages"}]
    cfg = run_cfg(d, tok, run__dir=str(run), data__eval_sources=evals, train__eval_every=2)
    config_lib.dump(cfg, tmp_path / "run.yaml")
    assert run_cli("train", tmp_path / "run.yaml") == 0
    logged = capsys.readouterr()
    assert "data: 8 rollout prompts, 2 eval" in logged.out + logged.err
    m = _metrics(run)
    assert [r["step"] for r in m] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 and np.isfinite(r["loss"]) for r in m)
    assert all(r["completions/mean_length"] > 0 for r in m)
    assert 0.0 <= m[-1]["eval_reward"] <= 1.0


@pytest.mark.slow
def test_the_same_losses_on_one_device_and_on_a_mesh(data, tmp_path, request):
    """Image rollouts sampled and trained on data 2 x fsdp 2 x tensor 2 (8 simulated devices)
    give the losses of one device; step 2 reuses the rollout off-policy (a loss far from 0)."""
    changes = dict(train__global_batch_size=8, train__updates_per_rollout=2, train__reward=DENSE)
    layouts = {"mesh": dict(mesh__data=2, mesh__fsdp=2, mesh__tensor=2), "one": {}}
    losses = {}
    for name, layout in layouts.items():
        if name == "one":
            request.getfixturevalue("one_device")
        run = tmp_path / name
        train(run_cfg(*data, run__dir=str(run), **changes, **layout))
        losses[name] = [(r["loss"], r["grad_norm"], r["reward"]) for r in _metrics(run)]
    assert len(losses["one"]) == 2 and min(g for _, g, _ in losses["one"]) > 0
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=2e-5, atol=1e-7)


@pytest.mark.slow
def test_a_resumed_image_run_makes_the_same_batches(data, tmp_path, one_device):
    """Stopped after step 1, between the two updates of a rollout (its batch, images included,
    in the checkpoint), and resumed to step 3 (a fresh rollout): the same steps as one run."""
    base = dict(train__updates_per_rollout=2, optim__schedule="constant", train__reward=DENSE)
    straight = tmp_path / "straight"
    train(run_cfg(*data, run__dir=str(straight), train__steps=3, **base))
    split = tmp_path / "split"
    cut = dict(run__dir=str(split), **base)
    train(run_cfg(*data, train__steps=1, checkpoint__save_final=True, **cut))
    train(run_cfg(*data, train__steps=3, **cut))
    resumed = {r["step"]: r for r in _metrics(split)}
    for r in _metrics(straight)[1:]:
        for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
            assert resumed[r["step"]][key] == r[key], (r["step"], key)


@pytest.mark.parametrize("objective", ["rloo", "grpo"])
def test_under_lora_the_reference_reads_the_images_too(data, tmp_path, one_device, objective):
    """At step 1 under LoRA (B = 0) the policy is the reference: the KL (RLOO's in the reward,
    from the reference's log-probabilities of the rollout; GRPO's k3 in the loss) is 0 only
    if the reference, as the policy, reads each row's images."""
    run = tmp_path / "run"
    changes = dict(train__objective=objective, train__beta=0.1, train__steps=1)
    lora = dict(peft__method="lora", peft__targets=["q_proj", "v_proj"])
    train(run_cfg(*data, run__dir=str(run), **changes, **lora))
    (m,) = _metrics(run)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6) and np.isfinite(m["loss"])


def test_what_image_prompts_do_not_train_under_is_refused_in_one_line(
    data, tmp_path, capsys, one_device
):
    d, tok = data
    cfg = run_cfg(d, tok, run__dir=str(tmp_path / "r"))
    path = tmp_path / "run.yaml"
    config_lib.dump(cfg, path)
    cases = [
        (["model.vision=null"], "model.vision is null: a text-only model cannot take images"),
    ]
    for args, words in cases:
        err = stderr_of_failure(capsys, "train", str(path), *args)
        lines = [x for x in err.splitlines() if x.startswith("jaxllm")]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
    for objective, more in [("ppo", {}), ("online_dpo", {"train__beta": 0.1})]:
        other = run_cfg(d, tok, train__objective=objective, **more)
        with pytest.raises(ConfigError, match=f"objective={objective} does not sample with"):
            image_prompts.check(other, reward_model=False)
    with pytest.raises(ConfigError, match="mesh.sequence=2: image rollouts"):
        image_prompts.check(run_cfg(d, tok, mesh__sequence=2), reward_model=False)
    with pytest.raises(ConfigError, match="reward model .* reads text only"):
        image_prompts.check(cfg, reward_model=True)
    assert not (tmp_path / "r" / "checkpoints").exists()
