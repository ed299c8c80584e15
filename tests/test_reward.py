"""Reward models: the score head on the decoder, the Bradley-Terry `reward` objective on rows in
the preference layout, every objective metric at evaluation, a reward model started from a
language model (its head left behind, the score head fresh), scoring for RL, and Hugging Face's
`*ForSequenceClassification` out and in with the same scores."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from jax.sharding import PartitionSpec

from jaxllm import checkpoint, cli, config, objectives, optim, sharding
from jaxllm.config import ConfigError, MeshConfig
from jaxllm.evaluate import evaluate_checkpoint
from jaxllm.infer.reward import score
from jaxllm.load import load_weights
from jaxllm.metrics import param_counts
from jaxllm.model import abstract_model, build, split_peft
from jaxllm.objectives import reward
from jaxllm.objectives.base import pair_sums
from jaxllm.objectives.reward import last_positions
from jaxllm.train.loop import compile_steps, evaluate, train
from jaxllm.train.state import init_state, init_state_from, layout

L = 32
REWARD = [
    "model.head=score",
    "train.objective=reward",
    "data.sources=[{path: pairs.jsonl, format: preference}]",  # read only by training
]
TINY = [
    "model.vocab_size=320",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.max_seq_len=64",
    "model.dtype=float32",
    f"data.seq_len={L}",
    "train.global_batch_size=8",
]


def pack(pairs, length=L) -> dict:
    """One row in the preference layout with whole inputs: pair k's chosen then rejected
    sequence (prompt + answer) as segments 2k+1, 2k+2, each sequence's every token an input
    (the last one's target is padding), the loss mask on the answer's targets."""
    row = {k: np.zeros(length, np.int32) for k in ("inputs", "targets", "segment_ids")}
    row |= {"positions": np.zeros(length, np.int32), "loss_mask": np.zeros(length, np.int32)}
    at = 0
    for k, (prompt, *answers) in enumerate(pairs):
        for j, answer in enumerate(answers):
            seq = [*prompt, *answer]
            n = len(seq)
            row["inputs"][at : at + n] = seq
            row["targets"][at : at + n - 1] = seq[1:]
            row["segment_ids"][at : at + n] = 2 * k + 1 + j
            row["positions"][at : at + n] = np.arange(n)
            row["loss_mask"][at + len(prompt) - 1 : at + n - 1] = 1
            at += n
    return row


def batch_of(rows) -> dict:
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def random_pairs(rng, n, vocab=64):
    """n pairs of random token sequences (no 0, the pad id): prompt, chosen, rejected."""
    draw = lambda lo, hi: list(rng.integers(1, vocab, rng.integers(lo, hi)))  # noqa: E731
    return [(draw(2, 5), draw(1, 5), draw(1, 5)) for _ in range(n)]


def learnable_batch(rng, rows=8):
    """Rows of pairs whose chosen answer ends in token 7 and rejected one in token 9."""
    out = []
    for _ in range(rows):
        pairs = [(p, [*c[:3], 7], [*r[:3], 9]) for p, c, r in random_pairs(rng, 2)]
        out.append(pack(pairs))
    return batch_of(out)


def test_pair_sums_and_last_positions():
    seg = jnp.asarray([[1, 1, 2, 2, 2, 3, 3, 0], [1, 2, 0, 0, 0, 0, 0, 0]])
    pos = jnp.asarray([[0, 1, 0, 1, 2, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]])
    x = jnp.arange(16, dtype=jnp.float32).reshape(2, 8)
    chosen, rejected, valid = pair_sums(x, seg)
    assert chosen.shape == (2, 4)
    np.testing.assert_array_equal(chosen[0, :2], [0 + 1, 5 + 6])
    np.testing.assert_array_equal(rejected[0, :2], [2 + 3 + 4, 0])
    np.testing.assert_array_equal(valid, [[1, 0, 0, 0], [1, 0, 0, 0]])  # pair 2 of row 0 lacks 4
    np.testing.assert_array_equal(chosen[1, 0], 8)
    np.testing.assert_array_equal(rejected[1, 0], 9)
    last = last_positions(pos, seg)
    np.testing.assert_array_equal(last, [[0, 1, 0, 0, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    # order-free: a permuted row (ring attention's zigzag layout) marks the same tokens
    perm = jnp.asarray([3, 7, 0, 5, 1, 6, 2, 4])
    np.testing.assert_array_equal(last_positions(pos[:, perm], seg[:, perm]), last[:, perm])


def test_score_head_replaces_the_lm_head_with_logical_axes():
    _, lm, lm_axes = abstract_model(tiny_model())
    _, rm, rm_axes = abstract_model(tiny_model(head="score"))
    assert "lm_head" in lm and "score" not in lm
    assert "lm_head" not in rm and rm["score"].shape == (32, 1)
    assert rm_axes["score"] == ("embed", None)
    assert {k: v for k, v in rm.items() if k != "score"}.keys() == lm.keys() - {"lm_head"}
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4))
    sharding.check_divisible(mesh, rm, rm_axes)
    assert sharding.tree_shardings(mesh, rm_axes)["score"].spec == PartitionSpec("fsdp", None)
    assert param_counts(tiny_model(head="score"))["total"] == sum(
        a.size for a in jax.tree.leaves(rm)
    )
    out = build(tiny_model(head="score"))(jnp.ones((2, 5), jnp.int32)).logits
    assert out.shape == (2, 5, 1) and out.dtype == jnp.float32


def test_a_head_that_does_not_fit_the_objective_is_refused():
    fits = config.load(None, [*TINY, *REWARD]).validate(8)
    objectives.from_config(fits)
    # the objective checks the head when it is chosen (an imported reward model's run is valid)
    chosen = {
        ("train.objective=reward", REWARD[2]): "set model.head=score",
        ("model.head=score",): "train.objective=next_token needs the LM head, but model.head",
    }
    for overrides, message in chosen.items():
        cfg = config.load(None, [*TINY, *overrides]).validate(8)
        with pytest.raises(ConfigError, match=message):
            objectives.from_config(cfg)
    # an objective of your own may use either head
    mine = "train.objective=jaxllm.objectives:next_token"
    objectives.from_config(config.load(None, [*TINY, "model.head=score", mine]).validate(8))
    refused = {
        "model.tie_embeddings=true": "model.tie_embeddings acts on the LM head",
        "model.final_soft_cap=30": "model.final_soft_cap acts on the LM head",
        "peft.method=lora": "frozen; add peft.modules_to_save=.score.",
        "peft.method=adapter": "would leave the score head frozen; train",
    }
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            config.load(None, [*TINY, *REWARD, override]).validate(8)


def test_reward_objective_matches_scoring_each_sequence():
    """The objective's pairwise sums equal the Bradley-Terry loss of `infer.reward.score` on
    each sequence alone, right-padded: the training path and the RL scoring path agree."""
    rng = np.random.default_rng(0)
    model = build(tiny_model(head="score"), 1)
    pairs = [random_pairs(rng, 3), random_pairs(rng, 2)]
    batch = batch_of([pack(p, 48) for p in pairs])
    out = jax.jit(lambda b: reward.objective()(model, b, None))(batch)

    seqs = [[*pr, *ans] for row in pairs for pr, *answers in row for ans in answers]
    tokens = np.zeros((len(seqs), 16), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = jnp.asarray([len(s) for s in seqs])
    r = np.asarray(jax.jit(score)(model, jnp.asarray(tokens), lengths))
    chosen, rejected = r[0::2], r[1::2]
    margin = chosen - rejected
    assert float(out.tokens) == 5
    np.testing.assert_allclose(out.loss_sum, np.sum(np.logaddexp(0, -margin)), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["accuracy"], np.sum(margin > 0))
    np.testing.assert_allclose(out.metrics["rewards/chosen"], chosen.sum(), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["rewards/rejected"], rejected.sum(), rtol=1e-5)
    np.testing.assert_allclose(out.metrics["rewards/margins"], margin.sum(), rtol=1e-4, atol=1e-6)
    # padding after a sequence does not move its score
    np.testing.assert_allclose(score(model, jnp.asarray(tokens[:, :12]), lengths), r, atol=1e-6)
    with pytest.raises(ValueError, match="reward model"):
        score(build(tiny_model()), jnp.asarray(tokens), lengths)


def test_reward_trains_in_the_one_step_and_evaluates_every_metric():
    """A few jitted train steps of the `reward` objective on 8 devices separate chosen from
    rejected answers (chosen end in token 7, rejected in 9); evaluation reports every metric
    of the objective as eval_<name>, each its sum over the pairs."""
    cfg = config.load(None, [*TINY, *REWARD, "optim.lr=3e-3", "optim.warmup_steps=0"])
    cfg.validate(8)
    mesh = sharding.make_mesh(cfg.mesh)
    jit_train, jit_eval, tx, _, batch_sh = compile_steps(cfg, mesh)
    state = init_state(cfg.model, tx, mesh, 0, **layout(cfg))
    rng = np.random.default_rng(1)
    held_out = [{k: np.asarray(v) for k, v in learnable_batch(rng).items()}]
    before = evaluate(jit_eval, state.params, held_out, batch_sh)
    for _ in range(30):
        state, metrics = jit_train(state, jax.device_put(learnable_batch(rng), batch_sh))
    assert float(metrics["tokens"]) == 16  # pairs, not tokens
    after = evaluate(jit_eval, state.params, held_out, batch_sh)
    names = {"loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margins"}
    assert set(after) == {f"eval_{n}" for n in names}
    assert after["eval_accuracy"] == 1.0 and after["eval_loss"] < 0.3 < before["eval_loss"]
    assert after["eval_rewards/margins"] == pytest.approx(
        after["eval_rewards/chosen"] - after["eval_rewards/rejected"], rel=1e-5
    )


def _save_run(path, cfg, params):
    """A run directory with a weights-only checkpoint of `params` at step 0."""
    path.mkdir(parents=True)
    config.dump(cfg, path / "config.yaml")
    ckpt_dir = checkpoint.checkpoint_dir(path, cfg.checkpoint.dir)
    checkpoint.save_params(
        ckpt_dir,
        params,
        step=0,
        config=config.to_dict(cfg),
        tokenizer=checkpoint.tokenizer_record(cfg.data.tokenizer),
    )
    return path


def test_init_from_a_language_model_keeps_its_body_and_starts_the_score_head_fresh(
    tmp_path, capsys
):
    for tied in (False, True):
        lm_cfg = config.load(None, [*TINY, f"model.tie_embeddings={str(tied).lower()}"])
        lm_params = split_peft(build(lm_cfg.model, 3), None)[1]
        run = _save_run(tmp_path / f"lm{tied}", lm_cfg, lm_params)
        rm_cfg = config.load(None, [*TINY, *REWARD, f"checkpoint.init_from={run}"])
        mesh = sharding.make_mesh(rm_cfg.mesh)
        params, _ = load_weights(run, rm_cfg.model, mesh)
        assert set(params) == set(lm_params) - {"lm_head", "score"}
        _, _, axes = abstract_model(rm_cfg.model)
        tx = optim.build(rm_cfg.optim, 10, axes)
        state = init_state_from(params, rm_cfg.model, tx, mesh, 5, **layout(rm_cfg))
        fresh = init_state(rm_cfg.model, tx, mesh, 5, **layout(rm_cfg))
        np.testing.assert_array_equal(state.params["score"], fresh.params["score"])
        jax.tree.map(
            np.testing.assert_array_equal,
            {k: v for k, v in state.params.items() if k != "score"},
            {k: v for k, v in lm_params.items() if k != "lm_head"},
        )
    # the other way round is no rule: a language model from a reward model names the head
    rm_run = _save_run(tmp_path / "rm", rm_cfg, jax.device_get(state.params))
    with pytest.raises(ConfigError, match="lm_head|score"):
        load_weights(rm_run, lm_cfg.model, mesh)
    # and a reward model does not generate
    assert cli.main(["generate", str(rm_run), "--prompt", "def"]) == 2
    assert "is a reward model (model.head=score)" in capsys.readouterr().err


@pytest.mark.torch
@pytest.mark.parametrize(
    "family, knobs",
    [("Llama", []), ("Qwen2", ["model.qkv_bias=true", "model.norm_eps=1e-6"])],
)
def test_export_to_sequence_classification_scores_as_jaxllm_and_imports_back(
    tmp_path, family, knobs
):
    import torch
    import transformers as hf

    from jaxllm.load import load_model

    torch.set_num_threads(1)
    cfg = config.load(None, [*TINY, *REWARD, *knobs, f"run.dir={tmp_path / 'rm'}"])
    model = build(cfg.model, 2)
    params = split_peft(model, None)[1]
    params["score"] = params["score"] * 50  # scores far from 0
    run = _save_run(tmp_path / "rm", cfg, params)
    assert cli.main(["convert", "export", str(run), str(tmp_path / "hf")]) == 0
    written = json.loads((tmp_path / "hf/config.json").read_text())
    assert written["architectures"] == [f"{family}ForSequenceClassification"]
    assert written["pad_token_id"] == 0 and len(written["id2label"]) == 1

    rng = np.random.default_rng(3)
    lengths = np.asarray([20, 7, 13, 1])
    tokens = rng.integers(1, 256, (4, 20))  # bytes, never the pad byte 0
    tokens[np.arange(20)[None, :] >= lengths[:, None]] = 0  # right-padded
    theirs = hf.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    assert theirs.config.num_labels == 1 and theirs.score.weight.shape == (1, 32)
    with torch.no_grad():
        hf_scores = theirs(torch.tensor(tokens)).logits[:, 0].numpy()
    ours = np.asarray(score(load_model(run), jnp.asarray(tokens), jnp.asarray(lengths)))
    assert np.abs(ours).max() > 0.5
    np.testing.assert_allclose(hf_scores, ours, atol=1e-4)

    # and back: the Hugging Face directory loads directly, and imports as a reward run
    direct = load_model(tmp_path / "hf", overrides=["model.dtype=float32"])
    np.testing.assert_allclose(score(direct, tokens, lengths), ours, atol=1e-5)
    assert cli.main(["convert", "import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = config.load(tmp_path / "back/config.yaml")
    assert back.model.head == "score"
    np.testing.assert_allclose(
        score(load_model(tmp_path / "back"), tokens, lengths), ours, atol=1e-5
    )


@pytest.mark.torch
def test_init_from_a_hugging_face_causal_lm(tmp_path):
    from hf_models import hf_model, save_hf

    from jaxllm.convert import model_config

    src = save_hf(hf_model("llama2"), tmp_path / "hf")
    lm = model_config(src, ["model.dtype=float32"])
    rm_model = dataclasses.replace(lm.model, head="score")
    params, _ = load_weights(src, rm_model, sharding.make_mesh(MeshConfig()))
    assert "lm_head" not in params and "score" not in params
    assert params["layers"]["attn"]["q_proj"].shape[0] == 2


def preference_file(path, n, seed):
    """n pairs of a learnable preference that needs the prompt: after "up" the answer ending
    in " :)" is chosen, after "down" the one ending in " :(" (random words before both)."""
    rng = np.random.default_rng(seed)
    word = lambda: "".join(rng.choice(list("abcdefgh"), rng.integers(2, 5)))  # noqa: E731
    records = []
    for _ in range(n):
        up = bool(rng.integers(2))
        happy, sad = f" {word()} :)", f" {word()} :("
        chosen, rejected = (happy, sad) if up else (sad, happy)
        prompt = f"{word()} {'up' if up else 'down'}:"
        records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "peft",
    [[], ["peft.method=lora", "peft.modules_to_save=[score]", "peft.targets=[all-linear]"]],
    ids=["full", "lora"],
)
def test_a_reward_model_trains_through_train_and_ranks_held_out_pairs(tmp_path, peft):
    """`jaxllm.train.train` with `train.objective=reward` on format: preference sources: the
    step counts pairs, and the held-out accuracy at the end is above 0.9; in full, or LoRA
    with the score head trained whole beside the adapters (PEFT's modules_to_save)."""
    source = lambda f: f"[{{path: {f}, format: preference}}]"  # noqa: E731
    overrides = [
        *TINY,
        *REWARD,
        f"data.sources={source(preference_file(tmp_path / 'train.jsonl', 256, 0))}",
        f"data.eval_sources={source(preference_file(tmp_path / 'test.jsonl', 64, 1))}",
        "data.seq_len=64",
        "train.steps=40",
        "train.log_every=10",
        "train.eval_every=0",
        "train.eval_batches=2",
        "optim.lr=3e-3",
        "optim.warmup_steps=0",
        f"run.dir={tmp_path / 'run'}",
        *peft,
        *(["optim.lr=1e-2"] if peft else []),  # LoRA on a random base: a larger step
    ]
    final = train(config.load(None, overrides))
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # pairs, not tokens: a sequence takes at least 15 slots, so a row of 64 holds 2 pairs at most
    assert all(1 <= r["tokens"] <= 8 * 2 for r in rows)
    assert rows[-1]["eval_accuracy"] == final["eval_accuracy"] > 0.9
    assert final["eval_rewards/margins"] > 0
    assert "sample" not in final  # nothing to generate
    # `jaxllm eval` of the run packs the pairs as training did, so it reads the same accuracy
    again = evaluate_checkpoint(tmp_path / "run", num_batches=2)
    assert again["eval_accuracy"] == pytest.approx(final["eval_accuracy"])
    assert again["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-4)
