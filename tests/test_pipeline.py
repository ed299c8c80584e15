"""Pipeline parallelism (`mesh.stage`): the same three train steps on 8 simulated devices as on
one device for every schedule, on pp2 x dp2 x tp2, pp4 x fsdp2 and pp2 with two virtual stages;
each stage holds only its slice of the layer stack; the config refuses what cannot run."""

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.sharding import to_global
from jaxllm.train.compiled import compile_steps
from jaxllm.train.state import init_state, layout

STEPS = 3


def _cfg(micro: int = 4, **mesh) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=264, num_layers=4),
        mesh=config.MeshConfig(**{"data": 1, **mesh}),
        data=config.DataConfig(seq_len=16),
        train=config.TrainConfig(global_batch_size=16, steps=STEPS, grad_accum_steps=micro),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
    )


def _train(cfg: config.Config, devices):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.fixture(scope="module")
def single_device_run():
    losses, state = _train(_cfg(), jax.devices()[:1])
    return losses, jax.device_get(state.params)


PP2_DP2_TP2 = dict(stage=2, data=2, tensor=2)
PP4_FSDP2 = dict(stage=4, fsdp=2)
PP2_V2 = dict(stage=2, data=2, tensor=2, virtual_stages=2)
CASES = {
    "1f1b-pp2_dp2_tp2": dict(PP2_DP2_TP2, pipeline_schedule="1f1b"),
}
SLOW_CASES = {
    "1f1b-pp4_fsdp2": dict(PP4_FSDP2, pipeline_schedule="1f1b"),
    "gpipe-pp2_dp2_tp2": dict(PP2_DP2_TP2, pipeline_schedule="gpipe"),
    "gpipe-pp4_fsdp2": dict(PP4_FSDP2, pipeline_schedule="gpipe"),
    "zero_bubble-pp2_dp2_tp2": dict(PP2_DP2_TP2, pipeline_schedule="zero_bubble"),
    "zero_bubble-pp4_fsdp2": dict(PP4_FSDP2, pipeline_schedule="zero_bubble"),
    "interleaved-pp2_v2_dp2_tp2": dict(PP2_V2, pipeline_schedule="interleaved"),
    "1f1b-pp2_sp2_dp2": dict(stage=2, sequence=2, data=2, pipeline_schedule="1f1b"),
    "interleaved-pp2_v2_fsdp4": dict(
        stage=2, fsdp=4, virtual_stages=2, pipeline_schedule="interleaved"
    ),
}


@pytest.mark.parametrize(
    "case", [*CASES, *(pytest.param(k, marks=pytest.mark.slow) for k in SLOW_CASES)]
)
def test_schedule_matches_single_device(case, single_device_run):
    ref_losses, ref_params = single_device_run
    losses, state = _train(_cfg(**{**CASES, **SLOW_CASES}[case]), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for path, a in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]:
        b = ref_params
        for k in path:
            b = b[k.key]
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=str(path))


def test_each_stage_holds_only_its_layers():
    """pp4 x dp2: a device keeps 1/4 of every stacked block parameter (its stage's layers), and
    1/4 of the embedding and the head too (split over the stages between steps, used by the
    first and last), the final norm whole."""
    cfg = _cfg(stage=4, data=2)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    _, _, tx, _, _ = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    device = jax.devices()[0]

    def on_device(tree):
        return sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(tree)
            for s in leaf.addressable_shards
            if s.device == device
        )

    stack, rest = state.params["layers"], {k: v for k, v in state.params.items() if k != "layers"}
    stack_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(stack))
    rest_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(rest))
    assert on_device(stack) == stack_bytes // 4
    assert rest.keys() == {"embed", "lm_head", "final_norm"}
    for name in ("embed", "lm_head"):
        assert on_device(rest[name]) == sum(a.nbytes for a in jax.tree.leaves(rest[name])) // 4
    assert on_device(rest["final_norm"]) == sum(
        a.nbytes for a in jax.tree.leaves(rest["final_norm"])
    )
    assert on_device(rest) < rest_bytes
    for leaf in jax.tree.leaves(stack):  # layers 0 and 1 of 8 ... on the first stage
        assert leaf.addressable_shards[0].data.shape[0] == cfg.model.num_layers // 4


@pytest.mark.parametrize(
    "mesh, overrides, needle",
    [
        (dict(stage=4, virtual_stages=2, pipeline_schedule="interleaved"), {}, "divisible"),
        (dict(stage=4), dict(micro=2), "at least mesh.stage"),
        (dict(stage=2, virtual_stages=2), {}, "needs mesh.pipeline_schedule=interleaved"),
        (dict(stage=2, pipeline_microbatches=4), dict(micro=2), "disagree"),
        (dict(pipeline_schedule="gpipe"), {}, "act only with mesh.stage > 1"),
    ],
)
def test_refusals(mesh, overrides, needle):
    cfg = _cfg(micro=overrides.get("micro", 4), **{"data": -1, **mesh})
    with pytest.raises(config.ConfigError, match=needle):
        cfg.validate(8)


@pytest.mark.parametrize(
    "layers, stage, layout, needle",
    [
        (4, 4, dict(moe_every=2), "2 MoE groups"),  # 2 groups over 4 stages
        (5, 2, dict(first_dense_layers=1, moe_every=2), "first_dense_layers \\(1\\)"),
    ],
)
def test_refuses_moe_stacks_the_stages_cannot_split(layers, stage, layout, needle):
    moe = config.MoEConfig(num_experts=4, experts_per_token=2, **layout)
    cfg = _cfg(stage=stage, data=-1)
    model = tiny_model(vocab_size=264, num_layers=layers, moe=moe)
    cfg = config.Config(**{**cfg.__dict__, "model": model})
    with pytest.raises(config.ConfigError, match=needle):
        cfg.validate(8)


def test_refuses_objectives_the_pipeline_lacks():
    cfg = _cfg(stage=2, data=-1)
    cfg = config.Config(
        **{
            **cfg.__dict__,
            "train": config.TrainConfig(
                objective="my_module:my_loss", global_batch_size=16, grad_accum_steps=4
            ),
        }
    )
    with pytest.raises(config.ConfigError, match="token-level objectives"):
        cfg.validate(8)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, peft",
    [
        (dict(dropout=0.1, remat="full"), config.PeftConfig()),
        ({}, config.PeftConfig(method="lora", rank=4, dropout=0.1, targets=("q_proj", "lm_head"))),
    ],
    ids=["dropout-remat", "lora"],
)
def test_stage_features_match_single_device(model, peft):
    """Dropout (the same masks: each chunk takes its layers' keys), remat inside the stages and
    LoRA adapters (with their dropout) train as on one device."""

    def cfg(**mesh):
        base = _cfg(**mesh)
        m = tiny_model(vocab_size=264, num_layers=4, **model)
        return config.Config(**{**base.__dict__, "model": m, "peft": peft})

    ref_losses, ref_state = _train(cfg(), jax.devices()[:1])
    losses, state = _train(cfg(stage=2, data=2, tensor=2), jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)
