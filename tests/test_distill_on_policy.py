"""On-policy distillation (GKD, `train.distill_lambda`; `jaxllm.objectives.rollout.onpolicy`):
the prompts of packed SFT examples, the per-batch switch between the data's completions and
the student's own (lambda = 0 the pipeline's batches unchanged, lambda = 1 every batch sampled),
the loss masks of sampled rows, the loss against NumPy and against TRL's GKD on fixed samples,
resume, the config's refusals, and `jaxllm train` end to end."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_RUN, tiny_model

from jaxllm import checkpoint, config, sharding
from jaxllm.cli import main
from jaxllm.config import ConfigError
from jaxllm.data.packing import FirstFitRows, PackedRows
from jaxllm.data.pipeline import load_splits, train_batches
from jaxllm.data.rollout import example_prompts
from jaxllm.data.tokenizer import make_tokenizer
from jaxllm.infer.chat import prompt_ids
from jaxllm.model import build, split_peft
from jaxllm.objectives import distill
from jaxllm.objectives.rollout import onpolicy
from jaxllm.objectives.rollout.generation import rows, sequences

TINY = TINY_RUN
SUMS = [(a, b) for a in range(3, 40, 7) for b in range(2, 9, 3)]  # 18 prompt/completion records


def _data(tmp_path, chat=False) -> str:
    path = tmp_path / ("chat.jsonl" if chat else "sums.jsonl")
    with path.open("w") as f:
        for a, b in SUMS:
            if chat:
                turns = [("user", "hi"), ("assistant", "yes"), ("user", f"{a}+{b}?")]
                msgs = [{"role": r, "content": c} for r, c in turns]
                record = {"messages": [*msgs, {"role": "assistant", "content": str(a + b)}]}
            else:
                record = {"prompt": f"{a}+{b}=", "completion": str(a + b)}
            f.write(json.dumps(record) + "\n")
    return f"data.sources=[{{path: {path}, format: {'chat' if chat else 'prompt_completion'}}}]"


def _cfg(tmp_path, *keys, chat=False):
    base = ["train.objective=distill", "train.teacher=runs/teacher", "data.eval_fraction=0"]
    return config.load(None, [*TINY, _data(tmp_path, chat), *base, *keys])


# ------------------------------------------------------------------ prompts


def test_a_prompt_is_an_examples_tokens_before_its_last_trained_span(tmp_path):
    cfg = _cfg(tmp_path)
    tok = make_tokenizer(cfg.data)
    got = sorted(tuple(p) for p in example_prompts(load_splits(cfg.data)[0]))
    want = sorted((tok.bos_id, *tok.encode(f"{a}+{b}=")) for a, b in SUMS)
    assert got == want
    # a conversation: up to its last assistant reply, with the reply's opening, as generate's
    chat = _cfg(tmp_path, "data.seq_len=160", chat=True)
    got = sorted(tuple(p) for p in example_prompts(load_splits(chat.data)[0]))
    turns = [("user", "hi"), ("assistant", "yes")]
    msgs = [
        [*[{"role": r, "content": c} for r, c in turns], {"role": "user", "content": f"{a}+{b}?"}]
        for a, b in SUMS
    ]
    assert got == sorted(tuple(prompt_ids(m, tok)) for m in msgs)
    # the last of two trained spans; trained from the first token: no prompt; text: refused
    docs, masks = [np.arange(1, 9), np.arange(1, 5)], [[0, 0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1]]
    ff = FirstFitRows(docs, 16, bos_id=None, eos_id=None, masks=[np.array(m) for m in masks])
    assert [p.tolist() for p in example_prompts(ff)] == [[1, 2, 3, 4, 5, 6]]
    with pytest.raises(ConfigError, match="but data.sources hold text"):
        example_prompts(PackedRows([np.arange(40)], 16, bos_id=None, eos_id=None))


# ------------------------------------------------------------------ the switch


def _switch(tmp_path, monkeypatch, lam: float, *keys):
    """(an OnPolicyDistill at `lam` whose sampler writes "!?" + EOS after every prompt, the
    same pipeline's batches alone, the sampler's calls)."""
    cfg = _cfg(tmp_path, f"train.distill_lambda={lam}", "data.seq_len=96", *keys)
    calls = []

    def fake_sample(cfg_, model, mesh, prompts, temperature, seed, stops, ends):
        calls.append(SimpleNamespace(n=len(prompts), temperature=temperature, seed=seed))
        return None, sequences(prompts, [[33, 63]] * len(prompts), [stops] * len(prompts))

    monkeypatch.setattr(onpolicy, "sample", fake_sample)
    monkeypatch.setattr(onpolicy, "merge_model", lambda *a: None)
    train_rows = load_splits(cfg.data)[0]
    gbs = cfg.train.global_batch_size
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    it = onpolicy.OnPolicyDistill(
        cfg, mesh, slice(None), train_rows, train_batches(train_rows, cfg.data, gbs)
    )
    it.policy = SimpleNamespace(params=None, frozen=None, model_state=None)
    return it, train_batches(train_rows, cfg.data, gbs), calls


def test_lambda_zero_is_the_pipelines_batches_and_one_samples_every_batch(tmp_path, monkeypatch):
    it, plain, calls = _switch(tmp_path, monkeypatch, 0.0)
    for _ in range(6):
        batch, want = next(it), next(plain)
        assert set(batch) == {*want, "sampled"} and not batch["sampled"].any()
        for k, v in want.items():
            np.testing.assert_array_equal(batch[k], v)
    assert calls == [] and it.get_state()["next_batch"] == 6
    assert onpolicy.wrap(it.cfg, None, slice(None), None, plain) is plain  # never built at 0

    it, _, calls = _switch(tmp_path, monkeypatch, 1.0, "train.rollout_temperature=0.7")
    prompts = {tuple(p) for p in it.prompts}
    for _ in range(4):
        batch = next(it)
        assert batch["sampled"].all()
        for i in range(8):
            (p_end,) = np.flatnonzero(batch["inputs"][i] == ord("="))
            p = tuple(batch["inputs"][i, : p_end + 1])
            assert p in prompts  # a data prompt ...
            mask = np.flatnonzero(batch["loss_mask"][i])  # ... and only the completion is trained
            np.testing.assert_array_equal(mask, np.arange(len(p) - 1, len(p) + 2))
            np.testing.assert_array_equal(batch["targets"][i, mask], [33, 63, 257])
            assert not batch["segment_ids"][i, len(p) + 2 :].any()
    assert it.get_state() == {"next_batch": 0, "distill_batches": 4}  # the data was not read
    assert [c.n for c in calls] == [8] * 4 and {c.temperature for c in calls} == {0.7}
    assert len({c.seed for c in calls}) == 4
    with pytest.raises(ConfigError, match="leaves room for train.max_completion_tokens=64"):
        _switch(tmp_path, monkeypatch, 1.0, "data.seq_len=32")


def test_a_mixed_run_switches_per_batch_and_resumes_the_same_coins(tmp_path, monkeypatch):
    it, _, calls = _switch(tmp_path, monkeypatch, 0.5)
    first = [next(it) for _ in range(10)]
    state = it.get_state()
    rest = [next(it) for _ in range(30)]
    flags = [int(b["sampled"].max()) for b in first + rest]
    assert 8 <= sum(flags) <= 32 and len(calls) == sum(flags)
    assert it.get_state()["next_batch"] == 40 - sum(flags)  # the pipeline moves off-policy only
    again, _, _ = _switch(tmp_path, monkeypatch, 0.5)
    again.set_state(state)
    for want in rest:
        got = next(again)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


# ------------------------------------------------------------------ the loss

STUDENT = tiny_model(num_layers=1, d_model=32, mlp_dim=64)
TEACHER = tiny_model(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, mlp_dim=128)
EOS = 7


def _sampled_rows():
    """Two fixed samples: one stopped at EOS, one ran out of tokens (no stop)."""
    prompts = [np.array([1, 5, 9, 2], np.int32), np.array([1, 8, 3, 4], np.int32)]
    seqs = sequences(prompts, [[11, 12], [13, 14, 15, 16, 17]], [[EOS], []])
    batch = rows(prompts, seqs, 12)
    batch["sampled"] = np.ones_like(batch["loss_mask"])
    return prompts, seqs, {k: jnp.asarray(v) for k, v in batch.items()}


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _logits(model, batch):
    where = dict(positions_BxL=batch["positions"], segment_ids_BxL=batch["segment_ids"])
    return np.asarray(model(batch["inputs"], **where).logits, np.float64)


def test_the_loss_on_sampled_rows_is_the_masked_jsd_and_lambda_zero_changes_nothing():
    s, t = build(STUDENT, 0), build(TEACHER, 1)
    _, _, batch = _sampled_rows()
    temp, beta = 0.1, 0.3  # sharp enough that beta and 1 - beta differ by 1%
    out = distill.distill("jsd", temperature=temp, beta=beta)(s, batch, None, {"teacher": t})
    p_s, p_t = _softmax(_logits(s, batch) / temp), _softmax(_logits(t, batch) / temp)
    m = beta * p_t + (1 - beta) * p_s
    jsd = beta * np.sum(p_t * np.log(p_t / m), -1) + (1 - beta) * np.sum(p_s * np.log(p_s / m), -1)
    mask = np.asarray(batch["loss_mask"])
    assert mask.sum() == 3 + 5 and float(out.tokens) == 8
    np.testing.assert_allclose(out.metrics["distill"], temp**2 * np.sum(jsd * mask), rtol=1e-5)
    assert float(out.metrics["on_policy"]) == 8
    # a lambda = 0 batch (sampled all 0) has the plain objective's loss and metrics
    plain = {k: v for k, v in batch.items() if k != "sampled"}
    off = dict(plain, sampled=jnp.zeros_like(batch["sampled"]))
    objective = distill.distill("forward_kl")
    a, b = objective(s, plain, None, {"teacher": t}), objective(s, off, None, {"teacher": t})
    assert a.loss_sum == b.loss_sum and float(b.metrics.pop("on_policy")) == 0
    assert all(a.metrics[k] == b.metrics[k] for k in a.metrics) and set(a.metrics) == set(b.metrics)


@pytest.mark.torch
def test_sampled_rows_mask_and_loss_as_trl_gkd_on_the_same_samples(monkeypatch):
    """TRL's GKDTrainer.generate_on_policy_outputs labels the same completion tokens (its stop
    included, nothing after it) and its compute_loss (generalized_jsd_loss at temperature 1,
    the mean over those labels) equals distill / tokens."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from trl.experimental.gkd import GKDTrainer

    prompts, seqs, batch = _sampled_rows()
    width = max(map(len, seqs))
    padded = np.array([np.pad(q, (0, width - len(q))) for q in seqs])  # pad id 0 after the stop
    generator = SimpleNamespace(
        generate=lambda **kw: SimpleNamespace(sequences=torch.tensor(padded))
    )
    inputs = {"prompts": torch.tensor(np.stack(prompts)), "prompt_attention_mask": torch.ones(2, 4)}
    _, _, labels = GKDTrainer.generate_on_policy_outputs(
        generator, inputs, SimpleNamespace(eos_token_id=EOS)
    )
    shifted = labels[:, 1:].numpy()
    np.testing.assert_array_equal(np.asarray(batch["loss_mask"])[:, : width - 1], shifted != -100)
    s, t = build(STUDENT, 0), build(TEACHER, 1)
    for loss, beta in [("jsd", 0.5), ("forward_kl", 0.0), ("reverse_kl", 1.0)]:
        out = distill.distill(loss, beta=beta or 0.5)(s, batch, None, {"teacher": t})
        z_s, z_t = (torch.tensor(_logits(m, batch)[:, : width - 1]) for m in (s, t))
        theirs = GKDTrainer.generalized_jsd_loss(z_s, z_t, labels=labels[:, 1:], beta=beta)
        np.testing.assert_allclose(out.metrics["distill"] / out.tokens, theirs.item(), rtol=1e-5)


# ------------------------------------------------------------------ configuration


def test_config_refuses_what_on_policy_distillation_cannot_do(tmp_path):
    _cfg(tmp_path, "train.distill_lambda=0.5", "train.max_completion_tokens=8")  # loads
    for bad, match in [
        (["train.distill_lambda=1.5"], r"train.distill_lambda must be in \[0, 1\]"),
        (["train.distill_lambda=-0.1"], r"train.distill_lambda must be in \[0, 1\]"),
        (["train.max_completion_tokens=8"], "no effect with train.objective=distill and train.di"),
        (["train.distill_lambda=1", "train.distill_weight=0.5"], "set train.distill_weight=1"),
        (["train.distill_lambda=1", "data.train_on_prompt=true"], "no example has a prompt"),
        (["train.distill_lambda=1", "train.rollout_temperature=0"], "must be positive"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _cfg(tmp_path, *bad)
    with pytest.raises(ConfigError, match="has no effect with train.objective=sft"):
        config.load(None, ["train.objective=sft", "train.distill_lambda=0.5"])


@pytest.mark.parametrize(
    "keys, said",
    [
        (["train.distill_lambda=1"], "data source 'stdlib' has format auto, which has none"),
        (["train.distill_lambda=2"], "train.distill_lambda must be in [0, 1] (the share"),
    ],
)
def test_bad_values_are_one_line_through_the_cli(tmp_path, capsys, keys, said):
    run = tmp_path / "run"
    args = ["train", *TINY, "train.objective=distill", "train.teacher=runs/t", f"run.dir={run}"]
    assert main([*args, *keys]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("jaxllm:")]
    assert len(lines) == 1 and "Traceback" not in err and said in lines[0], err
    assert not run.exists()


# ------------------------------------------------------------------ through jaxllm train


def test_jaxllm_train_samples_every_batch_at_lambda_one(tmp_path):
    """A random teacher twice the student's size (saved as a run) and lambda = 1 with the
    reverse KL (MiniLLM's token-level loss on student samples): every step trains on sampled
    completions of at most max_completion_tokens + the stop, and evaluation on the data's."""
    teacher = tmp_path / "teacher"
    tcfg = config.load(None, [*TINY, "model.num_layers=2", "model.d_model=64", "model.mlp_dim=128"])
    teacher.mkdir()
    config.dump(tcfg, teacher / "config.yaml")
    checkpoint.save_params(
        checkpoint.checkpoint_dir(teacher, tcfg.checkpoint.dir),
        split_peft(build(tcfg.model, 1), None)[1],
        step=0,
        config=config.to_dict(tcfg),
        tokenizer=checkpoint.tokenizer_record(tcfg.data.tokenizer),
    )
    run = tmp_path / "student"
    keys = ["train.objective=distill", f"train.teacher={teacher}", "train.distill_lambda=1.0"]
    keys += ["train.distill_loss=reverse_kl", "train.max_completion_tokens=6", "train.steps=3"]
    keys += [_data(tmp_path), "data.eval_fraction=0.3", f"run.dir={run}"]
    assert main(["train", *TINY, *keys]) == 0
    got = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert r["on_policy"] == 1.0 and 0 < r["distill"] == r["loss"]
        assert 8 <= r["tokens"] <= 8 * (6 + 1)
    assert np.isfinite(got[-1]["eval_loss"])
