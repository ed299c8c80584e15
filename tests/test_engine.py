"""The inference engine: continuous batching over a page pool equals generating each request
alone; chunked prefill, prefix sharing and preemption leave outputs unchanged; pages all come
back; compiles are bounded by the query buckets."""

import dataclasses

import numpy as np
import pytest
from conftest import tiny_model

from jaxllm.config import GenerateConfig
from jaxllm.infer import generate
from jaxllm.infer.engine import Engine, SamplingParams, runner
from jaxllm.infer.engine.precompile import compile_buckets
from jaxllm.model.transformer import build

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(1, 64, size=n).tolist() for n in (3, 11, 1, 20, 7, 33, 5, 16, 2, 9)]


@pytest.fixture(scope="module")
def model():
    return build(tiny_model(init_std=0.5, max_seq_len=64), seed=0)  # peaked logits


@pytest.fixture(scope="module")
def alone(model):
    """The first n greedy tokens of `generate` run on one prompt alone (12 made once per
    prompt, then cut: greedy decoding's first n tokens do not depend on how many follow, and
    one max_new_tokens keeps the compiles few)."""
    memo = {}

    def run(prompt, n):
        if tuple(prompt) not in memo:
            gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=12)
            memo[tuple(prompt)] = generate(model, [prompt], gen).tokens[0]
        return memo[tuple(prompt)][:n]

    return run


def _engine(model, **kw):
    kw = dict(max_num_seqs=4, page_size=8, num_pages=48, chunk_size=16) | kw
    return Engine(model, **kw)


def _run_staggered(engine, prompts, params_of):
    """Adds the prompts over the first steps (two per step) and runs to the end."""
    pending, outs, ids = list(enumerate(prompts)), {}, {}
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                ids[engine.add_request(p, params_of(i))] = i
        for o in engine.step().finished:
            outs[ids[o.request_id]] = o
    return [outs[i] for i in range(len(prompts))]


def test_continuous_batching_equals_generate_alone_and_returns_every_page(model, alone):
    engine = _engine(model)
    free = engine.num_free_pages
    lengths = [4 + i % 5 for i in range(len(PROMPTS))]
    outs = _run_staggered(engine, PROMPTS, lambda i: SamplingParams(max_tokens=lengths[i]))
    for p, n, o in zip(PROMPTS, lengths, outs):
        assert o.tokens == alone(p, n)
        assert o.finish_reason == "length"
    assert engine.num_free_pages == free == 47
    assert engine.pool.num_used == 0


def test_stop_tokens_end_a_sequence_and_free_its_slot(model, alone):
    engine = _engine(model, max_num_seqs=2)
    ref = alone(PROMPTS[1], 6)
    stop = ref[2]
    (out,) = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=6, stop_tokens=(stop,)))[0:1]
    assert out[0].tokens == ref[: ref.index(stop)] and out[0].finish_reason == "stop"
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_compiles_are_bounded_by_the_query_buckets(model):
    engine = _engine(model, chunk_size=8)
    before = runner.TRACES[0]
    prompts = [RNG.integers(1, 64, size=n).tolist() for n in RNG.integers(1, 30, size=30)]
    engine.generate(prompts, SamplingParams(max_tokens=3))
    traces = runner.TRACES[0] - before  # one per (Q, table width) bucket pair met
    assert engine.query_buckets == (1, 2, 4, 8) and engine.page_buckets == (1, 2, 4, 8)
    assert traces <= len(engine.query_buckets) * len(engine.page_buckets) and traces <= 8
    assert engine.pool.num_used == 0


def test_precompiled_buckets_serve_without_compiling_and_equal_generate_alone(model, alone):
    engine = _engine(model, max_num_seqs=3, chunk_size=2)  # shapes no other test here compiles
    assert compile_buckets(engine) == 8  # Q in 1, 2 x table width in 1, 2, 4, 8 pages
    before = runner.TRACES[0]
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=5))
    assert runner.TRACES[0] == before and engine.pool.num_used == 0
    assert [o[0].tokens for o in outs] == [alone(p, 5) for p in PROMPTS]
    # the prompt log-probabilities programs (echo with logprobs): 8 more, then none met
    assert compile_buckets(engine, sampling=False, prompt_logprobs=True) == 8
    before = runner.TRACES[0]
    scored = engine.generate(PROMPTS, SamplingParams(max_tokens=5, prompt_logprobs=1))
    assert runner.TRACES[0] == before and engine.pool.num_used == 0
    assert [o[0].tokens for o in scored] == [alone(p, 5) for p in PROMPTS]
    assert all(len(o[0].prompt_logprobs) == len(p) for o, p in zip(scored, PROMPTS))


def test_default_pages_hold_whole_quantization_groups(model):
    """Without `page_size`, an int4 / int2 engine's pages are the least multiple of 16 tokens and
    its group (a 16-token page would be refused); other caches keep 16."""
    for dtype, group, want in [("int4", 32, 32), ("int2", 24, 48), ("int8", 32, 16)]:
        assert Engine(model, kv_cache_dtype=dtype, kv_group=group).page_size == want


def test_int8_pages_decode_each_request_as_alone(model):
    # narrow block tables alone, wider ones beside the 33-token prompt: the same tokens
    params = SamplingParams(max_tokens=8)
    batch = _engine(model, kv_cache_dtype="int8").generate(PROMPTS, params)
    engine = _engine(model, kv_cache_dtype="int8")
    for i in (0, 3, 8):
        assert engine.generate([PROMPTS[i]], params)[0][0].tokens == batch[i][0].tokens


def test_chunked_prefill_interleaves_with_decoding(model, alone):
    engine = _engine(model, chunk_size=4)
    short = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12))
    first = engine.step().new_tokens  # the short prompt is prefilled; it decodes from now on
    long_ = engine.add_request(PROMPTS[5], SamplingParams(max_tokens=4))  # 33 tokens: 9 chunks
    got = {short: [t for _, _, t in first], long_: []}
    steps = 0
    while engine.has_unfinished():
        r = engine.step()
        steps += 1
        for rid, _, t in r.new_tokens:
            got[rid].append(t)
        if steps <= 8:  # the long prompt is still being prefilled, the short one decodes
            assert [rid for rid, _, _ in r.new_tokens] == [short]
    assert got[long_] == alone(PROMPTS[5], 4)
    assert got[short] == alone(PROMPTS[0], 12)


def test_prefix_pages_are_shared_and_reference_counted(model, alone):
    engine = _engine(model, page_size=4, chunk_size=32)
    system = PROMPTS[3][:16]  # four full pages
    first = engine.add_request(system + [5, 6], SamplingParams(max_tokens=3))
    engine.step()  # prefilled: its four full pages are registered
    assert engine.pool.num_used == 5
    others = [engine.add_request(system + [7 + i], SamplingParams(max_tokens=3)) for i in range(3)]
    engine.step()
    assert engine.pool.num_used == 5 + 3  # each newcomer adds only its own last page
    for page in range(1, 5):
        assert engine.pool.refs(page) == 4
    outs = {}
    while engine.has_unfinished():
        for o in engine.step().finished:
            outs[o.request_id] = o.tokens
    assert outs[first] == alone(system + [5, 6], 3)
    for i, rid in enumerate(others):
        assert outs[rid] == alone(system + [7 + i], 3)
    assert engine.pool.num_used == 0


def test_n_samples_share_the_prompt_pages(model):
    engine = _engine(model, page_size=4, max_num_seqs=4)
    prompt = PROMPTS[5][:17]  # four full pages and one token
    params = SamplingParams(max_tokens=3, temperature=1.0, n=4, seed=3, logprobs=True)
    rid = engine.add_request(prompt, params)
    peak = 0
    outs = []
    while engine.has_unfinished():
        outs += engine.step().finished
        peak = max(peak, engine.pool.num_used)
    assert peak <= 4 + 4 * 2  # shared prompt pages + each sample's own last page(s)
    assert [o.index for o in sorted(outs, key=lambda o: o.index)] == [0, 1, 2, 3]
    assert all(o.request_id == rid and len(o.logprobs) == 3 for o in outs)
    assert len({tuple(o.tokens) for o in outs}) > 1  # different seeds per sample
    # the same seed gives the same samples, shared pages or not
    again = _engine(model, page_size=4, prefix_sharing=False).generate([prompt], params)[0]
    assert [o.tokens for o in again] == [o.tokens for o in sorted(outs, key=lambda o: o.index)]


def test_preemption_under_page_pressure_leaves_outputs_unchanged(model, alone):
    engine = _engine(model, page_size=4, num_pages=12, max_num_seqs=4, chunk_size=8)
    prompts = [PROMPTS[i] for i in (1, 3, 4, 7)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert engine.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o[0].tokens == alone(p, 10)
    assert engine.pool.num_used == 0


def test_sampling_params_filter_and_draw_reproducibly(model):
    prompt = PROMPTS[4]
    sampled = SamplingParams(max_tokens=6, temperature=1.5, top_k=5, top_p=0.9, seed=7)
    a = _engine(model).generate([prompt, prompt], sampled)
    b = _engine(model, max_num_seqs=1).generate([prompt], sampled)
    assert a[0][0].tokens == a[1][0].tokens == b[0][0].tokens  # seed, not slot or batch
    top1 = dataclasses.replace(sampled, top_k=1)
    greedy = SamplingParams(max_tokens=6)
    assert _engine(model).generate([prompt], top1)[0][0].tokens == (
        _engine(model).generate([prompt], greedy)[0][0].tokens
    )
    near_greedy = dataclasses.replace(sampled, min_p=1.0)
    assert _engine(model).generate([prompt], near_greedy)[0][0].tokens == (
        _engine(model).generate([prompt], greedy)[0][0].tokens
    )


def test_abort_frees_a_requests_pages_and_the_rest_run_on(model, alone):
    engine = _engine(model)
    keep = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6))
    drop = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=6, n=2))
    engine.step()
    assert engine.num_running == 2 and engine.abort(drop) and not engine.abort(drop)
    outs = []
    while engine.has_unfinished():
        outs += engine.step().finished
    assert [(o.request_id, o.tokens) for o in outs] == [(keep, alone(PROMPTS[1], 6))]
    assert engine.pool.num_used == 0 and engine.num_waiting == 0
