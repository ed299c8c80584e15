"""`train.grad_compression`: the data-parallel exchange of compressed gradients (Top-K with
error feedback, QSGD) on a simulated 8-device CPU mesh. The compressors' semantics per
replica, training that equals the all-reduce when nothing is dropped, residuals that resume
bit for bit, and the layouts it refuses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from jax.sharding import PartitionSpec

from jaxllm import checkpoint, config, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.config import ConfigError
from jaxllm.parallel.grad_compression import (
    TAGC_STEPS,
    Compression,
    qsgd_decode,
    qsgd_encode,
    tagc_threshold,
    top_k_sparsify,
)
from jaxllm.train.loop import compile_steps, to_global
from jaxllm.train.state import init_state, layout


def _cfg(method="none", data=4, **train) -> config.Config:
    return config.Config(
        model=tiny_model(vocab_size=256, d_model=32, num_layers=2),
        mesh=config.MeshConfig(data=data),
        data=config.DataConfig(seq_len=32),
        train=config.TrainConfig(global_batch_size=8, steps=6, grad_compression=method, **train),
        optim=config.OptimConfig(lr=3e-3, warmup_steps=0),
    )


def _train(cfg, steps, state=None, start=0):
    """(losses, final state) of `steps` steps from `state` (fresh when None) on batches that
    depend only on the step number."""
    devices = jax.devices()[: cfg.mesh.data]
    mesh = sharding.make_mesh(cfg.validate(len(devices)).mesh, devices)
    step, _, tx, shardings, batch_sh = compile_steps(cfg, mesh)
    if state is None:
        state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    else:  # as a restore puts it: every leaf in its shards on this mesh
        state = jax.device_put(state, shardings)
    losses = []
    for i in range(start, start + steps):
        batch = synthetic_batch(dataclasses.replace(cfg, run=config.RunConfig(seed=i)))
        state, metrics = step(state, to_global(batch, batch_sh))
        losses.append(float(metrics["loss"]))
    return losses, state


def test_top_k_keeps_what_it_did_not_send():
    acc = jnp.asarray([0.5, -3.0, 0.1, 2.0, -0.2, 1.0])
    vals, idx, rest = top_k_sparsify(acc, 2)
    assert sorted(idx.tolist()) == [1, 3]
    sent = jnp.zeros_like(acc).at[idx].set(vals)
    np.testing.assert_array_equal(sent + rest, acc)  # nothing lost: sent + residual
    np.testing.assert_array_equal(rest[jnp.asarray([1, 3])], 0.0)


def test_qsgd_is_unbiased_and_on_its_grid():
    v = jax.random.normal(jax.random.key(0), (64,))
    levels, n = 3, 4000  # 2 bits would be 1 level; 3 bits give 3
    codes, norm = jax.vmap(lambda k: qsgd_encode(v, k, levels, 3))(
        jax.random.split(jax.random.key(1), n)
    )
    assert codes.dtype == jnp.int8 and int(jnp.max(jnp.abs(codes))) <= levels
    decoded = qsgd_decode(codes, norm[:, None], levels)
    mean = np.asarray(decoded.mean(0))
    # each entry's draws have variance <= (norm / levels)^2 / 4: five standard errors
    tol = 5 * float(jnp.linalg.norm(v)) / levels / 2 / np.sqrt(n)
    np.testing.assert_allclose(mean, np.asarray(v), atol=tol)
    assert not np.allclose(decoded[0], v, atol=1e-3)  # one draw alone is coarse


def test_exchange_with_residuals_per_replica():
    """Four replicas: the sum of what they send plus their new residuals is the sum of their
    shares plus old residuals (error feedback loses nothing), and every replica gets the same
    sum."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    comp = Compression("topk", ratio=0.25)
    share = jax.random.normal(jax.random.key(0), (4, 8, 6))
    old = {"residual": {"w": jax.random.normal(jax.random.key(1), (4, 8, 6))}}

    def per_replica(g, state):
        total, new = comp.exchange({"w": g[0]}, state, None, "data")
        return total["w"][None], new

    spec = PartitionSpec("data")
    exchange = jax.shard_map(
        per_replica, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False
    )
    total, new = jax.jit(exchange)(share, old)
    np.testing.assert_array_equal(total[0], total[3])
    residual = new["residual"]["w"]
    np.testing.assert_allclose(
        total[0] + residual.sum(0), (share + old["residual"]["w"]).sum(0), rtol=1e-5, atol=1e-5
    )
    # each replica kept all but k = 12 of its 48 entries
    assert [int((r != 0).sum()) for r in residual] == [36] * 4


def _numpy_dgc(shares, m, clip, densities, stage_steps, steps):
    """DGC on each replica with numpy, as the paper's algorithm reads (one tensor)."""
    n = shares.shape[1]
    u, v, out = np.zeros_like(shares[0]), np.zeros_like(shares[0]), []
    for t in range(steps):
        g = shares[t].copy()
        norms = np.linalg.norm(g.reshape(n, -1), axis=1)
        g *= np.minimum(1.0, clip / np.sqrt(n) / (norms + 1e-12))[:, None]
        u = m * u + g
        v = v + u
        k = int(np.ceil(densities[min(t // stage_steps, len(densities) - 1)] * g.shape[1]))
        total = np.zeros(g.shape[1])
        for r in range(n):
            idx = np.argsort(-np.abs(v[r]), kind="stable")[:k]
            total[idx] += v[r, idx]
            v[r, idx] = 0.0
            u[r, idx] = 0.0
        out.append(total)
    return np.stack(out), u, v


def test_dgc_momentum_correction_masking_clipping_and_warm_up():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    comp = Compression("dgc", ratio=0.01, momentum=0.9, clip_norm=1.0, warmup=3)
    assert comp.densities() == (0.25, 0.0625, 0.015625, 0.01)
    shares = np.array(jax.random.normal(jax.random.key(0), (6, 4, 64)))
    shares[0] *= 10.0  # the first step is clipped (limit 1 / sqrt(4) per replica)
    spec = PartitionSpec("data")

    @jax.jit
    def run(shares):
        def per_replica(shares):
            state = comp.init({"w": jnp.zeros(64)}, 1)
            totals = []
            for t in range(shares.shape[0]):
                total, state = comp.exchange({"w": shares[t, 0]}, state, None, "data", t)
                totals.append(total["w"])
            return jnp.stack(totals)[None], state["momentum"]["w"], state["residual"]["w"]

        return jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=PartitionSpec(None, "data"),
            out_specs=(spec, spec, spec),
            check_vma=False,
        )(shares)

    totals, u, v = run(jnp.asarray(shares))
    want, want_u, want_v = _numpy_dgc(shares, 0.9, 1.0, comp.densities(), 1, 6)
    np.testing.assert_allclose(totals[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(u, want_u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v, want_v, rtol=1e-5, atol=1e-6)
    # step 0 sends 16 of 64 entries per replica, steps 3 on one (ceil(0.64))
    assert int((want[0] != 0).sum()) > int((want[5] != 0).sum())


def test_tagc_threshold_ladder_and_packed_sum():
    """TAGC: the threshold is the largest ladder step zeroing less than 1 - ratio (the paper's
    bisection); the packed vectors of four replicas sum to the sum of what each kept while the
    shared index fits; the rest stays in residuals; attention-side leaves are summed whole."""
    acc = np.asarray(jax.random.normal(jax.random.key(0), (512,))) * 1e-3
    zeroed = [np.mean(np.abs(acc) < s) for s in TAGC_STEPS]
    want = max((s for s, z in zip(TAGC_STEPS, zeroed) if z < 0.9), default=0.0)
    assert float(tagc_threshold(jnp.asarray(acc), 0.1)) == pytest.approx(want)

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    spec = PartitionSpec("data")
    shares = {
        "attn": jax.random.normal(jax.random.key(1), (4, 16)),
        "mlp": {"w": jax.random.normal(jax.random.key(2), (4, 32, 16)) * 1e-3},
    }
    comp = Compression("tagc", ratio=0.1)
    old = {"residual": jax.tree.map(jnp.zeros_like, shares)}

    def per_replica(g, state):
        g = jax.tree.map(lambda x: x[0], g)
        total, new = comp.exchange(g, state, None, "data")
        return jax.tree.map(lambda x: x[None], total), new

    total, new = jax.jit(
        jax.shard_map(
            per_replica, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False
        )
    )(shares, old)
    np.testing.assert_allclose(total["attn"][0], shares["attn"].sum(0), rtol=1e-5)
    np.testing.assert_array_equal(new["residual"]["attn"], 0.0)
    w, r = shares["mlp"]["w"], new["residual"]["mlp"]["w"]
    # nothing lost: the summed sent parts plus every residual are the summed shares
    np.testing.assert_allclose(total["mlp"]["w"][0] + r.sum(0), w.sum(0), rtol=1e-4, atol=1e-9)
    kept = (w != 0) & (r == 0)  # what each replica sent
    assert 0 < kept.mean() < 0.5
    union = kept.any(0)
    if union.sum() <= comp.slots(512):  # the shared index fit: the packed sum is exact
        np.testing.assert_allclose(
            total["mlp"]["w"][0], np.where(kept, w, 0).sum(0), rtol=1e-5, atol=1e-9
        )


@pytest.mark.parametrize(
    "method,keys",
    [
        ("topk", dict(grad_compression_ratio=1.0)),
        ("topk", dict(grad_compression_ratio=1.0, grad_accum_steps=2)),
        ("qsgd", dict(grad_compression_bits=16)),
    ],
)
def test_lossless_settings_train_as_the_all_reduce(method, keys):
    accum = {k: v for k, v in keys.items() if k == "grad_accum_steps"}
    want, _ = _train(_cfg(**accum), 4)
    got, state = _train(_cfg(method, **keys), 4)
    np.testing.assert_allclose(got, want, rtol=2e-4)
    if method == "topk":  # everything was sent: no residual
        for r in jax.tree.leaves(state.grad_comp):
            np.testing.assert_array_equal(np.asarray(r), 0.0)


def test_topk_compresses_and_still_learns():
    base, _ = _train(_cfg(), 6)
    got, state = _train(_cfg("topk", grad_compression_ratio=0.05), 6)
    assert got[-1] < got[0]  # error feedback still descends
    assert not np.allclose(got, base)  # and the exchange did drop entries
    leaf = jax.tree.leaves(state.grad_comp["residual"])[0]
    assert leaf.shape[0] == 4 and leaf.sharding.spec == PartitionSpec("data")
    assert float(jnp.abs(leaf).sum()) > 0


def test_dgc_trains_momentum_sgd():
    got, state = _train(_dgc_cfg(), 6)
    assert got[-1] < got[0]
    assert set(state.grad_comp) == {"momentum", "residual"}


def _dgc_cfg():
    cfg = _cfg("dgc", grad_compression_ratio=0.05, grad_compression_warmup=2)
    sgd = config.OptimConfig(name="sgd", momentum=0.9, lr=0.3, warmup_steps=0)
    return dataclasses.replace(cfg, optim=sgd)


# topk by default; the other three (their state moves alike) with -m slow
@pytest.mark.parametrize(
    "method", ["topk", *(pytest.param(m, marks=pytest.mark.slow) for m in ("qsgd", "dgc", "tagc"))]
)
def test_resume_is_bit_identical(method, tmp_path):
    """N steps equal N/2, a checkpoint written and read back by the run's Checkpointer, and
    N/2 more: the residuals (and DGC's momenta) are in it."""
    cfg = {
        "topk": _cfg("topk"),
        "qsgd": _cfg("qsgd", grad_compression_bits=4),
        "tagc": _cfg("tagc", grad_compression_ratio=0.05),
    }.get(method)
    cfg = cfg or _dgc_cfg()
    want, end = _train(cfg, 4)
    first, mid = _train(cfg, 2)
    ckpt = checkpoint.Checkpointer(tmp_path, cfg.checkpoint)
    ckpt.save(mid, data_state={}, config={}, tokenizer={})
    ckpt.close()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), mid
    )
    restored, _, at = checkpoint.Checkpointer(tmp_path, cfg.checkpoint).restore_latest(abstract)
    assert at == 2
    if method != "qsgd":  # the replicas' state went through the checkpoint
        assert jax.tree.structure(restored.grad_comp) == jax.tree.structure(mid.grad_comp)
        assert sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(restored.grad_comp)) > 0
    rest, end2 = _train(cfg, 2, state=restored, start=2)
    assert first + rest == want
    for a, b in zip(jax.tree.leaves(end), jax.tree.leaves(end2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.grad_compression=topk", "mesh.data=4", "mesh.tensor=2"], "mesh.tensor"),
        (["train.grad_compression=qsgd", "mesh.data=2", "mesh.fsdp=4"], "mesh.fsdp"),
        (["train.grad_compression=topk", "mesh.zero_stage=1"], "zero_stage"),
        (["train.grad_compression_ratio=0.5"], "needs train.grad_compression=topk, dgc or tagc"),
        (["train.grad_compression=dgc"], "optim.name=sgd"),
        (["train.grad_compression=topk", "train.grad_compression_warmup=5"], "needs"),
        (["train.grad_compression=qsgd", "train.grad_compression_bits=1"], "2..16"),
        (["train.grad_compression=topk", "train.grad_compression_ratio=0"], r"\(0, 1\]"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, overrides).validate(8)


def test_plan_reports_the_exchange():
    """`jaxllm plan`: the compiled step gathers the compressed pieces instead of all-reducing
    the gradients, and the report gives the bytes each replica sends."""
    from jaxllm.plan import format_plan, plan

    topk = plan(_cfg("topk", data=2), jax.devices()[:2])
    g = topk["grad_exchange"]
    params = sum(int(np.prod(r["shape"])) for r in topk["param_rows"])
    assert g["dense"] == 4 * params and g["sent"] < g["dense"] / 10  # 1% as (value, index)
    assert topk["collectives"]["all-gather"]["count"] > 0
    assert topk["collectives"]["all-reduce"]["bytes"] < 1024  # the token count alone
    assert "gradient exchange (topk)" in format_plan(topk)
    assert plan(_cfg(data=2), jax.devices()[:2])["grad_exchange"] is None


def test_bench_counts_the_compressed_step():
    """`jaxllm bench`'s compiled FLOPs analyse the compressed step with its state."""
    from jaxllm.bench import compiled_step_flops

    cfg = _cfg("topk", data=2).validate(2)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:2])
    assert compiled_step_flops(cfg, mesh) > 0
