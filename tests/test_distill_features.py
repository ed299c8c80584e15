"""Feature distillation (`train.distill_hidden_weight`): the per-block hidden states of the
model (`hidden_states=True`, row i block i's output), the hidden-state error against NumPy,
TinyBERT's default layer map, the objective's weighted term with gradients into the student's
projections and none into the teacher, the config checks, and a student of half the width
and two thirds of the depth of its teacher through `jaxllm train`, resumed, loaded, exported
without its projections, and refused in one line for bad values."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_RUN, tiny_model
from flax import nnx

import jaxllm
from jaxllm import config
from jaxllm.cli import main
from jaxllm.config import ConfigError, MoEConfig
from jaxllm.model import build
from jaxllm.objectives import distill
from jaxllm.objectives.distill import default_layers, feature_layers, hidden_mse_BxL

STUDENT = tiny_model(num_layers=2, d_model=32, mlp_dim=64, distill_proj=(2, 64))
TEACHER = tiny_model(num_layers=3, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128)
B, L = 3, 12


def _tokens(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (B, L)), jnp.int32)


# ------------------------------------------------------------------ the model's hidden states


def test_hidden_states_are_each_blocks_output_and_change_nothing_else():
    model, tokens = build(TEACHER, 0), _tokens()
    out = model(tokens, hidden_states=True)
    plain = model(tokens)
    assert plain.hidden_states is None
    assert out.hidden_states.shape == (3, B, L, 64)
    np.testing.assert_array_equal(out.logits, plain.logits)
    # row i is what a model of the first i + 1 blocks (the same weights) ends its stack with
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    for depth in (1, 2, 3):
        cut = dict(params, layers=jax.tree.map(lambda a: a[:depth], params["layers"]))
        shallow = build(tiny_model(**{**TEACHER.__dict__, "num_layers": depth}), 0)
        g, state = nnx.split(shallow)
        nnx.replace_by_pure_dict(state, cut)
        ends = nnx.merge(g, state)(tokens, hidden_only=True).hidden  # after the final norm
        np.testing.assert_allclose(
            model.final_norm(out.hidden_states[depth - 1]), ends, rtol=1e-5, atol=1e-5
        )


def test_an_moe_model_returns_every_block_in_order():
    moe = MoEConfig(num_experts=4, experts_per_token=2, first_dense_layers=1, moe_every=2)
    graphdef, state = nnx.split(build(tiny_model(num_layers=5, moe=moe), 0))

    @jax.jit
    def calls(state, tokens):
        model = nnx.merge(graphdef, state)
        out = model(tokens, hidden_states=True)
        ends = model.final_norm(out.hidden_states[-1])
        return out, model(tokens).logits, ends, model(tokens, hidden_only=True).hidden

    out, logits, ends, last = calls(state, _tokens())
    assert out.hidden_states.shape == (5, B, L, 32)
    np.testing.assert_allclose(ends, last, atol=1e-5)
    np.testing.assert_array_equal(out.logits, logits)
    assert len({float(jnp.abs(h).sum()) for h in out.hidden_states}) == 5  # five blocks


# ------------------------------------------------------------------ the loss and the layer map


def test_hidden_mse_is_the_numpy_formula():
    rng = np.random.default_rng(0)
    hs = rng.standard_normal((2, B, L, 32)).astype(np.float32)
    ht = rng.standard_normal((3, B, L, 64)).astype(np.float32)
    w = rng.standard_normal((2, 32, 64)).astype(np.float32) / 6
    layers = ((0, 0), (1, 2))
    got = hidden_mse_BxL(jnp.asarray(hs), jnp.asarray(ht), jnp.asarray(w), layers)
    want = np.zeros((B, L))
    for m, (s, t) in enumerate(layers):
        want += ((hs[s] @ w[m] - ht[t]) ** 2).mean(-1) / len(layers)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ConfigError, match="2 projections .* 1 pairs"):
        hidden_mse_BxL(jnp.asarray(hs), jnp.asarray(ht), jnp.asarray(w), ((1, 2),))


def test_default_map_is_tinyberts_uniform_one():
    assert default_layers(4, 12) == ((0, 2), (1, 5), (2, 8), (3, 11))
    assert default_layers(2, 3) == ((0, 0), (1, 2))
    assert default_layers(4, 2) == ((1, 0), (3, 1))  # a deeper student: its every other block
    assert default_layers(3, 3) == ((0, 0), (1, 1), (2, 2))
    assert feature_layers(STUDENT, TEACHER, (), "t") == ((0, 0), (1, 2))
    assert feature_layers(STUDENT, TEACHER, ((1, 1),), "t") == ((1, 1),)
    with pytest.raises(ConfigError, match=r"pair \[1, 3\] is outside .* teacher's \(t\) 0..2"):
        feature_layers(STUDENT, TEACHER, ((0, 0), (1, 3)), "t")


def _batch(seed=0):
    tokens = np.random.default_rng(seed).integers(0, 64, (B, L + 1))
    mask = np.random.default_rng(seed + 1).random((B, L)) < 0.7
    return {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "loss_mask": jnp.asarray(mask, jnp.int32),
        "segment_ids": jnp.ones((B, L), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
    }


def test_objective_adds_the_weighted_term_and_trains_the_projections_only_in_the_student():
    (gs, student), (gt, teacher) = nnx.split(build(STUDENT, 0)), nnx.split(build(TEACHER, 1))
    batch, layers = _batch(), ((0, 0), (1, 2))
    with_h = distill.distill("jsd", weight=0.5, hidden_weight=0.3, layers=layers)
    without = distill.distill("jsd", weight=0.5)

    def run(s_params, t_params, objective):
        s, t = nnx.merge(gs, s_params), nnx.merge(gt, t_params)
        return objective(s, batch, None, {"teacher": t})

    @jax.jit  # one program for all of it: quicker than op by op
    def everything(student, teacher):
        s, t = nnx.merge(gs, student), nnx.merge(gt, teacher)
        grads = jax.grad(lambda sp, tp: run(sp, tp, with_h).loss_sum, argnums=(0, 1))
        return dict(
            out=run(student, teacher, with_h),
            base=run(student, teacher, without),
            hs=s(batch["inputs"], hidden_states=True).hidden_states,
            ht=t(batch["inputs"], hidden_states=True).hidden_states,
            grads=grads(student, teacher),
            g0=jax.grad(lambda sp: run(sp, teacher, without).loss_sum)(student),
        )

    res = everything(student, teacher)
    out, base = res["out"], res["base"]
    hs, ht = np.asarray(res["hs"]), np.asarray(res["ht"])
    w, mask = np.asarray(student["distill_proj"]), np.asarray(batch["loss_mask"])
    per_token = sum(((hs[a] @ w[m] - ht[b]) ** 2).mean(-1) for m, (a, b) in enumerate(layers))
    np.testing.assert_allclose(out.metrics["hidden"], (per_token / 2 * mask).sum(), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["distill"], base.metrics["distill"], rtol=1e-6)
    want = base.loss_sum + 0.3 * out.metrics["hidden"]
    np.testing.assert_allclose(out.loss_sum, want, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["loss"], want, rtol=1e-6)
    assert "hidden" not in base.metrics

    g_s, g_t = res["grads"]
    assert all(float(jnp.abs(g).sum()) > 0 for g in g_s["distill_proj"])  # both pairs
    body = {k: v for k, v in g_s.items() if k != "distill_proj"}
    assert sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(body)) > 0
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g_t))
    # without the term, the projections get nothing
    assert float(jnp.abs(res["g0"]["distill_proj"]).max()) == 0.0


# ------------------------------------------------------------------ configuration

KEYS = ["train.objective=distill", "train.teacher=runs/default"]


def test_config_checks_the_feature_keys():
    cfg = config.load(None, [*KEYS, "train.distill_hidden_weight=0.5"])
    assert cfg.train.distill_layers == () and cfg.model.distill_proj == ()
    cfg = config.load(None, [*KEYS, "train.distill_hidden_weight=1", "model.num_layers=4",
                             "train.distill_layers=[[0, 1], [3, 7]]"])  # fmt: skip
    assert cfg.train.distill_layers == ((0, 1), (3, 7))
    for bad, match in [
        (["train.distill_hidden_weight=-0.1"], "must be >= 0"),
        (["train.distill_layers=[[0, 0]]"], "distill_layers has no effect"),
        (
            [
                "train.distill_hidden_weight=1",
                "train.distill_layers=[[2, 0]]",
                "model.num_layers=2",
            ],
            r"holds \[2, 0\]; .* in \[0, 2\)",
        ),  # fmt: skip
        (["train.distill_hidden_weight=1", "train.distill_layers=[[0, -1]]"], "holds"),
        (["train.distill_hidden_weight=1", "train.distill_layers=[[0, 1, 2]]"], "holds"),
        (["train.distill_hidden_weight=1", "peft.method=lora"], "peft.method=lora trains"),
        (
            [
                "train.distill_hidden_weight=1",
                "train.distill_layers=[[0, 0]]",
                "model.distill_proj=[2, 64]",
            ],
            "holds 2 projections",
        ),  # fmt: skip
        (["model.distill_proj=[2, 64]"], "model.distill_proj holds"),
        (["train.distill_hidden_weight=1", "model.distill_proj=[2]"], r"\[\] or \[M, D_"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config.load(None, [*KEYS, *bad])
    with pytest.raises(ConfigError, match="distill_hidden_weight has no effect"):
        config.load(None, ["train.distill_hidden_weight=1"])  # next_token


# ------------------------------------------------------------------ through jaxllm train

TINY = ["data.max_files=40", *(a for a in TINY_RUN if a != "model.num_layers=1")]
TINY.append("model.num_layers=2")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A tiny teacher run of width 64 and 3 blocks (the student: 32 and 2), trained 2 steps."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    wider = ["model.num_layers=3", "model.d_model=64", "model.mlp_dim=128", "train.steps=2"]
    assert main(["train", *TINY, *wider, f"run.dir={run}"]) == 0
    return run


def _features(teacher: Path, run: Path, *extra: str) -> list[str]:
    keys = ["train.objective=distill", f"train.teacher={teacher}"]
    return ["train", *TINY, *keys, "train.distill_hidden_weight=1", f"run.dir={run}", *extra]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_narrower_shallower_student_distills_features_through_the_cli(teacher, tmp_path):
    run = tmp_path / "student"
    assert main(_features(teacher, run, "train.steps=3")) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["hidden"]) and r["hidden"] > 0 for r in rows)
    assert rows[-1]["hidden"] < rows[0]["hidden"]  # the student's features move to the teacher's
    for r in rows:  # loss = distill (weight 1) + 1 x hidden
        assert r["loss"] == pytest.approx(r["distill"] + r["hidden"], rel=1e-5)
    saved = config.load(run / "config.yaml")  # the filled map and projections are recorded
    assert saved.train.distill_layers == ((0, 0), (1, 2))
    assert saved.model.distill_proj == (2, 64)

    # the projections trained and were saved; the run's model leaves them out of its logits
    model = jaxllm.load_model(run)
    fresh = build(saved.model, jax.random.split(jax.random.key(saved.run.seed))[0])
    assert model.distill_proj[...].shape == (2, 32, 64)
    assert float(jnp.abs(model.distill_proj[...] - fresh.distill_proj[...]).max()) > 1e-3
    tokens = _tokens() % 320
    np.testing.assert_array_equal(model(tokens).logits, model(tokens, hidden_states=True).logits)

    # exported as a plain Llama: no projections in the weights or the config
    assert main(["convert", "export", str(run), str(tmp_path / "hf")]) == 0
    from safetensors.numpy import load_file

    names = set(load_file(tmp_path / "hf/model.safetensors"))
    assert "model.embed_tokens.weight" in names and not any("distill" in n for n in names)
    assert "distill" not in (tmp_path / "hf/config.json").read_text()


@pytest.mark.slow  # three more runs of the two-model step (~60 s on a shared 2-core CPU)
def test_resume_generate_and_a_new_run_from_the_student(teacher, tmp_path):
    run = tmp_path / "student"
    assert main(_features(teacher, run, "train.steps=4", "checkpoint.every=2")) == 0
    shutil.copytree(run, tmp_path / "split")
    shutil.rmtree(tmp_path / "split/checkpoints/4")
    assert main(_features(teacher, tmp_path / "split", "train.steps=4", "checkpoint.every=2")) == 0
    a, b = jaxllm.load_model(run), jaxllm.load_model(tmp_path / "split")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(x, y)  # the projections resume with the rest
    assert main(["generate", str(run), "--prompt", "def", "--max-new-tokens", "4"]) == 0
    # fine-tuning from the student: a plain model, its projections not carried over
    sft = ["train", *TINY, "train.steps=1", f"checkpoint.init_from={run}"]
    assert main([*sft, f"run.dir={tmp_path / 'next'}"]) == 0
    assert config.load(tmp_path / "next/config.yaml").model.distill_proj == ()


@pytest.mark.parametrize(
    "bad, said",
    [
        ("train.distill_layers=[[0, 3]]", "pair [0, 3] is outside the stacks"),
        ("train.distill_layers=[[2, 0]]", "holds [2, 0]; each entry is [student block"),
        ("train.distill_hidden_weight=-1", "train.distill_hidden_weight must be >= 0"),
        ("model.distill_proj=[2, 32]", "model.distill_proj=[2, 32] but feature distillation"),
    ],
)
def test_bad_values_are_one_line_and_write_nothing(teacher, tmp_path, capsys, bad, said):
    run = tmp_path / "run"
    assert main([*_features(teacher, run), "train.steps=1", bad]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("jaxllm:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert said in lines[0]
    assert not run.exists()
