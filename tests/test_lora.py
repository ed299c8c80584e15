"""LoRA (`peft.method=lora`): adapters on the weights of every family, the frozen base, the
adapters' shardings, the plan's bill, checkpoints that hold only adapters and know their base."""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxllm
from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError, PeftConfig, RunError
from jaxllm.model import build, lora
from jaxllm.train.loop import compile_steps, to_global, train
from jaxllm.train.state import init_state, layout

LORA = PeftConfig(method="lora", rank=4, alpha=8.0, targets=("all-linear",))


def _family(name: str) -> config.ModelConfig:
    """A float32 model of each family LoRA must adapt: dense, MLA with dropless MoE and a
    shared expert, capacity-dispatched MoE."""
    if name == "dense":
        return tiny_model()
    moe = config.MoEConfig(num_experts=4, expert_mlp_dim=64, first_dense_layers=1)
    if name == "moe":
        return tiny_model(moe=dataclasses.replace(moe, dispatch="capacity"))
    mla = config.MLAConfig(
        kv_lora_rank=64, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
    )
    return tiny_model(num_kv_heads=4, mla=mla, moe=dataclasses.replace(moe, num_shared_experts=1))


@nnx.jit
def _logits(model, tokens, dropout_key=None):
    return model(tokens, dropout_key=dropout_key).logits


def _randomize_b(model, scale=0.05):
    """Non-zero B factors, so the adapters change the outputs."""
    for i, (_, module) in enumerate(nnx.iter_modules(model)):
        for name in list(vars(module)):
            if name.endswith("_lora_b"):
                v = getattr(module, name)
                v[...] = scale * jax.random.normal(jax.random.key(i), v.shape, v.dtype)


# capacity-dispatched experts (`moe`) read their weights through the same merged path as the
# dropless ones of `mla_moe`
@pytest.mark.parametrize(
    "family",
    [
        # dense LoRA's forward: the PEFT parity tests of test_peft_hf.py and the training
        # equality below cover it
        pytest.param("dense", marks=pytest.mark.slow),
        "mla_moe",
        pytest.param("moe", marks=pytest.mark.slow),
    ],
)
def test_adapters_start_at_the_base_and_equal_their_merged_weights(family):
    cfg = _family(family)
    tokens = jnp.arange(24).reshape(2, 12) % cfg.vocab_size
    base = _logits(build(cfg, 0), tokens)
    model = build(cfg, 0, LORA)
    adapted = {
        n[: -len("_lora_a")] for _, m in nnx.iter_modules(model) for n in vars(m) if "_lora_a" in n
    }
    want = {"o_proj", "gate_proj", "up_proj", "down_proj"}
    want |= {"q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"} if family == "mla_moe" else set()
    want |= {"q_proj", "k_proj", "v_proj"} if family != "mla_moe" else set()
    assert want <= adapted, adapted
    # B = 0: step 0 is the base (bit for bit on jax 0.10; newer XLA fuses the extra zero terms
    # differently, a float32 rounding apart)
    np.testing.assert_allclose(_logits(model, tokens), base, rtol=0, atol=1e-6)
    _randomize_b(model)
    unmerged = _logits(model, tokens)
    assert float(jnp.max(jnp.abs(unmerged - base))) > 0.1
    graphdef, params, frozen, rest = nnx.split(model, lora.LoRAParam, nnx.Param, ...)
    merged = lora.merged_params(graphdef, params, frozen, rest)
    plain = build(cfg, 0)
    nnx.update(plain, merged)
    np.testing.assert_allclose(_logits(plain, tokens), unmerged, atol=2e-5)


def test_targets_rank_scaling_and_dropout():
    cfg = tiny_model()
    model = build(cfg, 0, dataclasses.replace(LORA, targets=("q_proj", "v_proj"), rslora=True))
    attn = model.layers.attn
    assert attn.q_proj_lora_a.shape == (2, 32, 4) and attn.q_proj_lora_b.shape == (2, 4, 4, 8)
    assert attn.q_proj_lora_scale == 8.0 / 2.0  # alpha / sqrt(r)
    assert not hasattr(attn, "k_proj_lora_a") and not hasattr(model.layers.mlp, "up_proj_lora_a")
    # dropout acts in training only, on the adapters' input: step 0 (B = 0) is still the base
    drop = build(cfg, 0, dataclasses.replace(LORA, dropout=0.5))
    tokens = jnp.arange(16).reshape(2, 8)
    key = jax.random.key(1)
    np.testing.assert_array_equal(_logits(drop, tokens, key), _logits(drop, tokens))
    _randomize_b(drop)
    trained, evaluated = _logits(drop, tokens, key), _logits(drop, tokens)
    assert float(jnp.max(jnp.abs(trained - evaluated))) > 1e-3
    np.testing.assert_array_equal(trained, _logits(drop, tokens, key))
    with pytest.raises(ConfigError, match="kv_b_proj matches no weight"):
        build(cfg, 0, dataclasses.replace(LORA, targets=("kv_b_proj",)))  # MLA only
    with pytest.raises(ConfigError, match="peft.targets: 'wq'"):
        config.load(None, ["peft.method=lora", "peft.targets=[wq]"])
    with pytest.raises(ConfigError, match="peft.rank"):
        config.load(None, ["peft.method=lora", "peft.rank=0"])


def _cfg(**mesh) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=3),
        optim=config.OptimConfig(lr=3e-2, warmup_steps=0, eps=1e-6),
        peft=LORA,
    )


def _train(cfg, devices):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    base = jax.device_get(state.frozen)
    losses = []
    for i in range(cfg.train.steps):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state, base


def test_only_adapters_train_and_shard_like_their_weights():
    """1 device vs data 2 x fsdp 2 x tensor 2: the same losses and adapters; the base never
    moves; gradients and Adam moments exist for the adapters alone."""
    ref_losses, ref, _ = _train(_cfg(), jax.devices()[:1])
    losses, state, base = _train(_cfg(data=2, fsdp=2, tensor=2), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(jax.device_get(ref.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    for a, b in zip(jax.tree.leaves(state.frozen), jax.tree.leaves(base)):
        np.testing.assert_array_equal(a, b)
    adam = state.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(state.params)
    attn = state.params["layers"]["attn"]
    assert set(attn) == {f"{w}_proj_lora_{f}" for w in "qkvo" for f in "ab"}
    # A takes its weight's input axes (embed -> fsdp), B its output axes (heads -> tensor)
    assert attn["q_proj_lora_a"].sharding.spec == P(None, "fsdp", None)
    assert attn["q_proj_lora_b"].sharding.spec == P(None, None, "tensor", None)
    assert attn["o_proj_lora_a"].sharding.spec == P(None, "tensor", None, None)
    assert state.frozen["layers"]["attn"]["q_proj"].sharding.spec == P(None, "fsdp", "tensor", None)


def test_plan_bills_eight_bytes_per_adapter_parameter_and_a_half_byte_nf4_base():
    from jaxllm.plan import format_plan, plan

    cfg = dataclasses.replace(_cfg(), peft=dataclasses.replace(LORA, method="qlora"))
    r = plan(cfg, jax.devices()[:1])
    # AdamW: two float32 moments per trainable (adapter) parameter, nothing for the base
    # (plus Adam's step count)
    assert 8 * r["trainable"] <= r["bill"]["optimizer_state"] <= 8 * r["trainable"] + 16
    assert r["bill"]["opt_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    base = r["base"]
    assert base["params"] == r["params"]
    assert 0.5 < base["nf4_bytes"] / base["nf4_params"] < 0.52
    text = format_plan(r)
    assert "trainable   " in text and "NF4 weights" in text


TINY = [
    "data.max_files=40",
    "data.seq_len=64",
    "model.num_layers=2",
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.warmup_steps=0",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def _run(run_dir, *overrides):
    return train(config.load(None, [*TINY, f"run.dir={run_dir}", *overrides]))


def _stored_values(item: Path) -> int:
    """Values in a checkpoint item, by the shapes Orbax records (its files' sizes vary with
    when the background merge of their pieces ran)."""
    tree = json.loads((item / "_METADATA").read_text())["tree_metadata"]
    return sum(math.prod(leaf["value_metadata"]["write_shape"]) for leaf in tree.values())


def test_checkpoints_hold_adapters_resume_exactly_and_know_their_base(tmp_path):
    _run(tmp_path / "base", "train.steps=2")
    base = tmp_path / "base/checkpoints/2"
    lora_args = ["peft.method=lora", "peft.targets=[q_proj,v_proj,down_proj]", "optim.lr=1e-2"]
    lora_args += [f"checkpoint.init_from={tmp_path / 'base'}", "checkpoint.every=2"]
    _run(tmp_path / "straight", *lora_args, "train.steps=4")
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split/checkpoints/4")
    _run(tmp_path / "split", *lora_args, "train.steps=4")  # resumes from step 2
    a = jaxllm.load_model(tmp_path / "straight")
    b = jaxllm.load_model(tmp_path / "split")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(x, y)
    assert hasattr(a.layers.mlp, "down_proj_lora_a")  # load_model applies the adapters
    ckpt = tmp_path / "straight/checkpoints/4"
    assert _stored_values(ckpt / "params") * 10 < _stored_values(
        base / "params"
    )  # 6,656 of 123,200
    record = jaxllm.checkpoint.read_json_item(ckpt.parent, 4, "base")
    assert record["source"] == str(base.resolve()) and len(record["sha256"]) == 64
    # another base: refused in one line, on resume and on load
    _run(tmp_path / "other", "train.steps=2", "run.seed=1")
    with pytest.raises(RunError, match="trained on the base .*checkpoints/2 .sha256"):
        _run(
            tmp_path / "straight",
            *lora_args,
            "train.steps=6",
            f"checkpoint.init_from={tmp_path / 'other'}",
        )
    for f in (base / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(f.read_bytes()[::-1])
            break
    with pytest.raises(RunError, match="trained on the base"):
        jaxllm.load_model(tmp_path / "straight")
