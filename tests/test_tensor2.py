"""2D tensor parallelism (`mesh.tensor2`): weights split over `tensor` x `tensor2`, the residual
stream's model dim over `tensor2` (between blocks over `tensor` too); training (losses, and the
parameters after three Adam steps of their gradients) equals one device on tensor x tensor2
meshes with data and fsdp; layouts it does not cover are refused in one line."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from conftest import tiny_model
from jax.sharding import PartitionSpec as P
from test_sharding import STEPS
from test_sharding import _train as train_steps

from jaxllm import config, plan, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

MODEL = tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128)


def _cfg(model=MODEL, **mesh) -> config.Config:
    return config.Config(
        model=model,
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=STEPS),
        # eps well above float32 noise: Adam would otherwise blow ~1e-9 gradient noise up to lr
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, devices):
    """test_sharding's run of STEPS Adam steps: (losses, parameters)."""
    losses, state = train_steps(cfg, devices)
    return losses, state.params


_SINGLE: list = []


@pytest.mark.parametrize(
    "mesh", [dict(data=2, tensor=2, tensor2=2), dict(fsdp=2, tensor=2, tensor2=2)]
)
def test_training_equals_one_device(mesh):
    if not _SINGLE:
        _SINGLE.append(_train(_cfg(), jax.devices()[:1]))
    ref_losses, ref_params = _SINGLE[0]
    losses, params = _train(_cfg(**mesh), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(jax.device_get(a), jax.device_get(b), rtol=1e-4, atol=2e-5)
    # the weights really lie over both axes: model dim over tensor2, heads / mlp over tensor
    specs = {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    embed = ("fsdp", "tensor2")
    assert specs["layers/attn/q_proj"] == P(None, embed, "tensor", None), specs
    assert specs["layers/attn/o_proj"] == P(None, "tensor", None, embed), specs
    assert specs["layers/mlp/up_proj"] == P(None, embed, "tensor"), specs
    assert specs["layers/mlp/down_proj"] == P(None, "tensor", embed), specs
    assert specs["embed/embedding"] == P("tensor", embed), specs
    split = 4 * mesh.get("fsdp", 1)  # tensor x tensor2 (x fsdp)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if "proj" in str(path[-1]):
            assert leaf.addressable_shards[0].data.size == leaf.size // split, path


def test_one_d_specs_name_no_tensor2():
    """With mesh.tensor2=1 every spec is what 1D tensor parallelism had: no `tensor2`."""
    mesh = sharding.make_mesh(config.MeshConfig(data=1, fsdp=2, tensor=4), jax.devices())
    assert mesh.shape["tensor2"] == 1
    assert sharding.named(mesh, ("embed", "mlp")).spec == P("fsdp", "tensor")
    assert sharding.named(mesh, ("norm",)).spec == P("fsdp")
    assert sharding.named(mesh, ("batch", "length", "act_embed")).spec == P(
        ("data", "fsdp", "expert"), "sequence", None
    )


def _group_sizes(hlo: str) -> set[int]:
    """Device-group sizes of the all-reduces in compiled HLO (iota or explicit groups)."""
    sizes = set()
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        if m := re.search(r"replica_groups=\[(\d+),(\d+)\]", line):
            sizes.add(int(m.group(2)))
        elif m := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
            sizes.add(len(m.group(1).split(",")))
    return sizes


def test_plan_bills_both_layouts_and_the_2d_reductions():
    """`plan` at 8 devices: tensor=4 x tensor2=2 holds as many parameter bytes per device as
    tensor=8 (each matrix split 8 ways); its step reduces partial sums over the `tensor2` pairs
    and the `tensor` groups of 4, and reshards the residual stream (split over both axes
    between blocks) by all-gathers and reduce-scatters, which 1D tensor parallelism lacks."""
    model = tiny_model(vocab_size=264, d_model=64, num_heads=8, num_kv_heads=8, mlp_dim=128)
    one_d = plan.plan(_cfg(model, tensor=8), jax.devices())
    cfg = _cfg(model, tensor=4, tensor2=2)
    two_d = plan.plan(cfg, jax.devices())
    by_name = {r["name"]: r for r in two_d["param_rows"]}
    assert by_name["layers/mlp/up_proj"]["spec"] == P(None, ("fsdp", "tensor2"), "tensor")
    assert by_name["layers/mlp/up_proj"]["bytes_per_device"] == 2 * 64 * 128 * 4 // 8
    bill = "parameters"
    assert two_d["bill"][bill] == pytest.approx(one_d["bill"][bill], rel=0.05)
    assert two_d["collectives"]["all-reduce"]["count"] > 0
    for kind in ("all-gather", "reduce-scatter"):
        assert two_d["collectives"][kind]["count"] > 0, two_d["collectives"]
        assert kind not in one_d["collectives"], one_d["collectives"]
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    hlo = step.lower(state, to_global(synthetic_batch(cfg, seed=0), batch_sh)).compile()
    assert {2, 4} <= _group_sizes(hlo.as_text()), _group_sizes(hlo.as_text())


@pytest.mark.parametrize(
    "args,words",
    [
        (["mesh.stage=2", "mesh.data=2", "mesh.pipeline_microbatches=2"], "mesh.stage > 1"),
        (["mesh.sequence=2", "mesh.data=2"], "mesh.sequence > 1"),
        (["mesh.tensor=2", "mesh.tensor_sequence_parallel=true"], "tensor_sequence_parallel"),
        (["model.moe.num_experts=4", "model.moe.experts_per_token=2"], "MoE"),
        (
            ["model.d_model=36", "model.num_heads=2", "model.num_kv_heads=2", "mesh.tensor2=8"],
            "model.d_model (36) must be divisible by mesh.tensor2",
        ),
        (["mesh.tensor=2", "model.mlp_dim=67"], "model.mlp_dim (67)"),
        (["train.grad_compression=topk"], "mesh.tensor2"),
    ],
)
def test_layouts_it_cannot_take_are_one_line(tmp_path, capsys, args, words):
    argv = ["train", "mesh.tensor2=2", *args, f"run.dir={tmp_path / 'r'}", "train.steps=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm:") and words in err[0], err
    assert not (tmp_path / "r").exists()
