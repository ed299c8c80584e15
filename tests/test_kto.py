"""KTO end to end: `format: unpaired_preference` records (string and chat) become packed
(example, mismatched) pairs with their labels, bad labels and mismatched objectives are refused
in one line, and `train.objective=kto` learns a preference through `jaxllm train`, resumes
bit-identically, and equals one device on data 2 x fsdp 2 x tensor 2."""

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from test_train_preference import LORA, RUN, TIMINGS, _steps, run_metrics

import jaxllm
from jaxllm import cli, config
from jaxllm.config import ConfigError, DataConfig, SourceConfig
from jaxllm.data import chat
from jaxllm.data import tokenizer as tokenizer_lib
from jaxllm.data.pipeline import load_splits
from jaxllm.plan import plan
from jaxllm.train.loop import train

BYTES = tokenizer_lib.ByteTokenizer()


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def unpaired_file(tmp_path, n=64):
    """Every prompt's " yes" is desirable and its " no" undesirable, in alternation."""
    records = [
        {"prompt": f"q{i % 7}:", "completion": " yes" if i % 2 else " no", "label": bool(i % 2)}
        for i in range(n)
    ]
    return write(tmp_path / "unpaired.jsonl", records)


def examples_of(path, seq_len=64):
    """[(example ids, mismatched ids, label)] of the train rows, each sequence without its
    first and last token (BOS and EOS of string records)."""
    src = SourceConfig(path=path, format="unpaired_preference")
    rows = load_splits(DataConfig(sources=(src,), eval_sources=(src,), seq_len=seq_len))[0]
    out = []
    for row in (rows[i] for i in range(len(rows))):
        seg = row["segment_ids"]
        for k in range(seg.max() // 2):
            seqs = []
            for s in (2 * k + 1, 2 * k + 2):
                at = np.flatnonzero(seg == s)
                seqs.append(tuple(int(t) for t in row["inputs"][at[1:]]))  # after the first
                labels = set(row["label"][at])
                assert len(labels) == 1
            out.append((*seqs, bool(labels.pop())))
        assert not row["label"][seg == 0].any()
    return out


def test_records_become_example_and_mismatched_pairs_with_labels(tmp_path):
    records = [{"prompt": f"p{i}=", "completion": f"c{i}", "label": i % 3 == 0} for i in range(10)]
    got = examples_of(write(tmp_path / "u.jsonl", records))
    # each example's mismatched sequence: its prompt with the completion before it (cyclic)
    assert sorted(got) == sorted(
        (tuple(f"p{i}=c{i}".encode()), tuple(f"p{i}=c{(i - 1) % 10}".encode()), i % 3 == 0)
        for i in range(10)
    )
    chats = [
        {
            "prompt": [{"role": "user", "content": f"u{i}"}],
            "completion": [{"role": "assistant", "content": f"a{i}"}] if i else f"a{i}",
            "label": i == 1,
        }
        for i in range(3)
    ]
    got = examples_of(write(tmp_path / "c.jsonl", chats), seq_len=512)

    def render(i, j):  # no BOS / EOS around a chat rendering; inputs: all but the last
        messages = [chats[i]["prompt"][0], {"role": "assistant", "content": f"a{j}"}]
        return tuple(BYTES.encode_offsets(chat.render(messages, BYTES), specials=True)[0][1:-1])

    assert sorted(got) == sorted((render(i, i), render(i, (i - 1) % 3), i == 1) for i in range(3))


@pytest.mark.parametrize("label", [1, "yes", None, 0.0])
def test_a_label_that_is_not_a_boolean_is_one_line_and_exit_2(tmp_path, capsys, label):
    records = [{"prompt": "a", "completion": "b", "label": True}] * 3
    records.insert(1, {"prompt": "a", "completion": "b", "label": label})
    path = write(tmp_path / "u.jsonl", records)
    src = SourceConfig(path=path, format="unpaired_preference")
    with pytest.raises(ConfigError, match=r"u.jsonl line 2 has label .* are booleans"):
        load_splits(DataConfig(sources=(src,), seq_len=32, on_bad_record="skip"))
    source = f"[{{path: {path}, format: unpaired_preference}}]"
    args = [*RUN, f"data.sources={source}", "train.objective=kto", *LORA]
    assert cli.main(["train", *args, f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("jaxllm: ")]
    assert len(said) == 1 and "line 2 has label" in said[0] and "Traceback" not in err


@pytest.mark.parametrize(
    "overrides,why",
    [
        (["train.objective=sft"], "holds unpaired preferences"),
        (["train.objective=dpo"], "holds unpaired preferences, which train.objective=dpo"),
        (["train.objective=kto", "format=preference"], "trains on unpaired preferences"),
        (["train.objective=kto", "train.desirable_weight=0"], "desirable_weight must be positive"),
        (["train.objective=dpo", "train.undesirable_weight=2", "format=preference"], "no effect"),
    ],
)
def test_config_checks(overrides, why):
    fmt = next((o.split("=")[1] for o in overrides if o.startswith("format=")), None)
    source = f"[{{path: x.jsonl, format: {fmt or 'unpaired_preference'}}}]"
    rest = [o for o in overrides if not o.startswith("format=")]
    with pytest.raises(ConfigError, match=why):
        config.load(None, [f"data.sources={source}", *rest])


def test_plan_compiles_a_kto_step(tmp_path):
    """`jaxllm plan` lowers kto's step with the rows' `label` array."""
    source = f"[{{path: {unpaired_file(tmp_path)}, format: unpaired_preference}}]"
    cfg = config.load(None, [*RUN, f"data.sources={source}", "train.objective=kto", *LORA])
    assert plan(cfg, jax.devices()[:1])["compile_s"] > 0


def kto(run, source, *overrides) -> list[dict]:
    args = [*RUN, f"data.sources={source}", f"data.eval_sources={source}", *LORA]
    args += ["train.objective=kto", "train.beta=0.5", "optim.lr=3e-2", "train.eval_every=5"]
    train(config.load(None, [*args, f"run.dir={run}", *overrides]))
    return run_metrics(run)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    path = unpaired_file(tmp_path_factory.mktemp("unpaired"))
    return f"[{{path: {path}, format: unpaired_preference}}]"


def test_kto_with_lora_starts_at_the_reference_and_learns(source, tmp_path):
    """Under LoRA the reference is the base: at step 1 every reward and z are 0 and the loss
    is 1 - sigma(0) = 1/2; then desirable rewards rise above undesirable ones."""
    rows = kto(tmp_path / "run", source, "train.steps=10", "train.desirable_weight=1.5")
    first, last = rows[0], rows[-1]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["tokens"] == 16 for r in rows)  # two examples a row, 8 rows
    assert first["rewards/chosen"] == 0 and first["rewards/rejected"] == 0 and first["kl"] == 0
    # half the examples desirable (weight 1.5), half not (1): 0.5 * (1.5 + 1) / 2
    assert first["loss"] == pytest.approx(0.625, abs=1e-6)
    assert last["loss"] < first["loss"] - 0.05
    assert last["rewards/margins"] > 0.1 and last["rewards/chosen"] > last["rewards/rejected"]
    assert last["rewards/margins"] == pytest.approx(
        last["rewards/chosen"] - last["rewards/rejected"], rel=1e-4
    )
    assert last["kl"] >= 0 and abs(last["eval_loss"] - last["loss"]) < 0.1


@pytest.mark.slow
def test_precomputed_reference_equals_the_live_one(source, tmp_path):
    """`train.precompute_reference`: the reference's log-probabilities of the examples and of
    their mismatched sequences read from the run directory give the live reference's metrics."""
    live = kto(tmp_path / "live", source, "train.steps=3")
    stored = kto(tmp_path / "stored", source, "train.steps=3", "train.precompute_reference=true")
    assert (tmp_path / "stored/reference_logps/train.npy").exists()
    for got, want in zip(stored, live):
        for k in set(want) - set(TIMINGS):
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-5), (got["step"], k)


@pytest.mark.slow
def test_a_resumed_kto_run_equals_one_that_never_stopped(source, tmp_path):
    args = ["train.steps=4", "checkpoint.every=2", "checkpoint.save_final=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    want = kto(straight, source, *args)
    shutil.copytree(straight, split)
    shutil.rmtree(split / "checkpoints/4")
    got = kto(split, source, *args)  # resumes from step 2
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k not in TIMINGS} == {
            k: v for k, v in w.items() if k not in TIMINGS
        }
    a, b = jaxllm.load_model(straight), jaxllm.load_model(split)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(a), nnx.state(b))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A reference for full fine-tuning: one next-token step on short texts."""
    tmp = tmp_path_factory.mktemp("base")
    path = write(tmp / "t.jsonl", [{"text": f"q{i}: yes no maybe {i}"} for i in range(64)])
    run = tmp / "run"
    args = [*RUN, f"data.sources=[{{path: {path}}}]", "train.steps=1", "checkpoint.save_final=true"]
    train(
        config.load(
            None,
            [*args, "model.d_model=64", "model.num_heads=8"]
            + ["model.num_kv_heads=4", "model.mlp_dim=128", f"run.dir={run}"],
        )
    )
    return run


def test_one_device_equals_data_fsdp_tensor_parallel(tmp_path, base):
    """The same KTO steps on 1 device and on data 2 x fsdp 2 x tensor 2: equal losses, z,
    rewards and parameters (z is a statistic of the whole batch on both)."""
    src = config.SourceConfig(path=unpaired_file(tmp_path), format="unpaired_preference")
    data = config.DataConfig(sources=(src,), eval_sources=(src,), seq_len=32)
    rows = load_splits(data)[0]
    batches = [
        {k: np.stack([rows[(8 * b + i) % len(rows)][k] for i in range(8)]) for k in rows[0]}
        for b in range(3)
    ]

    def cfg(**mesh):
        return config.Config(
            model=tiny_model(vocab_size=320, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128),
            mesh=config.MeshConfig(**{"data": 1, **mesh}),
            data=data,
            train=config.TrainConfig(
                global_batch_size=8,
                steps=3,
                objective="kto",
                beta=2.0,
                reference=str(base),
                undesirable_weight=0.8,
            ),
            optim=config.OptimConfig(lr=3e-3, warmup_steps=0, eps=1e-6),
        )

    want, one = _steps(cfg(), jax.devices()[:1], batches)
    got, many = _steps(cfg(data=2, fsdp=2, tensor=2), jax.devices(), batches)
    for w, g in zip(want, got):
        for name in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "tokens"):
            np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert want[-1]["loss"] < want[0]["loss"]
    for a, b in zip(jax.tree.leaves(many.params), jax.tree.leaves(jax.device_get(one.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
