"""Dropless MoE by ragged all-to-all (`mesh.dropless_dispatch=ragged_all_to_all`): the layer's
output and the gradients of router, experts and input equal the all-gather dispatcher's on
expert-parallel meshes (with data / fsdp / tensor), with and without group-limited routing; the
padded exchange XLA:CPU runs equals `jax.lax.ragged_all_to_all`'s definition; the ragged path
lowers for GPU; training losses and parameters equal one device."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_env
from flax import nnx
from jax.sharding import PartitionSpec as P
from lowering import TARGET_GPU
from test_moe_layer import _layer, _value_and_grads
from test_moe_parallel import _train, _train_cfg

from jaxllm import config, sharding
from jaxllm.config import ConfigError, MeshConfig, MoEConfig
from jaxllm.hlo_collectives import collectives
from jaxllm.model.moe_ragged import max_devices_per_token, ragged_experts_local
from jaxllm.parallel.ragged import padded_ragged_all_to_all

ROUTERS = {
    "top2": MoEConfig(num_experts=8, experts_per_token=2),
    # DeepSeek-V3-like: sigmoid scores, 4 of 16 experts from 2 of 4 groups, a shared expert
    "groups": MoEConfig(
        num_experts=16,
        experts_per_token=4,
        router_score="sigmoid",
        num_shared_experts=1,
        route_scale=2.5,
        num_groups=4,
        groups_per_token=2,
    ),
}

MESHES = {
    "ep4_dp2": dict(expert=4, data=2),
    "ep8": dict(expert=8),
    "ep4_fsdp2": dict(expert=4, fsdp=2),
    "ep2_tp2_fsdp2": dict(expert=2, tensor=2, fsdp=2),
}


def _run(layer, x, cot, mesh_axes: dict, dispatch: str):
    mesh = sharding.make_mesh(MeshConfig(**{"data": 1, **mesh_axes}))
    with sharding.active(sharding.Parallel(mesh, dropless_dispatch=dispatch)):
        out, grads = _value_and_grads(lambda m, x: m(x).out, layer, x, cot)
    return jax.device_get(out), jax.device_get(grads)


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("mesh_axes", list(MESHES))
def test_ragged_dispatch_equals_all_gather_forward_and_gradients(router, mesh_axes):
    layer = _layer(ROUTERS[router], d=16, f=24, seed=3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(8, 6, 16)), jnp.float32)
    want, want_grads = _run(layer, x, cot, MESHES[mesh_axes], "all_gather")
    got, got_grads = _run(layer, x, cot, MESHES[mesh_axes], "ragged_all_to_all")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    params, dx = got_grads
    want_params, want_dx = want_grads
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-5)
    flat, want_flat = (nnx.to_flat_state(p) for p in (params, want_params))
    names = set()
    for (path, g), (_, w) in zip(flat, want_flat):
        names.add(path[0])
        np.testing.assert_allclose(g.get_value(), w.get_value(), rtol=1e-4, atol=1e-5)
        assert np.abs(w.get_value()).max() > 0, path  # every parameter receives a gradient
    assert {"router", "gate_proj", "up_proj", "down_proj"} <= names


def _ragged_reference(operands, outputs, in_off, send, out_off, recv):
    """`jax.lax.ragged_all_to_all` over n devices as its docstring defines it, in NumPy."""
    n = len(operands)
    results = [o.copy() for o in outputs]
    for src in range(n):
        for dst in range(n):
            rows = operands[src][in_off[src][dst] : in_off[src][dst] + send[src][dst]]
            assert recv[dst][src] == send[src][dst]
            results[dst][out_off[src][dst] : out_off[src][dst] + len(rows)] = rows
    return results


def test_padded_exchange_is_ragged_all_to_all():
    n, rows, m = 4, 3, 7
    rng = np.random.default_rng(0)
    send = rng.integers(0, rows + 1, size=(n, n)).astype(np.int32)  # send[src, dst]
    in_off = np.stack([np.cumsum(s) - s for s in send]).astype(np.int32)
    out_off = np.zeros((n, n), np.int32)  # where src's rows land on dst: after lower srcs
    for dst in range(n):
        out_off[:, dst] = np.cumsum(send[:, dst]) - send[:, dst]
    recv = send.T.copy()
    operands = rng.normal(size=(n, n * rows, 2)).astype(np.float32)
    outputs = np.full((n, n * rows + m, 2), -1.0, np.float32)
    want = _ragged_reference(operands, outputs, in_off, send, out_off, recv)
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])

    def local(op, out, io, s, oo, r):
        got = padded_ragged_all_to_all(
            op[0], out[0], io[0], s[0], oo[0], r[0], axis_name="x", rows=rows
        )
        return got[None]

    spec = P("x")
    args = [jax.device_put(a, jax.NamedSharding(mesh, spec)) for a in
            (operands, outputs, in_off, send, out_off, recv)]  # fmt: skip
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))(*args)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def test_device_limit_bounds_the_rows_sent():
    assert max_devices_per_token(8, 2) == 2  # Mixtral on ep8: top-2
    assert max_devices_per_token(8, 8, (8, 4)) == 4  # DeepSeek-V3 on ep8: 4 of 8 groups
    assert max_devices_per_token(8, 8, (4, 2)) == 4  # 2 groups of 2 devices each
    assert max_devices_per_token(8, 8, (32, 2)) == 2  # 4 groups per device
    assert max_devices_per_token(8, 8, (3, 1)) == 8  # groups straddle devices: no bound
    assert max_devices_per_token(4, 8) == 4


def test_ragged_path_lowers_for_gpu_with_its_collective():
    n, t, d, f, k, e = 4, 6, 8, 16, 2, 8
    mesh = jax.sharding.AbstractMesh(
        (n,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=TARGET_GPU
    )
    tokens, experts = P("expert"), P("expert")

    def local(x, idx, w, gate, up, down):
        return ragged_experts_local(
            x, idx, w, gate, up, down, expert_axis="expert", tensor_axis=None,
            dtype=jnp.float32, ragged=True,
        )  # fmt: skip

    def loss(x, idx, w, gate, up, down):
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, experts, experts, experts),
            out_specs=tokens,
        )(x, idx, w, gate, up, down)
        return jnp.sum(out**2)

    shape = jax.ShapeDtypeStruct
    args = (
        shape((n, t, d), jnp.float32),
        shape((n, t, k), jnp.int32),
        shape((n, t, k), jnp.float32),
        shape((e, d, f), jnp.float32),
        shape((e, d, f), jnp.float32),
        shape((e, f, d), jnp.float32),
    )
    grad = jax.grad(loss, argnums=(0, 2, 3, 4, 5))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # forward: rows, expert ids, weights there and outputs back; backward: their transposes
    assert text.count("ragged_all_to_all") >= 6


def _groups(cfg, num_groups: int, keep: int):
    moe = dataclasses.replace(cfg.model.moe, num_groups=num_groups, groups_per_token=keep)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))


@pytest.mark.parametrize(
    "mesh, groups",
    [
        (dict(expert=4, data=2), (1, 1)),
        pytest.param(dict(expert=8), (4, 1), marks=pytest.mark.slow),  # groups: the layer
        pytest.param(dict(expert=4, fsdp=2), (8, 2), marks=pytest.mark.slow),  # tests above
    ],
    ids=["ep4_dp2", "ep8-groups", "ep4_fsdp2-groups"],
)
def test_training_with_ragged_dispatch_matches_single_device(mesh, groups):
    ref_losses, ref_state, _, initial = _train(
        _groups(_train_cfg("dropless"), *groups), jax.devices()[:1]
    )
    cfg = _train_cfg("dropless", **mesh, dropless_dispatch="ragged_all_to_all")
    losses, state, _, _ = _train(_groups(cfg, *groups), jax.devices(), initial)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.params)),
        jax.tree.leaves(jax.device_get(ref_state.params)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_dropless_dispatch_key_is_read_and_refused_without_dropless_experts():
    key = "mesh.dropless_dispatch=ragged_all_to_all"
    cfg = config.load(None, [key, "model.moe.num_experts=8", "mesh=expert"]).validate(8)
    assert sharding.Parallel.of(None, cfg.mesh).dropless_dispatch == "ragged_all_to_all"
    for extra in ([], ["model.moe.num_experts=8", "model.moe.dispatch=capacity"]):
        with pytest.raises(ConfigError, match="mesh.dropless_dispatch"):
            config.load(None, [key, *extra]).validate(8)


def test_cli_refuses_it_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm", "plan", "mesh.dropless_dispatch=ragged_all_to_all"],
        capture_output=True,
        text=True,
        env=cpu_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("jaxllm: config error: mesh.dropless_dispatch")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_collectives_count_a_ragged_exchange_by_the_rows_it_sends():
    parts = ", ".join(["f32[4,8]{1,0}"] * 5 + ["/*index=5*/f32[4,8]{1,0}"] + ["f32[4,8]{1,0}"] * 2)
    ints = ", ".join(["s32[1]{0}"] * 5 + ["/*index=5*/s32[1]{0}"] + ["s32[1]{0}"] * 2)
    scope = 'metadata={op_name="jit(f)/shard_map/ragged_all_to_all_rows8_of32/all_to_all"}'
    hlo = f"""
  %a2a.1 = ({parts}) all-to-all(%a), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, {scope}
  %a2a.2 = ({ints}) all-to-all(%b), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, {scope}
  %a2a.3 = ({parts}) all-to-all(%c), replica_groups={{{{0,1,2,3,4,5,6,7}}}}
  %r.4 = f32[32,8]{{1,0}} ragged-all-to-all(f32[8,8]{{1,0}} %x, %o, %i, %s, %p, %q), {scope}
"""
    out = collectives(hlo)
    # the padded stand-in and the ragged op: 8 rows of 8 floats each; its offsets as they are
    assert out["ragged-all-to-all"] == {"count": 2, "bytes": 2 * 8 * 8 * 4}
    assert out["all-to-all"] == {"count": 2, "bytes": 8 * 4 + 32 * 8 * 4}


def _plan_bytes(*overrides):
    from jaxllm.plan import plan

    base = ["model=tiny_deepseek", "mesh=expert", "train.global_batch_size=8", "data.seq_len=64"]
    cfg = config.load(None, base + list(overrides))
    found = plan(cfg, jax.devices())["collectives"]
    return {k: v["bytes"] for k, v in found.items()}


@pytest.mark.slow  # ~35 s: two plans; the byte counting itself is tested above
def test_plan_shows_fewer_bytes_and_fewer_again_with_device_limited_routing():
    gather = _plan_bytes()
    ragged = _plan_bytes("mesh.dropless_dispatch=ragged_all_to_all")
    limited = _plan_bytes(
        "mesh.dropless_dispatch=ragged_all_to_all",
        "model.moe.num_groups=8",
        "model.moe.groups_per_token=1",
    )
    assert "ragged-all-to-all" not in gather and "reduce-scatter" in gather
    moved = gather["all-gather"] + gather["reduce-scatter"]
    assert ragged["ragged-all-to-all"] + ragged["all-gather"] < moved / 2  # 2 of 8 devices
    assert "reduce-scatter" not in ragged
    # 16 experts, 2 per device, each device one group: a token's top-2 on one device instead
    # of two, so half the rows in every exchange
    assert limited["ragged-all-to-all"] * 2 == ragged["ragged-all-to-all"]
