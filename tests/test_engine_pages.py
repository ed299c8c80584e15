"""The engine's page management: the LRU prefix cache (released prefix pages stay findable until
the pool needs them; hit-rate counts; newcomers wait for a prefix being prefilled), swapping
preempted sequences to host memory, and int4 / int2 pages. Outputs equal `generate` run on each
prompt alone (int4 / int2: the engine run on each prompt alone)."""

import argparse

import numpy as np
import pytest
from conftest import tiny_model
from fastapi.testclient import TestClient

from jaxllm.config import ConfigError, GenerateConfig
from jaxllm.infer import generate
from jaxllm.infer.engine import Engine, SamplingParams, swap
from jaxllm.infer.engine.pages import PagePool, block_hashes
from jaxllm.model.transformer import build
from jaxllm.serve.app import Served, make_app
from jaxllm.serve.cli import add_serve_parser, engine_overrides
from jaxllm.serve.worker import EngineWorker

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(1, 64, size=n).tolist() for n in (3, 11, 1, 20, 7, 33, 5, 16, 2, 9)]


@pytest.fixture(scope="module")
def model():
    return build(tiny_model(init_std=0.5, max_seq_len=64), seed=0)  # peaked logits


@pytest.fixture(scope="module")
def alone(model):
    """The first n greedy tokens of `generate` on one prompt alone (12 made once, then cut)."""
    memo = {}

    def run(prompt, n):
        if tuple(prompt) not in memo:
            gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=12)
            memo[tuple(prompt)] = generate(model, [prompt], gen).tokens[0]
        return memo[tuple(prompt)][:n]

    return run


def _engine(model, **kw):  # the shapes of test_engine's preemption test: its compiles are reused
    return Engine(model, **dict(max_num_seqs=4, page_size=4, num_pages=12, chunk_size=8) | kw)


def test_released_prefix_pages_stay_cached_until_the_pool_needs_them():
    pool = PagePool(5)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    h = block_hashes([1, 2, 3, 4], 2, 2)
    pool.register(h[0], a)
    pool.register(h[1], b)
    assert pool.lookup(block_hashes([1, 2, 9, 9], 2, 2)) == [a]  # the chain breaks at block 2
    assert pool.refs(a) == 2 and pool.num_free == 1
    pool.release([a, b, c])
    pool.release([a])
    # nobody holds a, b, c; a and b keep their blocks (cached), c is free
    assert pool.num_free == 4 and pool.num_cached == 2 and pool.num_used == 0
    assert pool.lookup(h) == [a, b] and pool.refs(a) == pool.refs(b) == 1  # revived
    assert pool.num_free == 2
    pool.release([a, b])  # b is let go first, so it is the first evicted
    assert {pool.allocate(), pool.allocate()} == {4, c}  # never-registered pages first
    assert pool.num_evictions == 0
    assert pool.allocate() == b and pool.num_evictions == 1
    assert pool.lookup(h) == [a] and pool.refs(a) == 1  # b's block is forgotten
    assert pool.allocate() is None and pool.num_free == 0


def test_a_system_prompt_used_by_sequential_requests_is_prefilled_once(model, alone):
    engine = _engine(model, num_pages=16)
    system = PROMPTS[3][:16]  # four full pages
    for i in range(3):  # one after another: no request holds the prompt when the next comes
        before = engine.num_scheduled_tokens
        out = engine.generate([system + [7 + i]], SamplingParams(max_tokens=3))[0][0]
        assert out.tokens == alone(system + [7 + i], 3)
        fed = engine.num_scheduled_tokens - before
        assert fed == (17 if i == 0 else 1) + 2  # then only the new token and two decodes
        assert engine.pool.num_used == 0 and engine.pool.num_cached >= 4
    assert (engine.prefix_queries, engine.prefix_hits) == (3 * 17, 2 * 16)
    assert engine.prefix_cache_hit_rate == pytest.approx(32 / 51)
    served = Served(EngineWorker(engine), None, "tiny", (), None, [])  # /metrics needs no more
    text = TestClient(make_app(served)).get("/metrics").text
    metrics = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln[:1] != "#"}
    assert metrics["jaxllm_prefix_cache_queries_total"] == 51
    assert metrics["jaxllm_prefix_cache_hits_total"] == 32
    assert metrics["jaxllm_prefix_cache_hit_rate"] == pytest.approx(32 / 51)


def test_requests_arriving_together_wait_for_the_system_prompt_being_prefilled(model, alone):
    engine = _engine(model, num_pages=16)
    system = PROMPTS[3][:16]
    prompts = [system + [7 + i] for i in range(3)]  # all three join in the same step
    outs = engine.generate(prompts, SamplingParams(max_tokens=3))
    for p, o in zip(prompts, outs):
        assert o[0].tokens == alone(p, 3)
    assert engine.num_scheduled_tokens == 17 + 2 * 1 + 3 * 2  # the prompt once, then 1 token
    assert (engine.prefix_hits, engine.prefix_queries) == (2 * 16, 3 * 17)


def test_eviction_under_page_pressure_keeps_outputs_equal_to_generate_alone(model, alone):
    engine = _engine(model)
    prompts = [PROMPTS[i] for i in (1, 3, 4, 7)]
    for order in (prompts, prompts[::-1]):  # the last ones first: their blocks are cached
        outs = engine.generate(order, SamplingParams(max_tokens=6))
        for p, o in zip(order, outs):
            assert o[0].tokens == alone(p, 6)
    assert engine.pool.num_evictions > 0 and engine.prefix_hits > 0
    assert engine.pool.num_used == 0


def test_swap_round_trips_pages_through_host_memory(model):
    engine = _engine(model)
    engine.generate([PROMPTS[5]], SamplingParams(max_tokens=2))  # fills pages 1..9
    saved = swap.save(engine._kv, [3, 1, 2], slot=0)
    assert saved.pages["k"].shape[:2] == (model.cfg.num_layers, 3) and not saved.residual
    kv = swap.restore(engine._kv, saved, [10, 11], skip=1, slot=1)
    for name in ("k", "v"):
        arr = np.asarray(getattr(kv, name))
        np.testing.assert_array_equal(arr[:, [10, 11]], arr[:, [1, 2]])


@pytest.mark.parametrize("mode", ["host", "recompute"])
def test_preempted_sequences_swap_to_host_and_back_without_recompute(model, alone, mode):
    engine = _engine(model, swap=mode)
    prompts = [PROMPTS[i] for i in (1, 3, 4, 7)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert engine.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o[0].tokens == alone(p, 10)
    # every token is fed once (the last sampled one never), less what the prefix cache had
    once = sum(len(p) + 10 - 1 for p in prompts) - engine.prefix_hits
    assert (engine.num_scheduled_tokens == once) == (mode == "host")
    assert engine.pool.num_used == 0


def test_swap_mode_is_checked_and_serve_takes_it_as_a_flag_or_an_engine_override(model):
    with pytest.raises(ValueError, match="swap="):
        _engine(model, swap="disk")
    for bad in ({"page_size": 0}, {"max_num_seqs": 0}):  # not a ZeroDivisionError, nor a hang
        with pytest.raises(ValueError, match="at least 1"):
            _engine(model, **bad)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", "run", "--swap", "host"])
    assert ns.swap == "host" and parser.parse_args(["serve", "run"]).swap == "recompute"
    rest = engine_overrides(ns, ["engine.swap=recompute", "engine.page_size=8", "model.x=1"])
    assert (ns.swap, ns.page_size, rest) == ("recompute", 8, ["model.x=1"])
    with pytest.raises(ConfigError, match="engine.pages"):
        engine_overrides(ns, ["engine.pages=8"])


def _kivi_engine(model, kind, **kw):
    kw = dict(max_num_seqs=4, page_size=8, num_pages=40, chunk_size=16, kv_group=8) | kw
    return Engine(model, kv_cache_dtype=kind, **kw)


@pytest.mark.parametrize("kind", ["int4", "int2"])
def test_int4_and_int2_pages_decode_each_request_as_it_decodes_alone(model, kind):
    system = PROMPTS[5][:24]  # three full pages, shared by the last two prompts
    prompts = [PROMPTS[i] for i in (1, 3, 5, 0, 7)] + [system + [3, 4], system + [9]]
    params = SamplingParams(max_tokens=9)
    engine, pending, outs = _kivi_engine(model, kind), list(enumerate(prompts)), {}
    ids = {}
    while pending or engine.has_unfinished():  # two join per step: prefill mixes with decode
        for _ in range(2):
            if pending:
                i, p = pending.pop(0)
                ids[engine.add_request(p, params)] = i
        for o in engine.step().finished:
            outs[ids[o.request_id]] = o.tokens
    assert engine.prefix_hits >= 2 * 24 and engine.pool.num_used == 0
    for i, p in enumerate(prompts):
        assert outs[i] == _kivi_engine(model, kind).generate([p], params)[0][0].tokens


@pytest.mark.parametrize("mode", ["host", "recompute"])
def test_int4_pages_preempted_and_resumed_decode_as_alone(model, mode):
    prompts = [PROMPTS[i] for i in (1, 3, 4, 7)]
    params = SamplingParams(max_tokens=10)
    engine = _kivi_engine(model, "int4", num_pages=9, swap=mode)
    outs = engine.generate(prompts, params)
    assert engine.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o[0].tokens == _kivi_engine(model, "int4").generate([p], params)[0][0].tokens
    once = sum(len(p) + 10 - 1 for p in prompts) - engine.prefix_hits
    assert (engine.num_scheduled_tokens == once) == (mode == "host")


def test_int4_pages_need_whole_groups_per_page(model):
    with pytest.raises(ValueError, match="multiple of its quantization group"):
        _kivi_engine(model, "int4", page_size=12)
