"""Batches on the engine (`jaxllm.infer.engine.batch`), as GRPO / PPO rollouts and chat replies
run them: the static generator's tokens, stops and ends at temperature 0, the same samples from
the same seeds, a group's prompt pages shared, and the static generator where the engine
cannot run."""

import jax
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm import config, sharding
from jaxllm.config import GenerateConfig
from jaxllm.data import tokenizer as tokenizer_lib
from jaxllm.infer import chat
from jaxllm.infer.engine import Engine, SamplingParams, batch
from jaxllm.infer.engine.pages import PagePool
from jaxllm.infer.generate import generate
from jaxllm.infer.reference import greedy_continue
from jaxllm.model.transformer import build
from jaxllm.objectives.rollout.generation import sample
from jaxllm.train.loop import train

RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(1, 64, size=n).tolist() for n in (3, 9, 12, 5)]
GROUPS = [p for p in PROMPTS for _ in range(3)]  # a GRPO batch: each prompt G = 3 times
GEN = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=8)


@pytest.fixture(scope="module")
def model():
    return build(tiny_model(init_std=0.5, max_seq_len=64), seed=0)  # peaked logits


def _static(monkeypatch):
    monkeypatch.setattr(batch, "static_reason", lambda *a: "the test asks for it")


def test_greedy_gives_the_static_generators_tokens_stops_and_ends(model):
    free = generate(model, GROUPS, GEN).tokens
    # stops that fire mid-row: one token (the engine stops on it), then two tokens and a
    # two-token sequence (the rows run on and are cut as the static generator cuts them)
    one = [free[0][3]]
    several = [free[0][3], free[3][5]], [tuple(free[9][2:4])]
    for stops, seqs in [(one, ()), several]:
        want = generate(model, GROUPS, GEN, stop_tokens=stops, stop_sequences=seqs)
        got = batch.generate(model, GROUPS, GEN, stop_tokens=stops, stop_sequences=seqs)
        assert got.tokens == want.tokens and got.ends == want.ends
        assert got.stopped == want.stopped and any(got.stopped)
    assert list(several[1][0]) in got.ends  # a row did end on the sequence


def test_the_same_seed_gives_the_same_samples_and_a_group_differs(model):
    gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=8, temperature=1.0, seed=3)
    first = batch.generate(model, GROUPS, gen).tokens
    assert batch.generate(model, GROUPS, gen).tokens == first
    assert len({tuple(t) for t in first[:3]}) > 1  # a group's samples are not copies
    other = batch.generate(model, GROUPS, GenerateConfig(**{**vars(gen), "seed": 4})).tokens
    assert other != first
    seeds = list(range(100, 100 + len(GROUPS)))  # one per row: a run takes its first row's
    by_row = batch.generate(model, GROUPS, gen, seeds=seeds).tokens
    assert batch.generate(model, GROUPS[:6], gen, seeds=seeds[:6]).tokens == by_row[:6]
    # two groups of the same prompt side by side sample as each group alone
    twice = batch.generate(model, GROUPS[:3] * 2, gen, seeds=seeds[:6], group=3).tokens
    alone = batch.generate(model, GROUPS[:3], gen, seeds=seeds[3:6], group=3).tokens
    assert twice[3:] == alone and twice[:3] == by_row[:3]


RUN = [
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "model.vocab_size=264",
    "model.max_seq_len=32",
    "model.dtype=float32",
    "data.seq_len=24",
    "generate.kv_cache_dtype=float32",
    "generate.kv_page_size=4",
    "generate.kv_group=4",
    "train.objective=grpo",
    "train.reward=exact_match",
    "train.global_batch_size=12",
    "train.num_generations=4",
    "train.max_completion_tokens=6",
]


def test_rollouts_equal_the_static_generator_and_a_group_shares_its_prompt_pages(
    tmp_path, monkeypatch
):
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    cfg = config.load(None, [*RUN, f"data.sources=[{{path: {source}, format: rollout}}]"])
    model = build(cfg.model, 0)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    prompts = [np.asarray(RNG.integers(1, 256, size=10), np.int32) for _ in range(3)]
    prompts = [p for p in prompts for _ in range(4)]
    hits = []
    lookup = PagePool.lookup

    def spy(pool, hashes):  # what each admitted sample found in the prefix cache
        pages = lookup(pool, hashes)
        hits.append(list(pages))
        return pages

    monkeypatch.setattr(PagePool, "lookup", spy)
    out, seqs = sample(cfg, model, mesh, prompts, 0.0, 7, [257], ())
    # samples 1..3 of each prompt find its two full 4-token pages (the third holds the last
    # prompt token, which each sample feeds itself); sample 0 finds none
    assert sorted(len(h) for h in hits) == [0] * 3 + [2] * 9
    assert len({tuple(h) for h in hits if h}) == 3  # the same two pages for the whole group
    _static(monkeypatch)
    static_out, static_seqs = sample(cfg, model, mesh, prompts, 0.0, 7, [257], ())
    assert out.tokens == static_out.tokens and out.ends == static_out.ends
    for a, b in zip(seqs, static_seqs):
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()  # sampled on the engine: the same seed gives the same rollouts
    hot = [sample(cfg, model, mesh, prompts, 1.0, 11, [257], ())[0].tokens for _ in range(2)]
    assert hot[0] == hot[1] and hot[0] != out.tokens


def test_chat_replies_and_exact_match_are_the_static_generators(monkeypatch):
    tok = tokenizer_lib.ByteTokenizer()
    model = build(tiny_model(vocab_size=264, max_seq_len=128, init_std=0.5), seed=1)
    asks = [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in ((1, 2), (30, 4))]
    convs = [chat.Conversation(tuple(m), "3") for m in asks]
    gen = GenerateConfig(kv_cache_dtype="float32")
    ids = [chat.prompt_ids(m, tok) for m in asks]
    free = generate(model, ids, GenerateConfig(kv_cache_dtype="float32", max_new_tokens=10))
    stop = free.tokens[0][4:5]  # a second stop (with EOS) that fires in the first reply
    results = []
    for static in (False, True):
        if static:
            _static(monkeypatch)
        results.append(chat.Chat(model, tok, gen, stop_ids=stop).exact_match(convs))
    assert results[0] == results[1]
    assert len(results[0].replies[0]) < len(tok.decode(free.tokens[0]))  # the stop cut it


def test_int4_pages_and_where_the_static_generator_runs(model):
    four = GenerateConfig(kv_cache_dtype="int4", kv_group=4, max_new_tokens=8)
    assert batch.static_reason(model, four, None) is None
    want = generate(model, GROUPS, four).tokens
    assert batch.generate(model, GROUPS, four).tokens == want
    split = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sequence",))
    assert "sequence" in batch.static_reason(model, four, split)  # the engine refuses it


@pytest.mark.slow
def test_lora_on_a_tensor_mesh_samples_on_the_engine_and_qlora_on_the_static_generator(
    tmp_path, monkeypatch
):
    """A training state's LoRA factors need not split evenly (they stay where training put
    them); a QLoRA run's NF4 base is not laid out by logical axes: its rollouts fall back."""
    from test_grpo import RUN as GRPO
    from test_grpo import _prompts

    static = []
    real = batch.static_generate
    monkeypatch.setattr(batch, "static_generate", lambda *a, **k: static.append(1) or real(*a, **k))
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=2", "train.beta=0.1"]
    for method, targets in [("lora", "q_proj, v_proj"), ("qlora", "o_proj")]:
        static.clear()
        run = [*GRPO, *mesh, f"data.sources={_prompts(tmp_path)}", f"peft.method={method}"]
        train(
            config.load(None, [*run, f"peft.targets=[{targets}]", f"run.dir={tmp_path / method}"])
        )
        assert bool(static) == (method == "qlora"), method


def test_at_default_settings_the_static_generator_and_the_engine_pick_the_same_tokens():
    """One default KV cache (`config.sections.KV_CACHE_DTYPE`, float32) for `generate`, the
    engine and `jaxllm serve`. On this model (init_std=1: near-ties) a bfloat16 cache, once the
    static generator's default, picks other tokens than the engine's float32 cache did."""
    model = build(tiny_model(vocab_size=512, init_std=1.0), seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, size=n).tolist() for n in (3, 9, 12, 5, 7, 2, 15, 4)]
    n = 40
    static = generate(model, prompts, GenerateConfig(max_new_tokens=n)).tokens
    engine = Engine(model, max_num_seqs=4, page_size=8, num_pages=64, chunk_size=16)
    served = [o[0].tokens for o in engine.generate(prompts, SamplingParams(max_tokens=n))]
    assert [list(t) for t in static] == [list(t) for t in served]
    for prompt, tokens in zip(prompts[:2], static):
        assert list(greedy_continue(model, prompt, n)) == list(tokens)
    rounded = generate(model, prompts, GenerateConfig(max_new_tokens=n, kv_cache_dtype="bfloat16"))
    assert sum(list(a) != list(b) for a, b in zip(rounded.tokens, served)) >= 3
