"""LoRA on a vision-language model: bare target names adapt the language model, `visual.`
names the vision tower; adapters on either or both apply, only they train (with
`train.freeze` on top, only those of the groups left), and the merged export equals them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_freeze import vlm_model

from jaxllm import config
from jaxllm.config import ConfigError, PeftConfig
from jaxllm.model import build, lora, split_peft
from jaxllm.model.groups import freeze_mask
from jaxllm.optim.freeze import stop_frozen

LORA = PeftConfig(method="lora", rank=4, alpha=8.0)
GRIDS = [(1, 4, 4)]
TOKENS = np.array([[5, 258] + [260] * 4 + [7, 8]], np.int32)
PIXELS = jnp.asarray(np.random.default_rng(0).normal(size=(16, 96)), jnp.float32)


def _adapted(model) -> set[str]:
    """'visual/NAME' or 'NAME' for every adapted weight."""
    out = set()
    for path, m in nnx.iter_modules(model):
        for n in vars(m):
            if n.endswith("_lora_a"):
                out.add(("visual/" if path and path[0] == "visual" else "") + n[: -len("_lora_a")])
    return out


@nnx.jit
def _logits(model, tokens):
    return model(tokens, pixel_values=PIXELS, image_grid_thw=GRIDS).logits


def _randomize_b(model):
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
        for name in list(vars(module)):
            if name.endswith("_lora_b"):
                v = getattr(module, name)
                v[...] = 0.05 * jax.random.normal(jax.random.key(i), v.shape, v.dtype)


@pytest.mark.parametrize(
    "targets, want",
    [
        (("q_proj", "v_proj"), {"q_proj", "v_proj"}),
        (("visual.q_proj", "visual.fc2"), {"visual/q_proj", "visual/fc2"}),
        (
            ("all-linear", "visual.all-linear"),
            {f"{n}_proj" for n in ("q", "k", "v", "o", "gate", "up", "down")}
            | {f"visual/{n}_proj" for n in ("q", "k", "v", "o", "gate", "up", "down")}
            | {"visual/fc1", "visual/fc2"},
        ),
    ],
)
def test_lora_on_the_tower_the_language_model_or_both(targets, want):
    cfg = vlm_model()
    tokens = jnp.asarray(TOKENS)
    peft = dataclasses.replace(LORA, targets=targets)
    model = build(cfg, 0, peft)
    assert _adapted(model) == want
    base = _logits(build(cfg, 0), tokens)
    np.testing.assert_allclose(_logits(model, tokens), base, atol=1e-6)  # B = 0
    _randomize_b(model)
    adapted = _logits(model, tokens)
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-3  # the adapters apply
    # only the adapters train: a few Adam steps on a loss over the image move them, not the base
    graphdef, params, frozen, rest = split_peft(model, peft)
    assert {
        k
        for k in jax.tree.leaves(
            jax.tree_util.tree_map_with_path(
                lambda p, _: str(p[-1].key).endswith(("_lora_a", "_lora_b")), params
            )
        )
    } == {True}

    def loss(p, tokens):
        m = nnx.merge(graphdef, p, frozen, rest)
        return jnp.mean(m(tokens, pixel_values=PIXELS, image_grid_thw=GRIDS).logits ** 2)

    tx = optax.adam(1e-2)
    opt, new = tx.init(params), params
    grad = jax.jit(jax.grad(loss))
    for _ in range(2):
        updates, opt = tx.update(grad(new, tokens), opt, new)
        new = optax.apply_updates(new, updates)
    assert all(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))
    )
    # the merged export equals the adapted model
    merged = lora.merged_params(graphdef, new, frozen, rest)
    plain = build(cfg, 0)
    nnx.update(plain, merged)
    trained = _logits(nnx.merge(graphdef, new, frozen, rest), tokens)
    np.testing.assert_allclose(_logits(plain, tokens), trained, atol=2e-5)


def test_freeze_picks_which_adapters_train():
    """LoRA on both towers with train.freeze=[language]: the tower's adapters alone train."""
    peft = dataclasses.replace(LORA, targets=("q_proj", "visual.q_proj"))
    graphdef, params, frozen, rest = split_peft(build(vlm_model(), 0, peft), peft)
    mask = freeze_mask(params, ("language",), "lora")
    assert not any(jax.tree.leaves(mask["visual"])) and all(jax.tree.leaves(mask["layers"]))

    def loss(p, tokens):
        m = nnx.merge(graphdef, stop_frozen(p, mask), frozen, rest)
        return jnp.mean(m(tokens, pixel_values=PIXELS, image_grid_thw=GRIDS).logits ** 2)

    grads = jax.jit(jax.grad(loss))(params, jnp.asarray(TOKENS))
    assert not any(np.asarray(g).any() for g in jax.tree.leaves(grads["layers"]))
    assert np.asarray(
        grads["visual"]["blocks"][0]["attn"]["q_proj_lora_b"]
    ).any()  # B = 0: A gets none
    # LoRA only on the language model: freezing the tower means nothing, and is refused
    peft = dataclasses.replace(LORA, targets=("q_proj",))
    _, params, _, _ = split_peft(build(vlm_model(), 0, peft), peft)
    with pytest.raises(ConfigError, match="vision holds no trainable parameter: under peft"):
        freeze_mask(params, ("vision",), "lora")


def test_bad_targets_are_refused():
    with pytest.raises(ConfigError, match="peft.targets: 'visual.wq'.*visual.NAME"):
        config.load(None, ["peft.method=lora", "peft.targets=[visual.wq]"])
    text = vlm_model(vision=None, rope={})
    with pytest.raises(ConfigError, match="visual.q_proj matches no weight"):
        build(text, 0, dataclasses.replace(LORA, targets=("q_proj", "visual.q_proj")))
    with pytest.raises(ConfigError, match="all-linear matches no weight"):
        build(text, 0, dataclasses.replace(LORA, targets=("visual.all-linear",)))
