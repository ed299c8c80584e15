"""Communication overlap (`mesh.overlap`) and parameter offload (`model.param_offload=host`).

On the 8-device CPU mesh: collective matmul (the Megatron-SP all-gather decomposed into ring
steps under shard_map) equals the plain matmul and trains with the default's losses, and its
compiled step trades all-gathers for collective-permutes; parameters offloaded to host memory
train like parameters on the device, stay in host memory between steps, and `plan` bills them
there. The GPU compiler switches are refused on this backend with one line; on a GPU their
HLO is checked by `test_gpu_switches_change_the_compiled_step` (marked gpu).
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_RUN, abstract_state, tiny_model
from lowering import lower

from jaxllm import config, objectives, optim, parallel, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.model import abstract_model
from jaxllm.plan import memory_bill
from jaxllm.train import overlap
from jaxllm.train.compiled import compile_steps, evaluate
from jaxllm.train.state import init_state, layout
from jaxllm.train.step import train_step

TP_SP = dict(data=2, tensor=4, tensor_sequence_parallel=True)


def _cfg(mesh: dict, param_offload="none", overlap=(), devices=8) -> config.Config:
    return config.Config(
        model=tiny_model(num_kv_heads=4, param_offload=param_offload),
        mesh=config.MeshConfig(**mesh, overlap=overlap),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=2),
        optim=config.OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"),
    ).validate(num_devices=devices)


def _train(cfg, devices=8):
    """(losses, eval loss, final state, compiled step's HLO text) of `cfg` on `devices`."""
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:devices])
    step, jit_eval, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, 0, **layout(cfg))
    batch = sharding.to_global(synthetic_batch(cfg), batch_sh)
    hlo = step.lower(state, batch).compile().as_text()
    losses = []
    for _ in range(cfg.train.steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    held_out = evaluate(jit_eval, state.params, [synthetic_batch(cfg)], batch_sh)
    return losses, held_out["eval_loss"], state, hlo


@pytest.mark.parametrize("degrees", [TP_SP, dict(data=2, sequence=2, tensor=2)])
def test_collective_matmul_equals_the_matmul_and_its_gradients(degrees):
    mesh = sharding.make_mesh(
        config.MeshConfig(**{**degrees, "tensor_sequence_parallel": True}), jax.devices()[:8]
    )
    settings = sharding.Parallel(
        mesh, tensor_sequence_parallel=True, overlap=("collective_matmul",)
    )
    x_BxLxD = jax.random.normal(jax.random.key(0), (4, 16, 8))
    w_DxF = jax.random.normal(jax.random.key(1), (8, 12))

    def ring(x, w):
        with sharding.active(settings):
            assert parallel.collective_matmul_active(x)
            return parallel.collective_matmul(x, [w, 2 * w], jnp.float32)

    def plain(x, w):
        y = jnp.einsum("bld,df->blf", x, w)
        return [y, jnp.einsum("bld,df->blf", x, 2 * w)]

    for got, want in zip(jax.jit(ring)(x_BxLxD, w_DxF), plain(x_BxLxD, w_DxF)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    cot = jax.random.normal(jax.random.key(2), (4, 16, 12))

    def loss(f):
        return lambda x, w: sum(jnp.sum(y * (k + 1) * cot) for k, y in enumerate(f(x, w)))

    got = jax.jit(jax.grad(loss(ring), argnums=(0, 1)))(x_BxLxD, w_DxF)
    want = jax.grad(loss(plain), argnums=(0, 1))(x_BxLxD, w_DxF)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    with sharding.active(settings):  # a decode step's single token keeps the plain matmul
        assert not parallel.collective_matmul_active(x_BxLxD[:, :1])


def test_collective_matmul_trains_like_the_all_gather_and_rings_instead():
    want, want_eval, _, plain_hlo = _train(_cfg(TP_SP))
    got, got_eval, _, ring_hlo = _train(_cfg(TP_SP, overlap=("collective_matmul",)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-5)
    assert plain_hlo.count("collective-permute(") == 0
    # one ring for gate and up: mesh.tensor - 1 steps forward, as many for the backward
    assert ring_hlo.count("collective-permute(") >= 2 * (4 - 1)
    assert ring_hlo.count("all-gather(") < plain_hlo.count("all-gather(")


def test_offloaded_parameters_train_like_parameters_on_the_device():
    fsdp = dict(data=1, fsdp=8)
    want, want_eval, ref, _ = _train(_cfg(fsdp))
    got, got_eval, state, hlo = _train(_cfg(fsdp, param_offload="host"))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-6)
    assert {p.sharding.memory_kind for p in jax.tree.leaves(state.params)} == {"pinned_host"}
    assert {p.sharding.memory_kind for p in jax.tree.leaves(state.opt_state)} == {"device"}
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_lowered_step_moves_offloaded_parameters_between_host_and_device():
    """For a GPU: every parameter leaf goes back to host memory at the end of the step."""
    cfg = _cfg(dict(data=1, fsdp=1), param_offload="host", devices=1)
    graphdef, _, axes = abstract_model(cfg.model)
    tx = optim.build(cfg.optim, cfg.train.steps, axes)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    state = jax.eval_shape(lambda: init_state(cfg.model, tx, mesh, 0))
    batch = jax.tree.map(jnp.asarray, synthetic_batch(cfg))
    hlo = {}
    for offload in (False, True):

        def step(state, batch, offload=offload):
            return train_step(
                state,
                batch,
                graphdef=graphdef,
                tx=tx,
                lr_schedule=optim.schedule(cfg.optim, cfg.train.steps),
                objective=objectives.from_config(cfg),
                offload_params=offload,
            )

        hlo[offload] = lower(step, state, batch, platform="cuda").as_text()
    host = '_xla_buffer_placement = "pinned_host"'
    assert hlo[False].count(host) == 0
    assert hlo[True].count(host) >= len(jax.tree.leaves(state.params))


def test_a_run_resumes_with_its_parameters_offloaded(small_run, tmp_path):
    """The CLI path: a checkpoint written with the parameters on the device resumes into host
    memory and continues with the same losses."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "checkpoints" / "4")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    args = [*SMALL_RUN, "train.steps=4", "checkpoint.every=2", f"run.dir={run}"]
    assert main(["train", *args, "model.param_offload=host"]) == 0

    def losses(path):
        rows = (Path(path) / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, rows)}

    got, want = losses(run), losses(small_run)
    np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-6)


def test_gpu_switches_name_flags_this_xla_knows():
    """Each GPU switch's options, passed to a compile here: XLA refuses a name it does not
    know ("No such compile option"), whatever the backend. A switch whose flags this XLA
    lacks (newer ones dropped the pipelined-collective flags) is refused in one line, and
    XLA does refuse its first flag."""
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    assert overlap.compiler_options(("latency_hiding",), "gpu")  # every XLA line has it
    for switch in overlap.GPU_OPTIONS:
        try:
            options = overlap.compiler_options((switch,), "gpu")
        except config.ConfigError as e:
            name = str(e).split("compile option ")[1].split(";")[0]
            assert name in overlap.GPU_OPTIONS[switch]
            with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
                lowered.compile(compiler_options={name: True})
            continue
        assert options == overlap.GPU_OPTIONS[switch]
        lowered.compile(compiler_options=options)
    assert overlap.compiler_options(("collective_matmul",), "cpu") == {}


def test_plan_bills_offloaded_parameters_to_host_memory():
    state, shardings, axes, grad_sh = abstract_state(
        "mesh=fsdp", "model.dtype=float32", "model.param_offload=host"
    )
    bill = memory_bill(state, shardings, axes, grad_sh)
    psi = sum(p.size for p in jax.tree.leaves(state.params))
    assert bill["parameters"] == 0
    assert bill["host"] == pytest.approx(4 * psi / 8, rel=0.01)  # float32, split 8 ways
    assert bill["gradients"] == pytest.approx(4 * psi / 8, rel=0.01)  # still on the device
    assert bill["optimizer_state"] == pytest.approx(8 * psi / 8, rel=0.01)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["mesh.overlap=[bogus]"], "unknown switch 'bogus'"),
        (["mesh.overlap=[latency_hiding,latency_hiding]"], "names a switch twice"),
        (["mesh.overlap=[collective_matmul]"], "mesh.tensor_sequence_parallel=true"),
        (["mesh.overlap=[latency_hiding]"], "this backend is cpu"),
        (["mesh.overlap=[async_fusion]"], "this backend is cpu"),
    ],
)
def test_bad_overlap_is_one_line_and_exit_2(args, needle, capsys):
    tiny = ["model.num_layers=1", "model.d_model=32", "model.vocab_size=64", "mesh.data=-1"]
    assert main(["plan", *tiny, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm: ") and needle in err[0], err


@pytest.mark.gpu
def test_gpu_switches_keep_the_losses_and_change_the_compiled_step():
    """On GPUs (JAX_PLATFORMS=cuda python -m pytest -m gpu -n 0 tests/test_overlap.py): the
    GPU compiler accepts each switch's flags and the step trains with the default's losses;
    with two or more GPUs (fsdp collectives to schedule) each switch changes the compiled
    step."""
    assert jax.default_backend() == "gpu"
    n = 8 if jax.device_count() >= 8 else 2 if jax.device_count() >= 2 else 1
    fsdp = dict(data=1, fsdp=n)
    want, _, _, hlo = _train(_cfg(fsdp, devices=n), n)
    for switch in ("latency_hiding", "async_fusion"):
        got, _, _, switched = _train(_cfg(fsdp, overlap=(switch,), devices=n), n)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        if n > 1:
            assert switched != hlo, switch
