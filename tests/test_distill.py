"""Knowledge distillation (`train.objective=distill`): the divergences on logits (zero at the
teacher, the beta limits of GKD's JSD, the T^2 scaling, TRL's `generalized_jsd_loss` within
1e-6), the objective on a tiny student with a teacher of another shape (sums, the combination
with the cross-entropy, no gradient into the teacher, MoE terms), and the checks of the config
and of a teacher's vocabulary."""

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_RUN, tiny_model
from flax import nnx

import jaxllm
from jaxllm import config, objectives, sharding
from jaxllm.bench import synthetic_batch
from jaxllm.cli import main
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.model import build
from jaxllm.objectives import distill
from jaxllm.objectives.distill import LOSSES, check_teacher, divergence_BxL
from jaxllm.train import companions
from jaxllm.train.loop import compile_steps, to_global, train
from jaxllm.train.state import init_state, layout

B, L, V = 3, 7, 50


def _logits(seed: int, scale: float = 3.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(scale * rng.standard_normal((B, L, V)), jnp.float32)


@pytest.mark.parametrize("loss", LOSSES)
def test_divergences_vanish_at_the_teacher_and_are_positive_elsewhere(loss):
    z_t, z_s = _logits(0), _logits(1)
    same = divergence_BxL(z_t, z_t, loss, temperature=2.0, beta=0.3)
    np.testing.assert_allclose(same, 0.0, atol=1e-6)
    apart = divergence_BxL(z_s, z_t, loss, temperature=2.0, beta=0.3)
    assert apart.shape == (B, L) and apart.dtype == jnp.float32
    assert np.all(np.asarray(apart) > 1e-3)


def test_forward_and_reverse_kl_are_the_two_sides():
    z_t, z_s = _logits(0), _logits(1)
    fwd = divergence_BxL(z_s, z_t, "forward_kl")
    rev = divergence_BxL(z_s, z_t, "reverse_kl")
    p_t, p_s = jax.nn.softmax(z_t), jax.nn.softmax(z_s)
    np.testing.assert_allclose(fwd, jnp.sum(p_t * jnp.log(p_t / p_s), -1), rtol=1e-4)
    np.testing.assert_allclose(rev, jnp.sum(p_s * jnp.log(p_s / p_t), -1), rtol=1e-4)
    # swapping the arguments swaps the two
    np.testing.assert_allclose(divergence_BxL(z_t, z_s, "forward_kl"), rev, rtol=1e-6)


def test_jsd_tends_to_forward_kl_at_small_beta_and_reverse_kl_near_one():
    """GKD's JSD_beta / beta -> KL(teacher || student) as beta -> 0, and JSD_beta / (1 - beta)
    -> KL(student || teacher) as beta -> 1: beta weights the teacher's side of the mixture."""
    z_t, z_s = _logits(0, scale=1.0), _logits(1, scale=1.0)
    eps = 1e-3
    fwd = divergence_BxL(z_s, z_t, "forward_kl")
    rev = divergence_BxL(z_s, z_t, "reverse_kl")
    np.testing.assert_allclose(divergence_BxL(z_s, z_t, "jsd", beta=eps) / eps, fwd, rtol=2e-2)
    np.testing.assert_allclose(divergence_BxL(z_s, z_t, "jsd", beta=1 - eps) / eps, rev, rtol=2e-2)


@pytest.mark.parametrize("loss", LOSSES)
def test_temperature_squared_keeps_the_high_temperature_limit(loss):
    """Hinton et al.'s reason for T^2: at high T every divergence of the softened
    distributions falls as 1 / T^2, with T^2 D -> c/2 x Var_v(z_t - z_s) (the logit-matching
    limit), c = 1 for the two KLs and beta (1 - beta) for the JSD."""
    z_t, z_s = _logits(0, scale=1.0), _logits(1, scale=1.0)
    beta = 0.3
    c = beta * (1 - beta) if loss == "jsd" else 1.0
    limit = 0.5 * c * jnp.var(z_t - z_s, axis=-1)
    for t in (100.0, 200.0):
        d = t**2 * divergence_BxL(z_s, z_t, loss, temperature=t, beta=beta)
        np.testing.assert_allclose(d, limit, rtol=3e-2)
    # at T = 1 it is far from that limit: the factor is not a no-op
    assert not np.allclose(divergence_BxL(z_s, z_t, loss, beta=beta), limit, rtol=0.1)


@pytest.mark.parametrize("loss", LOSSES)
def test_gradients_are_finite_and_vanish_at_the_teacher(loss):
    z_t = _logits(0, scale=30.0)  # near one-hot teacher: log-probabilities of -100 and below

    def total(z_s):
        return jnp.sum(divergence_BxL(z_s, z_t, loss, temperature=0.5, beta=0.5))

    g = jax.grad(total)(_logits(1, scale=30.0))
    assert np.all(np.isfinite(g)) and float(jnp.abs(g).max()) > 0
    np.testing.assert_allclose(jax.grad(total)(z_t), 0.0, atol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.7])
def test_equals_trl_generalized_jsd_loss(temperature, monkeypatch):
    """forward_kl, reverse_kl and jsd are TRL's GKDTrainer.generalized_jsd_loss at beta = 0, 1
    and beta: per token (reduction="none", summed over the vocabulary) and as its masked
    batch mean, within 1e-6 in float32."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl.experimental.gkd import GKDTrainer

    z_t, z_s = _logits(0), _logits(1)
    mask = np.random.default_rng(2).random((B, L)) < 0.7
    labels = torch.where(torch.from_numpy(mask), 1, -100)
    s, t = torch.from_numpy(np.array(z_s)), torch.from_numpy(np.array(z_t))
    for loss, beta in [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.1), ("jsd", 0.5)]:
        ours = divergence_BxL(z_s, z_t, loss, temperature=temperature, beta=beta or 0.5)
        kw = dict(beta=beta, temperature=temperature)
        theirs = GKDTrainer.generalized_jsd_loss(s, t, reduction="none", **kw).sum(-1)
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6, atol=1e-6)
        mean = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, **kw)
        ours_mean = jnp.sum(ours * mask) / mask.sum()
        np.testing.assert_allclose(ours_mean, mean.item(), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ the objective


STUDENT = tiny_model(num_layers=1, d_model=32, mlp_dim=64)
TEACHER = tiny_model(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128)


def _batch(seq_len=16, rows=4, seed=0):
    cfg = config.Config(
        data=config.DataConfig(seq_len=seq_len),
        train=config.TrainConfig(global_batch_size=rows),
    )
    batch = {k: jnp.asarray(v) % STUDENT.vocab_size for k, v in synthetic_batch(cfg, seed).items()}
    mask = np.random.default_rng(seed).random((rows, seq_len)) < 0.6
    batch["loss_mask"] = jnp.asarray(mask, jnp.int32)
    batch["segment_ids"] = jnp.ones((rows, seq_len), jnp.int32)
    batch["positions"] = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len))
    return batch


def test_objective_sums_over_the_mask_and_combines_with_the_cross_entropy():
    (gs, student), (gt, teacher) = nnx.split(build(STUDENT, 0)), nnx.split(build(TEACHER, 1))
    batch = _batch()
    t, w, beta = 2.0, 0.25, 0.4
    assert distill.distill().others == ("teacher",)

    @jax.jit  # one program for every call below: quicker than running them op by op
    def outputs(student, teacher, batch):
        s, te = nnx.merge(gs, student), nnx.merge(gt, teacher)
        out = {"ce": objectives.next_token()(s, batch, None)}
        for loss in LOSSES:
            out[loss] = {
                "out": distill.distill(loss, temperature=t, beta=beta, weight=w)(
                    s, batch, None, {"teacher": te}
                ),
                "div": divergence_BxL(
                    s(batch["inputs"]).logits,
                    te(batch["inputs"]).logits,
                    loss,
                    temperature=t,
                    beta=beta,
                ),
                # weight 0 is plain next-token training
                "plain": distill.distill(loss, weight=0.0)(s, batch, None, {"teacher": te}),
                # a student that is its teacher has nothing to learn
                "own": distill.distill(loss, temperature=t)(s, batch, None, {"teacher": s}),
            }
        return out

    res = outputs(student, teacher, batch)
    mask = np.asarray(batch["loss_mask"])
    ce = res["ce"]
    for loss in LOSSES:
        out, div = res[loss]["out"], res[loss]["div"]
        assert float(out.tokens) == mask.sum()
        np.testing.assert_allclose(out.metrics["distill"], t**2 * np.sum(div * mask), rtol=1e-5)
        np.testing.assert_allclose(out.metrics["nll"], ce.metrics["loss"], rtol=1e-6)
        combined = w * out.metrics["distill"] + (1 - w) * out.metrics["nll"]
        np.testing.assert_allclose(out.metrics["loss"], combined, rtol=1e-6)
        np.testing.assert_allclose(out.loss_sum, combined, rtol=1e-6)
        np.testing.assert_allclose(res[loss]["plain"].loss_sum, ce.loss_sum, rtol=1e-6)
        np.testing.assert_allclose(res[loss]["own"].loss_sum, 0.0, atol=1e-4)


def test_gradients_reach_the_student_only():
    (gs, student), (gt, teacher) = nnx.split(build(STUDENT, 0)), nnx.split(build(TEACHER, 1))
    batch = _batch()
    objective = distill.distill("jsd", temperature=2.0, weight=0.5)

    def loss(s_params, t_params):
        s, t = nnx.merge(gs, s_params), nnx.merge(gt, t_params)
        return objective(s, batch, jax.random.key(0), {"teacher": t}).loss_sum

    g_s, g_t = jax.jit(jax.grad(loss, argnums=(0, 1)))(student, teacher)
    leaves = jax.tree.leaves(g_s)
    assert all(np.all(np.isfinite(x)) for x in leaves)
    assert sum(float(jnp.abs(x).sum()) for x in leaves) > 0
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g_t))


def test_moe_student_adds_its_balancing_losses():
    moe = MoEConfig(
        num_experts=4, experts_per_token=2, aux_loss_weight=0.1, router_z_loss_weight=0.01
    )
    gs, student = nnx.split(build(tiny_model(num_layers=1, d_model=32, mlp_dim=64, moe=moe), 0))
    gt, teacher = nnx.split(build(TEACHER, 1))

    @jax.jit
    def run(student, teacher, batch):
        te = nnx.merge(gt, teacher)
        return distill.distill()(nnx.merge(gs, student), batch, None, {"teacher": te})

    out = run(student, teacher, _batch())
    m = out.metrics
    assert float(m["moe_aux_loss"]) > 0
    terms = 0.1 * m["moe_aux_loss"] + 0.01 * m["moe_router_z_loss"]
    np.testing.assert_allclose(out.loss_sum, m["loss"] + terms, rtol=1e-6)
    assert "expert_counts" in out.model_stats


# ------------------------------------------------------------------ configuration


def test_check_teacher_needs_the_same_vocabulary_only():
    check_teacher(STUDENT, TEACHER, "runs/big", seq_len=64)  # other depth and width: fine
    with pytest.raises(ConfigError, match=r"train.teacher=runs/big has model.vocab_size=96 .* 64"):
        check_teacher(STUDENT, tiny_model(vocab_size=96), "runs/big")
    with pytest.raises(ConfigError, match="data.seq_len is 128"):
        check_teacher(STUDENT, TEACHER, "runs/big", seq_len=128)


def test_config_builds_the_objective_and_refuses_keys_that_do_nothing():
    keys = ["train.objective=distill", "train.teacher=runs/default"]
    cfg = config.load(None, [*keys, "train.distill_loss=jsd", "train.distill_jsd_beta=0.2"])
    assert objectives.from_config(cfg).others == ("teacher",)
    for bad, match in [
        ("train.distill_temperature=0", "train.distill_temperature must be positive"),
        ("train.distill_jsd_beta=1.0", r"train.distill_jsd_beta must be in \(0, 1\)"),
        ("train.distill_weight=1.5", r"train.distill_weight must be in \[0, 1\]"),
        ("train.distill_jsd_beta=0.2", "has no effect with train.distill_loss=forward_kl"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config.load(None, [*keys, bad])
    with pytest.raises(ConfigError, match="needs train.teacher"):
        config.load(None, ["train.objective=distill"])
    with pytest.raises(ConfigError, match="train.z_loss belongs to the next_token objective"):
        objectives.from_config(config.load(None, [*keys, "train.z_loss=1e-4"]))


# ------------------------------------------------------------------ through jaxllm train

TINY = ["data.max_files=40", *TINY_RUN]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A tiny teacher run, twice the student's width and depth, trained 3 steps."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    wider = ["model.num_layers=2", "model.d_model=64", "model.mlp_dim=128", "train.steps=3"]
    train(config.load(None, [*TINY, *wider, f"run.dir={run}"]))
    return run


def _distill(run: Path, teacher: Path, *overrides: str) -> list[dict]:
    keys = ["train.objective=distill", f"train.teacher={teacher}", "train.distill_loss=jsd"]
    train(config.load(None, [*TINY, *keys, f"run.dir={run}", *overrides]))
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_distills_through_the_loop_and_resumes_exactly(teacher, tmp_path):
    rows = _distill(tmp_path / "straight", teacher, "train.steps=4", "checkpoint.every=2")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["distill"] < rows[0]["distill"]  # the student moves toward the teacher
    for r in rows:
        assert r["loss"] == pytest.approx(r["distill"], rel=1e-6)  # distill_weight=1
        assert math.isfinite(r["nll"])
    assert math.isfinite(rows[-1]["eval_loss"])
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split/checkpoints/4")
    _distill(tmp_path / "split", teacher, "train.steps=4", "checkpoint.every=2")  # from step 2
    a, b = jaxllm.load_model(tmp_path / "straight"), jaxllm.load_model(tmp_path / "split")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(x, y)
    # the teacher is not part of the student's checkpoints
    saved = jaxllm.checkpoint.steps(tmp_path / "straight/checkpoints")
    assert saved == [2, 4]


def _three_steps(teacher: Path, devices, **mesh) -> list[float]:
    keys = ["train.objective=distill", f"train.teacher={teacher}", "train.distill_loss=jsd"]
    keys += ["train.distill_temperature=2", "train.distill_weight=0.5"]
    keys += [f"mesh.{axis}={n}" for axis, n in {"fsdp": 1, **mesh}.items()]
    cfg = config.load(None, [*TINY, *keys])
    cfg.validate(len(devices))
    mesh_ = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh_)
    state = init_state(cfg.model, tx, mesh_, 0, **layout(cfg))
    state, _ = companions.attach(state, cfg, mesh_, None, 0)
    losses = []
    for i in range(3):
        state, metrics = step(state, to_global(synthetic_batch(cfg, seed=i), batch_sh))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.slow  # two more compiles of a two-model step (~50 s on a shared 2-core CPU)
def test_one_device_and_data_fsdp_tensor_parallel_agree(teacher):
    """The student and its wider teacher on 1 device and on data 2 x fsdp 2 x tensor 2, each
    sharded by its own logical axes: the same losses."""
    ref = _three_steps(teacher, jax.devices()[:1])
    losses = _three_steps(teacher, jax.devices(), data=2, fsdp=2, tensor=2)
    np.testing.assert_allclose(losses, ref, rtol=2e-5)
    assert losses[-1] < losses[0]


def test_a_teacher_of_another_vocabulary_is_one_line_through_the_cli(teacher, tmp_path, capsys):
    keys = ["train.objective=distill", f"train.teacher={teacher}", "model.vocab_size=384"]
    assert main(["train", *TINY, *keys, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("jaxllm:")]
    assert len(said) == 1 and "Traceback" not in err, err
    assert said[0].startswith("jaxllm: config error: train.teacher=")
    assert "model.vocab_size=320 but the student has 384" in said[0]
    assert not (tmp_path / "run").exists()  # refused at start-up, before anything was written
