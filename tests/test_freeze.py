"""`train.freeze`: parameter groups that do not train. Frozen parameters stay bit-identical
(no update, no weight decay), keep no optimizer state, and get no gradient; the others move."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from hf_models import stderr_of_failure

from jaxllm import config, optim, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError
from jaxllm.model import abstract_model, build
from jaxllm.model.groups import freeze_mask
from jaxllm.optim.freeze import stop_frozen
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

VISION = dict(
    patch_size=4,
    depth=2,
    width=32,
    heads=2,
    mlp_dim=40,
    window_size=16,
    fullatt_block_indexes=[1],
    out_dim=48,
    image_token_id=260,
    vision_start_token_id=258,
)


def vlm_model(**changes) -> config.ModelConfig:
    """A tiny float32 VLM whose vocabulary holds the synthetic batches' tokens (0..255)."""
    fields = dict(
        vocab_size=264,
        d_model=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=72,
        max_seq_len=64,
        dtype="float32",
        param_dtype="float32",
        rope={"mrope_section": [2, 2, 2]},
        vision=VISION,
    )
    return config.from_dict({"model": {**fields, **changes}}).model


def _cfg(model, freeze=(), steps=3) -> config.Config:
    return config.Config(
        model=model,
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=4, steps=steps, freeze=tuple(freeze)),
        optim=config.OptimConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1),
    )


def _train(cfg):
    """(params before, params after, opt state) of `cfg.train.steps` steps on one device."""
    cfg.validate(1)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    before = jax.device_get(state.params)
    for i in range(cfg.train.steps):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        assert float(metrics["nonfinite"]) == 0
    return before, jax.device_get(state.params), jax.device_get(state.opt_state)


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _moved(a, b) -> bool:
    return all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _mu(opt_state):
    """Adam's first moments in an optimizer state."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))]
    return next(x.mu for x in found if hasattr(x, "mu"))


def _state_size(opt_state) -> int:
    return sum(x.size for x in jax.tree.leaves(opt_state))


def test_text_only_training_leaves_a_frozen_tower_exactly_unchanged():
    """Text batches give the tower zero gradients, yet AdamW's decoupled weight decay shrinks
    it; frozen, the tower (and its merger) keep every bit, hold no moments, the decoder moves."""
    before, after, opt = _train(_cfg(vlm_model()))
    assert not _same(before["visual"], after["visual"])  # decay alone moves it
    before, after, frozen_opt = _train(_cfg(vlm_model(), ("vision", "projector")))
    assert _same(before["visual"], after["visual"])
    lm = {k: v for k, v in before.items() if k != "visual"}
    assert _moved(lm, {k: after[k] for k in lm})
    tower = sum(x.size for x in jax.tree.leaves(before["visual"]))
    assert _state_size(opt) - _state_size(frozen_opt) == 2 * tower  # Adam's mu and nu


def test_freeze_embed_on_a_text_model():
    cfg = _cfg(tiny_model(vocab_size=264, tie_embeddings=False), ("embed",))
    before, after, opt = _train(cfg)
    assert _same(before["embed"], after["embed"])
    assert _moved(before["lm_head"], after["lm_head"]) and _moved(before["layers"], after["layers"])
    mu = _mu(opt)  # the optimizer keeps no moments for the embeddings
    assert "embed" not in mu and "lm_head" in mu


def test_frozen_tower_under_a_loss_over_pixels():
    """A direct loss of the model over an image: `vision` frozen gets zero gradients and stays
    bit-identical under the optimizer; the projector (merger) still learns from the pixels."""
    cfg = vlm_model()
    graphdef, _, axes = abstract_model(cfg)
    params = nnx.to_pure_dict(nnx.state(build(cfg, 0), nnx.Param))
    mask = freeze_mask(params, ("vision",))
    tx = optim.build(config.OptimConfig(lr=1e-2, warmup_steps=0), 5, axes, None, 0, mask)
    opt_state = tx.init(params)
    grids = [(1, 4, 4)]
    tokens = jnp.asarray([[5, 258] + [260] * 4 + [7, 8]], jnp.int32)
    px = jnp.asarray(np.random.default_rng(0).normal(size=(16, 96)), jnp.float32)

    def loss(p, tokens):  # tokens traced: the eager count check is skipped under jit
        m = nnx.merge(graphdef, stop_frozen(p, mask))
        return jnp.sum(jnp.sin(m(tokens, pixel_values=px, image_grid_thw=grids).logits))

    grad = jax.jit(jax.grad(loss))
    grads = grad(params, tokens)
    assert not any(np.asarray(g).any() for g in jax.tree.leaves(grads["visual"]["blocks"]))
    assert all(np.asarray(g).any() for g in jax.tree.leaves(grads["visual"]["merger"]))
    new = params
    for _ in range(2):
        updates, opt_state = tx.update(grad(new, tokens), opt_state, new)
        new = jax.tree.map(jnp.add, new, updates)
    tower = {k: v for k, v in params["visual"].items() if k != "merger"}
    assert _same(tower, {k: new["visual"][k] for k in tower})
    assert _moved(params["visual"]["merger"], new["visual"]["merger"])
    assert "blocks" not in _mu(opt_state)["visual"] and "merger" in _mu(opt_state)["visual"]


def test_negative_zeros_stay_bit_identical():
    mask = {"a": True, "b": False}
    params = {"a": jnp.asarray([-0.0, 1.5]), "b": jnp.asarray([1.0, 2.0])}
    tx = optim.build(config.OptimConfig(lr=1e-1, warmup_steps=0), 3, None, None, 0, mask)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    new = jax.tree.map(jnp.add, params, updates)
    assert np.signbit(new["a"][0]) and float(new["a"][1]) == 1.5 and float(new["b"][0]) != 1.0


@pytest.mark.parametrize(
    "model, freeze, words",
    [
        (tiny_model(), ("vision",), "train.freeze: vision holds no trainable parameter"),
        (tiny_model(tie_embeddings=True), ("head",), "train.freeze: head holds no trainable"),
        (tiny_model(), ("language",), "freezes every trainable parameter"),
        (vlm_model(), ("language", "vision", "projector"), "freezes every trainable"),
    ],
)
def test_groups_the_model_lacks_are_refused(model, freeze, words):
    _, params, _ = abstract_model(model)
    with pytest.raises(ConfigError, match=words) as e:
        freeze_mask(params, freeze)
    assert "\n" not in str(e.value)


def test_bad_freeze_is_one_line_exit_2(capsys):
    with pytest.raises(ConfigError, match="'tower' is not a group; use vision, projector"):
        config.load(None, ["train.freeze=[tower]"])
    err = stderr_of_failure(capsys, "train", "train.freeze=[vision]", "train.steps=1")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1
    assert "train.freeze: vision holds no trainable parameter: model.vision is null" in err


def test_groups_of_a_vlm():
    _, params, _ = abstract_model(vlm_model())
    mask = freeze_mask(params, ("projector", "head"))
    assert all(jax.tree.leaves(mask["visual"]["merger"])) and mask["lm_head"]
    assert not any(jax.tree.leaves(mask["visual"]["blocks"])) and not mask["visual"]["patch_embed"]
    assert not any(
        jax.tree.leaves({k: v for k, v in mask.items() if k not in ("visual", "lm_head")})
    )
    cfg = dataclasses.replace(_cfg(vlm_model()), train=config.TrainConfig(freeze=("vision",)))
    assert config.from_dict(config.to_dict(cfg)).train.freeze == ("vision",)


def test_a_run_resumes_only_with_the_same_freeze():
    """The optimizer state of a run with other frozen groups has another structure: resuming
    it is refused by name (`checkpoint.reset_optimizer` starts a fresh one)."""
    from jaxllm.train.run_dir import _optimizer_differs

    ours, theirs = _cfg(vlm_model(), ("vision",)), _cfg(vlm_model())
    assert _optimizer_differs(ours, ours) == []
    differ = _optimizer_differs(theirs, ours)
    assert differ == ["train.freeze ([] there, ['vision'] here)"]


@pytest.mark.slow
def test_jaxllm_train_with_a_frozen_tower_checkpoints_and_resumes(tmp_path):
    """`jaxllm train` of a VLM on text with train.freeze=[vision,projector]: the tower of the
    last checkpoint is the seed's, bit for bit, after a resume as well; the decoder trained."""
    import jaxllm
    from jaxllm.train.loop import train

    vision = [f"model.vision.{k}={v}" for k, v in VISION.items() if k != "fullatt_block_indexes"]
    args = [
        "data.max_files=20",
        "data.seq_len=32",
        "model.num_layers=2",
        "model.d_model=48",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.mlp_dim=72",
        "model.vocab_size=264",
        "model.dtype=float32",
        "model.rope.mrope_section=[2,2,2]",
        *vision,
        "model.vision.fullatt_block_indexes=[1]",
        "train.global_batch_size=8",
        "train.sample_tokens=0",
        "train.eval_every=0",
        "train.eval_batches=1",
        "checkpoint.every=2",
        "train.freeze=[vision,projector]",
        f"run.dir={tmp_path / 'run'}",
    ]
    train(config.load(None, [*args, "train.steps=2"]))
    cfg = config.load(None, [*args, "train.steps=3"])
    train(cfg)  # resumes from step 2
    got = nnx.to_pure_dict(nnx.state(jaxllm.load_model(tmp_path / "run"), nnx.Param))
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    tx = compile_steps(cfg, mesh)[2]
    want = jax.device_get(init_state(cfg.model, tx, mesh, cfg.run.seed, **layout(cfg)).params)
    assert _same(got["visual"], want["visual"])
    assert _moved(want["layers"], got["layers"])
