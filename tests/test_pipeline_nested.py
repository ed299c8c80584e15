"""What runs its own `shard_map` inside a pipeline stage: MoE dispatch, the attention kernels
and ring attention. MoE models: each stage adds its own layers' balancing losses and expert
loads, so three train steps on pp2 x dp2 x tp2 (and pp2 x ep2 x dp2) match one device: losses,
the MoE metrics, the parameters and the router biases of auxiliary-loss-free balancing. The
flash kernel and ring attention (stage x sequence) inside stages match one device too, and the
ring's rotation moves each stage's own data while another stage runs a different one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout

STEPS = 3
AUTO = jax.sharding.AxisType.Auto


def _cfg(dispatch: str | None, micro: int = 4, layers: int = 4, moe_layout=None, **mesh):
    moe = config.MoEConfig(
        **(moe_layout or {}),
        num_experts=4,
        experts_per_token=2,
        expert_mlp_dim=32,
        dispatch=dispatch,
        aux_loss_weight=0.05,
        router_z_loss_weight=0.01,
        bias_update_rate=0.01,
    )
    return config.Config(
        model=tiny_model(
            vocab_size=264, num_layers=layers, moe=moe if dispatch else config.MoEConfig()
        ),
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
    history = []
    for i in range(STEPS):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        history.append({k: float(v) for k, v in metrics.items() if np.ndim(v) == 0})
    return history, jax.device_get((state.params, state.model_state))


def _assert_trees_close(got, want):
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(got)[0]:
        np.testing.assert_allclose(a, flat_want[path], rtol=1e-4, atol=2e-5, err_msg=str(path))


# DeepSeek's layout: two dense blocks first (run by the first stage after the embedding), then
# groups of a dense block and an MoE block (moe_every=2), one group per stage
MIXED = dict(layers=6, moe_layout=dict(first_dense_layers=2, moe_every=2))


@pytest.mark.parametrize(
    "dispatch,mesh,layout",
    [
        # MoE dispatch and the ring in the same stages (dropless: which tokens a capacity drops
        # depends on their order, and the ring reorders them); ~30-45 s, so -m slow: the default
        # run keeps the ring's stage-safe rotation (below) and the dense pipeline (test_pipeline)
        pytest.param(
            "dropless",
            dict(stage=2, sequence=2, data=2, sequence_attention="ring"),
            {},
            marks=pytest.mark.slow,
        ),
        pytest.param("capacity", dict(stage=2, data=2, tensor=2), {}, marks=pytest.mark.slow),
        pytest.param("dropless", dict(stage=2, data=2, expert=2), {}, marks=pytest.mark.slow),
        pytest.param("capacity", dict(stage=2, data=2, tensor=2), MIXED, marks=pytest.mark.slow),
    ],
    ids=[
        "dropless-ring-pp2_sp2_dp2",
        "capacity-pp2_dp2_tp2",
        "dropless-pp2_ep2_dp2",
        "dense_prefix_groups-pp2_dp2_tp2",
    ],
)
def test_moe_pipeline_matches_single_device(dispatch, mesh, layout):
    want, want_state = _train(_cfg(dispatch, **layout), jax.devices()[:1])
    got, got_state = _train(_cfg(dispatch, **layout, **mesh), jax.devices())
    for name in ("loss", "moe_aux_loss", "moe_router_z_loss"):
        np.testing.assert_allclose(
            [m[name] for m in got], [m[name] for m in want], rtol=1e-5, err_msg=name
        )
    assert want[0]["moe_aux_loss"] > 0
    _assert_trees_close(got_state, want_state)
    biases = [
        a
        for p, a in jax.tree_util.tree_flatten_with_path(want_state[1])[0]
        if "router_bias" in str(p)
    ]
    assert biases and np.abs(biases[0]).max() > 0  # the loads moved the biases


RING = dict(sequence_attention="ring")


@pytest.mark.parametrize(
    "model,mesh",
    [
        pytest.param(dict(), dict(stage=2, sequence=2, data=2, **RING), marks=pytest.mark.slow),
        pytest.param(
            dict(),
            dict(stage=2, sequence=4, pipeline_schedule="zero_bubble", **RING),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(),
            dict(
                stage=2,
                sequence=2,
                tensor=2,
                virtual_stages=2,
                pipeline_schedule="interleaved",
                **RING,
            ),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(attention_impl="flash"),
            dict(stage=2, sequence=2, data=2, **RING),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            dict(attention_impl="flash"), dict(stage=2, data=2, tensor=2), marks=pytest.mark.slow
        ),
    ],
    ids=[
        "ring-1f1b-pp2_sp2_dp2",
        "ring-zero_bubble-pp2_sp4",
        "ring-interleaved-pp2_v2_sp2_tp2",
        "ring_flash-1f1b-pp2_sp2_dp2",
        "flash-pp2_dp2_tp2",
    ],
)
def test_attention_inside_stages_matches_single_device(model, mesh):
    def cfg_of(**m):
        cfg = _cfg(None, **m)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))

    want, want_state = _train(cfg_of(), jax.devices()[:1])
    got, got_state = _train(cfg_of(**mesh), jax.devices())
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)
    _assert_trees_close(got_state, want_state)


def test_ring_rotation_inside_stages_keeps_the_stages_collectives_apart():
    """In each tick one stage takes a ring step (`rotate` over `sequence`) while the other does
    not, then both send to the next stage (as `pipeline.run` does): every value lands where it
    should. (With a plain ppermute for the ring step, the CPU runtime matches it with the other
    stage's send and the sends arrive wrong.)"""
    from jax.sharding import PartitionSpec as P

    from jaxllm.parallel.ring_xla import rotate

    n = 4
    mesh = jax.make_mesh((2, n), ("stage", "sequence"), axis_types=(AUTO, AUTO))
    ring = [(j, (j + 1) % n) for j in range(n)]

    def in_stage(x_1xL):
        step = jax.shard_map(
            lambda a: rotate(a, "sequence", ring),
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=P(None, "sequence"),
            out_specs=P(None, "sequence"),
        )

        def tick(carry, t):
            x, sent = carry
            x = jax.lax.cond(jax.lax.axis_index("stage") == t % 2, step, lambda a: a, x)
            return (x, jax.lax.ppermute(sent, "stage", [(0, 1), (1, 0)])), None

        return jax.lax.scan(tick, (x_1xL, 10 * x_1xL), jnp.arange(4))[0]

    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)
    got_x, got_sent = jax.jit(
        jax.shard_map(
            in_stage, mesh=mesh, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"}
        )
    )(x)
    # each stage took two ring steps; the sends went there and back twice
    np.testing.assert_array_equal(
        np.asarray(got_x), np.roll(x.reshape(2, n, 2), 2, axis=1).reshape(2, 8)
    )
    np.testing.assert_array_equal(np.asarray(got_sent), 10 * x)
