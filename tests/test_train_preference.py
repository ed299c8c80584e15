"""The DPO family trains through `jaxllm.train.loop.train` on a learnable synthetic preference set
(every prompt prefers " yes" to " no"): the loss falls and the reward accuracy rises, with the
step counting pairs, and evaluation reports the preference loss. DPO's reference is the starting
point (under LoRA the base with the adapters off), live or as log-probabilities computed before
training, and a resumed run equals one that never stopped."""

import json
import math
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

import jaxllm
from jaxllm import config, objectives, sharding
from jaxllm.data.pipeline import load_splits
from jaxllm.train import companions
from jaxllm.train.loop import compile_steps, to_global, train
from jaxllm.train.state import init_state, layout

RUN = [
    "data.seq_len=32",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.lr=3e-3",
    "optim.warmup_steps=0",
    "checkpoint.save_final=false",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def pairs_file(tmp_path, n=64):
    records = [{"prompt": f"q{i % 7}:", "chosen": " yes", "rejected": " no"} for i in range(n)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


TIMINGS = ("step_time_s", "tokens_per_s")
LORA = ["peft.method=lora", "peft.rank=4", "peft.alpha=8", "peft.targets=[all-linear]"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return f"[{{path: {pairs_file(tmp_path_factory.mktemp('pairs'))}, format: preference}}]"


def dpo(run, source, *overrides) -> list[dict]:
    """A DPO run of RUN on the synthetic pairs (train and eval), its metrics.jsonl rows."""
    args = [*RUN, f"data.sources={source}", f"data.eval_sources={source}"]
    args += ["train.objective=dpo", "train.beta=0.5", "optim.lr=3e-2", "train.eval_every=5"]
    train(config.load(None, [*args, f"run.dir={run}", *overrides]))
    return run_metrics(run)


@pytest.fixture(scope="module")
def base(tmp_path_factory, source):
    """A starting point for full fine-tuning: one SimPO step from a random initialisation."""
    run = tmp_path_factory.mktemp("base") / "run"
    dpo(run, source, "train.objective=simpo", "train.steps=1", "checkpoint.save_final=true")
    return run


@pytest.fixture(scope="module")
def lora_live(tmp_path_factory, source):
    return dpo(tmp_path_factory.mktemp("lora") / "run", source, *LORA, "train.steps=10")


# slow: SimPO trains by default in the mesh equality test below, DPO learns in the LoRA test
@pytest.mark.parametrize(
    "kind,beta",
    [
        pytest.param("simpo", 2.0, marks=pytest.mark.slow),
        pytest.param("orpo", 0.5, marks=pytest.mark.slow),
    ],
)
def test_reference_free_losses_learn_a_preference(tmp_path, kind, beta):
    source = f"[{{path: {pairs_file(tmp_path)}, format: preference}}]"
    run = tmp_path / "run"
    overrides = [*RUN, f"data.sources={source}", f"data.eval_sources={source}"]
    overrides += [f"train.objective={kind}", f"train.beta={beta}", "train.steps=10"]
    train(config.load(None, [*overrides, f"run.dir={run}"]))
    rows = run_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    # 32 slots hold two pairs of 6 + 5 predictions each: 16 pairs per batch of 8 rows
    assert all(r["tokens"] == 16 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.05
    assert rows[0]["rewards/accuracies"] < 1 and rows[-1]["rewards/accuracies"] == 1
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    for r in rows:
        margin = r["rewards/chosen"] - r["rewards/rejected"]
        assert math.isclose(r["rewards/margins"], margin, rel_tol=1e-4, abs_tol=1e-6)
    # the eval batch is a training batch here: its loss is the preference loss, near the last
    assert abs(rows[-1]["eval_loss"] - rows[-1]["loss"]) < 0.05


def _steps(cfg, devices, batches):
    cfg.validate(len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    step, _, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, seed=0, **layout(cfg))
    held = companions.resolve_others(cfg, objectives.from_config(cfg))
    state = state.replace(others=companions.load(held, mesh))  # the reference, if any
    metrics = []
    for batch in batches:
        state, m = step(state, to_global(batch, batch_sh))
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics, state


@pytest.mark.parametrize(
    "kind",
    ["simpo", *(pytest.param(k, marks=pytest.mark.slow) for k in ("dpo", "ipo", "orpo", "reward"))],
)
def test_one_device_equals_data_fsdp_tensor_parallel(tmp_path, request, kind):
    """The same preference steps on 1 device and on data 2 x fsdp 2 x tensor 2: equal losses,
    rewards and parameters (pairs never straddle the batch split: a pair lives in one row). DPO's
    reference, another model, is sharded on each mesh by its own axes."""
    src = config.SourceConfig(path=str(pairs_file(tmp_path)), format="preference")
    data = config.DataConfig(sources=(src,), eval_sources=(src,), seq_len=32)
    rows = load_splits(data, whole_inputs=kind == "reward")[0]
    reference = str(request.getfixturevalue("base")) if kind in ("dpo", "ipo") else None
    batches = [
        {k: np.stack([rows[(8 * b + i) % len(rows)][k] for i in range(8)]) for k in rows[0]}
        for b in range(3)
    ]

    def cfg(**mesh):
        return config.Config(
            model=tiny_model(
                vocab_size=320,
                d_model=64,
                num_heads=8,
                num_kv_heads=4,
                mlp_dim=128,
                head="score" if kind == "reward" else "lm",
            ),
            mesh=config.MeshConfig(**{"data": 1, **mesh}),
            data=data,
            train=config.TrainConfig(
                global_batch_size=8,
                steps=3,
                objective=kind,
                beta=0.1 if kind == "reward" else 2.0,  # the reward objective reads no beta
                reference=reference,
            ),
            optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
        )

    want, one = _steps(cfg(), jax.devices()[:1], batches)
    got, many = _steps(cfg(data=2, fsdp=2, tensor=2), jax.devices(), batches)
    for w, g in zip(want, got):
        names = ("loss", "rewards/margins", "rewards/chosen", "tokens")
        for name in (*names, "accuracy" if kind == "reward" else "logps/rejected"):
            np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert want[-1]["loss"] < want[0]["loss"]
    for a, b in zip(jax.tree.leaves(many.params), jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_dpo_with_lora_starts_at_zero_rewards_and_learns(lora_live):
    """The reference is the base with the adapters off: at step 1 the policy is the base
    (B = 0), so every reward is exactly 0 and the loss is log 2; then it learns."""
    first, last = lora_live[0], lora_live[-1]
    assert first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0
    assert first["rewards/margins"] == 0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert last["loss"] < first["loss"] - 0.05
    assert last["rewards/accuracies"] > first["rewards/accuracies"]
    assert last["rewards/margins"] > 0 and abs(last["eval_loss"] - last["loss"]) < 0.05


def test_precomputed_reference_equals_the_live_one(lora_live, source, tmp_path):
    """`train.precompute_reference`: the same run with the reference's log-probabilities read
    from the run directory instead of computed at each step gives the same metrics, and the
    stored values sit exactly on the rows' trained slots."""
    run = tmp_path / "run"
    rows = dpo(run, source, *LORA, "train.steps=10", "train.precompute_reference=true")
    assert len(rows) == len(lora_live)
    for got, want in zip(rows, lora_live):
        assert got.keys() == want.keys()
        for k in set(want) - set(TIMINGS):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-5), (got["step"], k)
    data = config.load(run / "config.yaml").data
    train_rows, eval_rows = load_splits(data)
    stored = np.load(run / "reference_logps/train.npy")
    assert stored.dtype == np.float32 and stored.shape == (len(train_rows), 32)
    mask = np.stack([train_rows[i]["loss_mask"] for i in range(len(train_rows))])
    np.testing.assert_array_equal(stored != 0, mask != 0)
    assert np.all(stored <= 0)
    assert np.load(run / "reference_logps/eval.npy").shape == (min(8, len(eval_rows)), 32)
    meta = json.loads((run / "reference_logps/meta.json").read_text())
    assert meta["train"]["rows"] == len(train_rows) and "base" in meta["reference"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dpo", "ipo"])
def test_dpo_and_ipo_from_a_checkpoint_use_it_as_reference(base, source, tmp_path, kind):
    rows = dpo(tmp_path / "run", source, f"train.objective={kind}", f"checkpoint.init_from={base}")
    first, last = rows[0], rows[-1]
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-6)
    # at the reference the margin is 0: DPO's loss is log 2, IPO's (0 - 1 / (2 beta))^2 = 1
    assert first["loss"] == pytest.approx(math.log(2) if kind == "dpo" else 1.0, abs=1e-5)
    assert last["loss"] < first["loss"] - 0.05
    assert last["rewards/margins"] > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True], ids=["live", "precomputed"])
def test_a_resumed_dpo_run_equals_one_that_never_stopped(base, source, tmp_path, precompute):
    """4 steps straight, and 2 + 2 with the reference (or its stored log-probabilities)
    loaded again at the resume: bit-identical parameters and metrics. Stored log-probabilities
    are reused, computed again for other rows, and refused for another reference."""
    args = [f"checkpoint.init_from={base}", "train.steps=4", "checkpoint.every=2"]
    args += ["checkpoint.save_final=true", f"train.precompute_reference={precompute}"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    want = dpo(straight, source, *args)
    shutil.copytree(straight, split)  # keeps the files' modification times
    shutil.rmtree(split / "checkpoints/4")
    got = dpo(split, source, *args)  # resumes from step 2
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k not in TIMINGS} == {
            k: v for k, v in w.items() if k not in TIMINGS
        }
    a, b = jaxllm.load_model(straight), jaxllm.load_model(split)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(a), nnx.state(b))
    if not precompute:
        return
    store, meta_path = split / "reference_logps", split / "reference_logps/meta.json"
    mtimes = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    assert mtimes == {
        p.name: p.stat().st_mtime_ns for p in (straight / "reference_logps").iterdir()
    }
    meta = json.loads(meta_path.read_text())
    stale = {**meta, "train": {**meta["train"], "sha256": "0" * 64}}  # as if other rows
    meta_path.write_text(json.dumps(stale))
    dpo(split, source, *args)  # at step 4 already: only the start-up, which computes train again
    assert json.loads(meta_path.read_text()) == meta
    assert (store / "train.npy").stat().st_mtime_ns > mtimes["train.npy"]
    assert (store / "eval.npy").stat().st_mtime_ns == mtimes["eval.npy"]
    np.testing.assert_array_equal(
        np.load(store / "train.npy"), np.load(straight / "reference_logps/train.npy")
    )
    other = {**meta, "reference": {**meta["reference"], "sha256": "0" * 64}}
    meta_path.write_text(json.dumps(other))
    with pytest.raises(config.RunError, match="trained against the reference log-prob"):
        dpo(split, source, *args)
