"""`optim.param_groups`: a group's updates are `lr_scale` times the ungrouped ones, its
`weight_decay` replaces the optimizer's on its matrices only, `lr_scale: 0` freezes it
bit-identically without optimizer state, under a sharded mesh and across a resume."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from hf_models import stderr_of_failure
from test_freeze import vlm_model

from jaxllm import checkpoint, config, optim, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError
from jaxllm.config.optim import ParamGroup
from jaxllm.model import abstract_model, build
from jaxllm.optim.groups import frozen_mask
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout


def _params(model=None):
    model = model or tiny_model(vocab_size=264)
    return nnx.to_pure_dict(nnx.state(build(model, 0), nnx.Param))


def _grads(params, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
    leaves = [jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, jax.tree.leaves(params))]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _updates(o: config.OptimConfig, params, steps=1):
    """The updates of `steps` steps of `o` (cosine schedule over 10 steps) at `params`."""
    tx = optim.build(o, 10)
    state, out = tx.init(params), []
    for i in range(steps):
        u, state = tx.update(_grads(params, i), state, params)
        out.append(u)
    return out


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_group_steps_at_its_fraction_of_the_learning_rate(name):
    """sgd: every step's update of the group is 0.1x the ungrouped one, exactly (through the
    warmup and the schedule); adamw: the first step's within 1e-6. The rest is unchanged."""
    params = _params()
    warmup, steps = (2, 4) if name == "sgd" else (0, 1)  # sgd's first step has lr 0
    base = config.OptimConfig(name=name, lr=0.05, warmup_steps=warmup, weight_decay=0.1)
    grouped = dataclasses.replace(base, param_groups=(ParamGroup("^layers/mlp/", 0.1),))
    pairs = zip(_updates(base, params, steps), _updates(grouped, params, steps))
    for i, (want, got) in enumerate(pairs):
        mlp_w, mlp_g = want["layers"].pop("mlp"), got["layers"].pop("mlp")
        for w, g in zip(jax.tree.leaves(mlp_w), jax.tree.leaves(mlp_g), strict=True):
            assert (np.abs(w).max() > 0) == (i > 0 or not warmup)
            if name == "sgd":
                np.testing.assert_array_equal(g, w * np.float32(0.1))
            else:
                np.testing.assert_allclose(g, 0.1 * w, rtol=0, atol=1e-6)
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_groups_weight_decay_applies_to_its_matrices_only(name):
    """With zero gradients an update is -lr x decay x w: 0.5 on the embeddings, 0 on the
    final norm's scale (in the group, but never decayed), the optimizer's 0.1 elsewhere."""
    params = _params()
    o = config.OptimConfig(
        name=name,
        lr=0.1,
        warmup_steps=0,
        schedule="constant",
        weight_decay=0.1,
        clip_norm=None,
        param_groups=(ParamGroup("^(embed|final_norm)/", weight_decay=0.5),),
    )
    tx = optim.build(o, 4)
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = tx.update(zeros, tx.init(params), params)
    rtol = 1e-6
    np.testing.assert_allclose(u["embed"]["embedding"], -0.05 * params["embed"]["embedding"], rtol)
    assert not np.asarray(u["final_norm"]["scale"]).any()
    np.testing.assert_allclose(u["lm_head"], -0.01 * params["lm_head"], rtol)
    q = params["layers"]["attn"]["q_proj"]
    np.testing.assert_allclose(u["layers"]["attn"]["q_proj"], -0.01 * q, rtol)
    assert not np.asarray(u["layers"]["attn_norm"]["scale"]).any()


def _cfg(model, groups, steps=3, **optim_keys) -> config.Config:
    return config.Config(
        model=model,
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=steps),
        optim=config.OptimConfig(
            lr=1e-2, warmup_steps=0, weight_decay=0.1, param_groups=tuple(groups), **optim_keys
        ),
    )


def _train(cfg, steps=None, state=None, start=0, devices=1):
    """(final state, metrics of each step) on batches that depend only on the step number."""
    devices = jax.devices()[:devices]
    mesh = sharding.make_mesh(cfg.validate(len(devices)).mesh, devices)
    step, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    if state is None:
        state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    else:  # as a restore puts it: every leaf in its shards on this mesh
        state = jax.device_put(state, shardings)
    rows = []
    for i in range(start, start + (cfg.train.steps if steps is None else steps)):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        rows.append(jax.device_get(metrics))
    return state, rows


def _same(a, b) -> bool:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(x, y) for x, y in leaves)


def test_lr_scale_zero_freezes_bit_identically_without_state():
    model = tiny_model(vocab_size=264)
    init = jax.device_get(_train(_cfg(model, []), steps=0)[0])
    state, rows = _train(_cfg(model, [ParamGroup("^layers/attn/", 0.0)]))
    after = jax.device_get(state)
    assert _same(init.params["layers"]["attn"], after.params["layers"]["attn"])
    assert not _same(init.params["layers"]["mlp"], after.params["layers"]["mlp"])
    mu = next(x.mu for x in jax.tree.leaves(after.opt_state, is_leaf=lambda x: hasattr(x, "mu")))
    assert "attn" not in mu["layers"] and "mlp" in mu["layers"]
    assert not any(k.startswith("lr/") for k in rows[0])  # a frozen group logs no lr


def test_a_vlm_trains_its_tower_at_a_tenth_of_the_lr():
    """Text batches give the tower no gradient, so AdamW's decay alone moves it: at 0.1x as
    far as without the group, while the decoder's steps stay bit-identical (clipping sees the
    same gradient). Each group's lr is logged."""
    plain, _ = _train(_cfg(vlm_model(), []))
    grouped, rows = _train(_cfg(vlm_model(), [ParamGroup("^visual/", 0.1)]))
    init = _train(_cfg(vlm_model(), []), steps=0)[0]
    p0, p1, p2 = jax.device_get((init.params, plain.params, grouped.params))
    lm = [k for k in p0 if k != "visual"]
    assert _same({k: p1[k] for k in lm}, {k: p2[k] for k in lm})
    moved = jax.tree.map(lambda a, b: np.asarray(b - a), p0["visual"], p1["visual"])
    moved_grouped = jax.tree.map(lambda a, b: np.asarray(b - a), p0["visual"], p2["visual"])
    pairs = list(zip(jax.tree.leaves(moved), jax.tree.leaves(moved_grouped), strict=True))
    assert sum(np.abs(m).max() > 0 for m, _ in pairs) >= 4  # the tower's matrices decayed
    for m, g in pairs:
        np.testing.assert_allclose(g, 0.1 * m, rtol=1e-2, atol=1e-9)
    assert [float(r["lr/group_0"]) for r in rows] == pytest.approx(
        [0.1 * float(r["lr"]) for r in rows]
    )


def test_groups_hold_under_fsdp_and_tensor_parallelism():
    """The same steps on a (data 2, fsdp 2, tensor 2) mesh as on one device."""
    groups = [ParamGroup("^layers/mlp/", 0.1, weight_decay=0.0), ParamGroup("embed", 0.0)]
    cfg = _cfg(tiny_model(vocab_size=264), groups, steps=2)
    one = jax.device_get(_train(cfg)[0].params)
    mesh = config.MeshConfig(data=2, fsdp=2, tensor=2)
    state = _train(dataclasses.replace(cfg, mesh=mesh), devices=8)[0]
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_groups_hold_under_zero_1_with_the_state_offloaded():
    """ZeRO-1 over 8 replicas with the optimizer state in host memory: the single device's."""
    groups = [ParamGroup("^layers/attn/", 0.2, weight_decay=0.0), ParamGroup("^embed/", 0.0)]
    cfg = _cfg(tiny_model(vocab_size=264), groups, steps=2)
    one = jax.device_get(_train(cfg)[0].params)
    cfg = dataclasses.replace(
        cfg,
        mesh=config.MeshConfig(data=8, zero_stage=1),
        optim=dataclasses.replace(cfg.optim, offload="host"),
    )
    state = _train(cfg, devices=8)[0]
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam: ~1e-2 per step
    np.testing.assert_array_equal(one["embed"]["embedding"], state.params["embed"]["embedding"])


def test_groups_hold_across_pipeline_stages():
    """Two pipeline stages (1F1B, 2 microbatches): the single device's steps, and a group at
    lr_scale 0 stays bit-identical in every stage."""
    groups = [ParamGroup("^layers/mlp/", 0.1, weight_decay=0.0), ParamGroup("^layers/attn/o", 0.0)]
    cfg = _cfg(tiny_model(vocab_size=264, num_layers=4), groups, steps=2)
    init, one = (jax.device_get(_train(cfg, steps=n)[0].params) for n in (0, None))
    mesh = config.MeshConfig(data=1, stage=2, pipeline_microbatches=2)
    staged = jax.device_get(_train(dataclasses.replace(cfg, mesh=mesh), devices=2)[0].params)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(staged), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    o = init["layers"]["attn"]["o_proj"]
    np.testing.assert_array_equal(o, staged["layers"]["attn"]["o_proj"])
    assert not np.array_equal(init["layers"]["mlp"]["up_proj"], staged["layers"]["mlp"]["up_proj"])


def _save_and_restore(path, state, cfg, like):
    """`state` written by the run's Checkpointer and read back as `like` is laid out."""
    ckpt = checkpoint.Checkpointer(path, cfg.checkpoint)
    ckpt.save(state, data_state={}, config={}, tokenizer={})
    ckpt.close()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    restored, _, at = checkpoint.Checkpointer(path, cfg.checkpoint).restore_latest(abstract)
    assert at == int(state.step)
    return restored


def test_resume_is_bit_identical(tmp_path):
    """4 steps equal 2, a checkpoint written and read back, and 2 more."""
    groups = [ParamGroup("^layers/mlp/", 0.1, weight_decay=0.3), ParamGroup("lm_head", 0.0)]
    cfg = _cfg(tiny_model(vocab_size=264), groups, steps=4)
    end, want = _train(cfg)
    mid, first = _train(cfg, steps=2)
    restored = _save_and_restore(tmp_path, mid, cfg, mid)
    end2, rest = _train(cfg, steps=2, state=restored, start=2)
    assert [float(r["loss"]) for r in first + rest] == [float(r["loss"]) for r in want]
    assert _same(jax.device_get(end), jax.device_get(end2))


def test_groups_match_lora_adapter_paths():
    peft = config.PeftConfig(method="lora")
    _, params, _ = abstract_model(tiny_model(), peft)
    mask = frozen_mask(params, (ParamGroup("q_proj", 0.0),))
    flat = {
        "/".join(str(k.key) for k in p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)
    }
    assert any(flat.values()) and not all(flat.values())
    assert all(m == ("q_proj" in name) for name, m in flat.items())
    with pytest.raises(ConfigError, match=r"param_groups\[0\].match 'embed' matches no"):
        frozen_mask(params, (ParamGroup("embed", 0.5),))


def test_a_lora_run_steps_its_adapter_groups():
    """Under peft the groups match the adapters' paths: q_proj's frozen bit for bit, the rest
    of the adapters train."""
    cfg = dataclasses.replace(
        _cfg(tiny_model(vocab_size=264), [ParamGroup("q_proj", 0.0)], steps=2),
        peft=config.PeftConfig(method="lora"),
    )
    init = jax.device_get(_train(cfg, steps=0)[0].params)
    after = jax.device_get(_train(cfg)[0].params)
    q = {n: x for n, x in _flat(init).items() if "q_proj" in n}
    assert q and all(np.array_equal(x, _flat(after)[n]) for n, x in q.items())
    rest = [n for n in _flat(init) if "q_proj" not in n]
    assert rest and any(not np.array_equal(_flat(init)[n], _flat(after)[n]) for n in rest)


def _flat(tree) -> dict:
    return {
        "/".join(str(k.key) for k in p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.parametrize(
    "group, words",
    [
        ("{match: '(', lr_scale: 0.1}", r"match '\(' is not a regular expression"),
        ("{match: nothing_here, lr_scale: 0.1}", "match 'nothing_here' matches no trainable"),
        ("{match: embed, lr_scale: -1}", "lr_scale must be a finite number >= 0"),
        ("{match: '.', lr_scale: 0}", "freeze every trainable parameter"),
        ("{match: embed, lr_scale: 0, weight_decay: 0}", "weight_decay does nothing with lr_sc"),
    ],
)
def test_bad_groups_are_one_line_exit_2(capsys, group, words):
    err = stderr_of_failure(capsys, "train", f"optim.param_groups=[{group}]", "train.steps=1")
    assert err.startswith("jaxllm: ") and err.count("\n") == 1
    assert re.search(words, err)


def test_a_decay_no_optimizer_reads_is_refused():
    for name in ("adam", "muon"):
        with pytest.raises(ConfigError, match=f"does nothing with optim.name={name}"):
            config.load(
                None, [f"optim.name={name}", "optim.param_groups=[{match: embed, weight_decay: 0}]"]
            ).validate(1)


@pytest.mark.parametrize("name", list(config.OPTIM_READS))
def test_every_optimizer_scales_a_group(name):
    """One step on the zoo's tiny problem: the group's update is 0.1x the ungrouped one (after
    clipping, weight decay and the trust ratio alike), the rest unchanged. q_galore rounds its
    int8 weights stochastically after the scaling: its group moves, less."""
    from test_optimizers import AXES, _problem

    params, targets = _problem()
    grads = jax.tree.map(lambda p, t: 2 * (p - t), params, targets)
    decay = "weight_decay" in config.OPTIM_READS[name] and name != "muon"
    base = config.OptimConfig(name=name, lr=0.03, warmup_steps=0, schedule="constant")
    group = ParamGroup("^embed/", 0.1, weight_decay=0.1 if decay else None)
    want, got = (
        optim.build(o, 10, AXES).update(grads, optim.build(o, 10, AXES).init(params), params)[0]
        for o in (base, dataclasses.replace(base, param_groups=(group,)))
    )
    w, g = np.asarray(want.pop("embed")["embedding"]), np.asarray(got.pop("embed")["embedding"])
    assert np.abs(w).max() > 0
    if name == "q_galore":
        assert 0 < np.abs(g).sum() < np.abs(w).sum()
    else:
        np.testing.assert_allclose(g, 0.1 * w, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_which_changes_of_groups_a_checkpoint_resumes_across(tmp_path):
    """Factors and decays keep the optimizer state's structure (a resume across them is as a
    new lr); a group at lr_scale 0 drops its state and is refused by name."""
    from jaxllm.train.run_dir import _optimizer_differs

    model = tiny_model(vocab_size=264)
    plain = _cfg(model, [])
    scaled = _cfg(model, [ParamGroup("^layers/", 0.3, weight_decay=0.0)])
    assert _optimizer_differs(plain, scaled) == []
    mid = _train(plain, steps=1)[0]
    restored = _save_and_restore(tmp_path, mid, plain, _train(scaled, steps=0)[0])
    assert _train(scaled, steps=1, state=restored, start=1)[0].step == 2
    differ = _optimizer_differs(plain, _cfg(model, [ParamGroup("^layers/attn/", 0.0)]))
    assert len(differ) == 1 and differ[0].startswith("optim.param_groups ([] there")


def test_a_group_of_parameters_train_freeze_holds_is_refused():
    _, params, _ = abstract_model(vlm_model())
    from jaxllm.model.groups import freeze_mask

    mask = freeze_mask(params, ("vision",))
    with pytest.raises(ConfigError, match=r"param_groups\[0\].match '\^visual/blocks/' matches"):
        frozen_mask(params, (ParamGroup("^visual/blocks/", 0.1),), mask)
    merged = frozen_mask(params, (ParamGroup("^visual/merger/", 0.0),), mask)
    assert all(jax.tree.leaves(merged["visual"])) and not any(jax.tree.leaves(merged["layers"]))
