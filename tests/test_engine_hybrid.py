"""The engine serves hybrid models (Gated DeltaNet layers beside full attention,
`model.layer_pattern`): each slot keeps the linear layers' state beside the pages, zeroed when
a new sequence takes the slot and carried across prefill chunks, so greedy outputs of
concurrent requests equal `generate` run on each prompt alone, through slot reuse, chunked
prefill, preemption (recompute or host swap) and n samples."""

import dataclasses

import numpy as np
import pytest

from jaxllm.config import GenerateConfig, LinearAttentionConfig, ModelConfig
from jaxllm.infer import generate
from jaxllm.infer.engine import Engine, SamplingParams
from jaxllm.model import build

LINEAR = LinearAttentionConfig(
    kind="gated_deltanet", num_k_heads=1, num_v_heads=3, k_head_dim=8, v_head_dim=6, chunk_size=8
)
HYBRID = ModelConfig(
    vocab_size=64,
    d_model=48,
    num_layers=4,
    num_heads=3,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    dtype="float32",
    param_dtype="float32",
    max_seq_len=64,
    init_std=0.1,
    layer_pattern=("linear", "linear", "linear", "full"),
    linear_attention=LINEAR,
    attn_output_gate=True,
    norm_offset=1.0,
    rope=dataclasses.replace(ModelConfig().rope, partial_factor=0.25),
)
RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(1, 64, size=n).tolist() for n in (11, 3, 17, 6, 1, 9)]


@pytest.fixture(scope="module")
def model():
    HYBRID.validate()
    return build(HYBRID, seed=3)


@pytest.fixture(scope="module")
def alone(model):
    """The first n greedy tokens of `generate` on one prompt alone (10 made once, then cut)."""
    memo = {}

    def run(prompt, n):
        if tuple(prompt) not in memo:
            gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=10, temperature=0.0)
            memo[tuple(prompt)] = generate(model, [prompt], gen).tokens[0]
        return memo[tuple(prompt)][:n]

    return run


def _engine(model, **kw):
    kw = dict(max_num_seqs=2, page_size=4, num_pages=40, chunk_size=4) | kw
    return Engine(model, **kw)


@pytest.mark.slow
def test_concurrent_requests_with_slot_reuse_equal_generate_alone(model, alone):
    """Six prompts of 1..17 tokens through two slots, added over the first steps: prompts
    longer than a chunk are prefilled over several steps beside another slot's decoding, and
    every request after the second starts in a slot a finished one left (with its state)."""
    engine = _engine(model)
    lengths = [10, 4, 7, 10, 3, 6]
    pending, outs, ids, slot_users = list(enumerate(PROMPTS)), {}, {}, {}
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            ids[engine.add_request(p, SamplingParams(max_tokens=lengths[i]))] = i
        for o in engine.step().finished:
            outs[ids[o.request_id]] = o
        for slot, seq in enumerate(engine._slots):
            if seq is not None:
                slot_users.setdefault(slot, set()).add(seq.request_id)
    assert max(len(users) for users in slot_users.values()) >= 3  # slots were reused
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        assert outs[i].tokens == alone(p, n), i
        assert outs[i].finish_reason == "length"
    assert engine.pool.num_used == 0 and engine.num_free_pages == 39


def test_a_slot_state_is_zeroed_for_the_next_request(model, alone):
    """One slot, the same prompt twice in a row after another: the second run starts from a
    zero state, not the one the first left."""
    engine = _engine(model, max_num_seqs=1)
    first = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8))[0][0]
    again = engine.generate([PROMPTS[3], PROMPTS[0]], SamplingParams(max_tokens=8))
    assert first.tokens == again[1][0].tokens == alone(PROMPTS[0], 8)
    assert again[0][0].tokens == alone(PROMPTS[3], 8)
    assert bool(np.any(np.asarray(engine._linear.state)))  # the state is kept, not recomputed


def test_chunk_size_and_batch_do_not_change_the_tokens(model, alone):
    """One token per step (the recurrent form) and 16 per step (the chunked form from the
    carried state, padding past a short prompt) give the same tokens."""
    for chunk in (1, 16):
        engine = _engine(model, max_num_seqs=4, chunk_size=chunk)
        outs = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=6))
        for p, o in zip(PROMPTS[:4], outs):
            assert o[0].tokens == alone(p, 6), chunk


@pytest.mark.parametrize("mode", ["recompute", "host"])
def test_preempted_sequences_resume_with_their_state(model, alone, mode):
    engine = _engine(model, max_num_seqs=3, num_pages=12, swap=mode)
    prompts = [PROMPTS[i] for i in (0, 2, 3)]
    before = engine.num_scheduled_tokens
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert engine.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o[0].tokens == alone(p, 10)
    fed = engine.num_scheduled_tokens - before
    minimum = sum(len(p) + 9 for p in prompts)  # the last sampled token is never fed
    assert (fed == minimum) if mode == "host" else (fed > minimum)
    assert engine.pool.num_used == 0


def test_prefix_pages_are_not_shared_and_n_samples_each_run_from_zero(model, alone):
    """The state sums every token before, not one page: a hybrid engine shares no prefix
    pages, so two requests with one system prompt and a request's n samples each feed their
    whole prompt."""
    engine = _engine(model, max_num_seqs=4)
    assert not engine.prefix_sharing
    system = PROMPTS[2][:8]
    prompts = [system + [5, 6], system + [7]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, n=2))
    for p, o in zip(prompts, outs):
        assert [s.tokens for s in o] == [alone(p, 5)] * 2
    assert engine.prefix_queries == engine.prefix_hits == 0
    assert engine.num_scheduled_tokens == 2 * sum(len(p) + 4 for p in prompts)


def test_the_step_keeps_one_cache_of_the_full_layers(model):
    engine = _engine(model, max_num_seqs=3)
    assert engine._kv.k.shape[0] == 1  # one full-attention layer of four
    n, slots = engine._linear.state.shape[:2]
    assert (n, slots) == (3, 3)


@pytest.mark.slow  # ~17 s; the slot bookkeeping is the same without a mesh
def test_on_a_mesh_the_state_splits_over_the_slots_and_equals_generate_alone(model, alone):
    from jaxllm import sharding
    from jaxllm.config import MeshConfig

    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4))
    engine = _engine(model, mesh=mesh)
    assert len(engine._slots) == 8  # rounded up to the data axes' degree
    assert tuple(engine._linear.state.sharding.spec[:2]) == (None, ("data", "fsdp", "expert"))
    outs = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=6))
    for p, o in zip(PROMPTS[:4], outs):
        assert o[0].tokens == alone(p, 6)


@pytest.mark.slow
def test_openai_server_serves_a_hybrid_model_as_generate(model):
    """`jaxllm serve`'s app over a hybrid model (byte tokenizer), its step buckets compiled
    first on idle slots (which must leave every state zero): a greedy completion equals
    `generate` with the same stop token."""
    import threading

    import openai
    import uvicorn
    from test_serve import _free_port, _wait

    from jaxllm.data.tokenizer import ByteTokenizer
    from jaxllm.serve.cli import build as build_app

    big = build(dataclasses.replace(HYBRID, vocab_size=264), seed=5)
    tok = ByteTokenizer()
    kw = dict(max_num_seqs=2, page_size=16, chunk_size=2, precompile=True)
    app, worker = build_app(big, tok, {tok.eos_id}, [tok.bos_id], "hybrid", **kw)
    assert not np.any(np.asarray(worker.engine._linear.state))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(
            model="hybrid", prompt="Hi there", max_tokens=8, temperature=0
        )
        ids = [tok.bos_id] + tok.encode("Hi there").tolist()
        gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=8, temperature=0.0)
        ref = generate(big, [ids], gen, stop_tokens=[tok.eos_id]).tokens[0]
        assert r.choices[0].text == tok.decode(ref)
        assert r.usage.completion_tokens == len(ref)
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
