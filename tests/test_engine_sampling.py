"""The engine's per-request sampling: penalties against a NumPy re-derivation over a direct
forward of the model, stop sequences cut and held back, top logprobs equal the model's own
log-softmax, and 200 mixed requests compile no more programs than there are query buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from jaxllm.infer.engine import Engine, SamplingParams, runner
from jaxllm.infer.engine.sampling import MAX_TOP_LOGPROBS, held_back, stop_match
from jaxllm.model.transformer import build

RNG = np.random.default_rng(1)
PROMPTS = [RNG.integers(1, 64, size=n).tolist() for n in (5, 12, 3, 9)]
WIDTH = 48  # direct forwards are right-padded to one length: one compile


@pytest.fixture(scope="module")
def model():
    return build(tiny_model(init_std=0.5, max_seq_len=64), seed=0)  # peaked logits


@pytest.fixture(scope="module")
def next_logits(model):
    """The model's logits after `tokens` (a direct forward of the whole sequence, no cache)."""
    fwd = nnx.jit(lambda m, t: m(t).logits)

    def run(tokens):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(tokens)] = tokens
        return np.asarray(fwd(model, jnp.asarray(padded)))[0, len(tokens) - 1].astype(np.float64)

    return run


def _engine(model, **kw):
    return Engine(model, **(dict(max_num_seqs=4, page_size=8, num_pages=40, chunk_size=16) | kw))


def _penalized(logits_V, prompt, out, p: SamplingParams):
    """vLLM's order: repetition over prompt and output, then frequency and presence over the
    output."""
    logits_V = logits_V.copy()
    seen = sorted(set(prompt) | set(out))
    pos = logits_V[seen] > 0
    logits_V[seen] = np.where(pos, logits_V[seen] / p.repetition_penalty, logits_V[seen])
    logits_V[seen] = np.where(~pos, logits_V[seen] * p.repetition_penalty, logits_V[seen])
    counts_V = np.bincount(out, minlength=len(logits_V)) if out else np.zeros(len(logits_V))
    return logits_V - p.frequency_penalty * counts_V - p.presence_penalty * (counts_V > 0)


@pytest.mark.parametrize(
    "penalty",
    [
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.8, presence_penalty=-0.3),
    ],
)
def test_greedy_with_penalties_takes_the_argmax_of_the_penalized_logits(
    model, next_logits, penalty
):
    p = SamplingParams(max_tokens=8, **penalty)
    engine = _engine(model)
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=8))
    # the penalized requests share a batch with unpenalized ones, which must stay unchanged
    ids = [engine.add_request(q, p) for q in PROMPTS] + [
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8))
    ]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.tokens for o in engine.step().finished})
    assert outs[ids[-1]] == plain[0][0].tokens
    changed = 0
    for prompt, rid, ref in zip(PROMPTS, ids, plain):
        got = outs[rid]
        for i, t in enumerate(got):
            want = np.argmax(_penalized(next_logits(prompt + got[:i]), prompt, got[:i], p))
            assert t == want, (prompt, got, i)
        changed += got != ref[0].tokens
    assert changed  # the penalty made a difference somewhere


def test_top_logprobs_equal_the_models_log_softmax(model, next_logits):
    prompt = PROMPTS[1]
    for params in (
        SamplingParams(max_tokens=5, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS),
        SamplingParams(max_tokens=5, temperature=1.3, seed=4, top_logprobs=3, top_p=0.9),
    ):
        (out,) = _engine(model).generate([prompt], params)[0]
        assert len(out.logprobs) == len(out.top_logprobs) == len(out.tokens) == 5
        for i, t in enumerate(out.tokens):
            logp_V = jax.nn.log_softmax(next_logits(prompt + out.tokens[:i]))
            order = np.argsort(-logp_V, kind="stable")[: params.top_logprobs]
            got_ids = [tok for tok, _ in out.top_logprobs[i]]
            assert got_ids == order.tolist()
            np.testing.assert_allclose(
                [v for _, v in out.top_logprobs[i]], logp_V[order], rtol=0, atol=2e-5
            )
            np.testing.assert_allclose(out.logprobs[i], logp_V[t], rtol=0, atol=2e-5)
    # without logprobs, none are returned
    (plain,) = _engine(model).generate([prompt], SamplingParams(max_tokens=2))[0]
    assert plain.logprobs is None and plain.top_logprobs is None


def _shown_and_outputs(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    shown, outs = [], []
    while engine.has_unfinished():
        r = engine.step()
        shown += [t for i, _, t in r.new_tokens if i == rid]
        outs += r.finished
    return shown, outs[0]


def test_stop_sequences_cut_the_output_and_are_held_back_until_known(model):
    prompt = PROMPTS[0]
    (ref,) = _engine(model).generate([prompt], SamplingParams(max_tokens=10))[0]
    ref = ref.tokens
    stop = tuple(ref[3:6])
    engine = _engine(model)
    shown, out = _shown_and_outputs(
        engine, prompt, SamplingParams(max_tokens=10, stop_sequences=(stop,))
    )
    assert out.tokens == shown == ref[:3] and out.finish_reason == "stop"
    kept = SamplingParams(max_tokens=10, stop_sequences=[[99, 98], list(stop)], include_stop=True)
    shown, out = _shown_and_outputs(engine, prompt, kept)
    assert out.tokens == shown == ref[:6] and out.finish_reason == "stop"
    # a stop sequence that begins like the output but never completes holds nothing back
    never = SamplingParams(max_tokens=10, stop_sequences=((ref[0], ref[1], 1000),))
    shown, out = _shown_and_outputs(engine, prompt, never)
    assert out.tokens == shown == ref and out.finish_reason == "length"
    assert engine.pool.num_used == 0
    p = SamplingParams(stop_sequences=((1, 2, 3), (2, 3, 4)))
    assert held_back([5, 1, 2], p) == 2 and held_back([5, 2, 3], p) == 2
    assert held_back([5, 2], p) == 1 and held_back([5, 6], p) == 0
    assert stop_match([9, 2, 3, 4], p) == 3 and stop_match([1, 2], p) == 0
    with pytest.raises(ValueError):
        SamplingParams(stop_sequences=((),))
    with pytest.raises(ValueError):
        SamplingParams(top_logprobs=MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0)
    for bad in ({"temperature": float("inf")}, {"presence_penalty": float("nan")}):
        with pytest.raises(ValueError, match="finite"):
            SamplingParams(**bad)
    assert SamplingParams(top_k=10**30).top_k == 2**31 - 1  # every token, in int32 rows


def test_compiles_stay_within_the_buckets_over_200_mixed_requests(model):
    engine = _engine(model)  # the other tests' shapes: in a module run, nothing new compiles
    rng = np.random.default_rng(2)
    before = runner.TRACES[0]
    lengths, samples = rng.integers(1, 30, size=200), 0
    for i, n in enumerate(lengths):
        sampled = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 5)),
            temperature=float(rng.uniform(0.5, 1.5)) if sampled else 0.0,
            top_k=int(rng.integers(0, 10)),
            top_p=float(rng.uniform(0.5, 1.0)),
            min_p=float(rng.uniform(0, 0.2)),
            repetition_penalty=float(rng.choice([1.0, 1.3])),
            presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, 0.2])),
            stop_sequences=((int(rng.integers(1, 64)), int(rng.integers(1, 64))),),
            seed=i,
            n=int(rng.integers(1, 3)),
            logprobs=bool(rng.random() < 0.5),
            top_logprobs=int(rng.integers(0, 6)),
        )
        engine.add_request(rng.integers(1, 64, size=n).tolist(), params)
        samples += params.n
    finished = 0
    while engine.has_unfinished():
        finished += len(engine.step().finished)
    traces = runner.TRACES[0] - before  # one per (Q, table width) bucket pair met
    assert engine.query_buckets == (1, 2, 4, 8, 16) and engine.page_buckets == (1, 2, 4, 8)
    assert traces <= len(engine.query_buckets) * len(engine.page_buckets) and traces <= 12
    assert finished == samples and engine.pool.num_used == 0


def test_one_sample_aborts_alone_and_new_logprobs_follow_new_tokens(model):
    engine = _engine(model)
    params = SamplingParams(max_tokens=5, temperature=1.0, n=2, seed=3, top_logprobs=2)
    rid = engine.add_request(PROMPTS[1], params)
    seen, outs = [], []
    while engine.has_unfinished():
        r = engine.step()
        if not seen and r.new_tokens:
            assert engine.abort(rid, 1) and not engine.abort(rid, 1)
        assert len(r.new_logprobs) == len(r.new_tokens)
        seen += [(i, t, lp, top) for (_, i, t), (lp, top) in zip(r.new_tokens, r.new_logprobs)]
        outs += r.finished
    (out,) = outs
    assert out.index == 0 and engine.pool.num_used == 0 and not engine.abort(rid)
    assert [t for i, t, _, _ in seen if i == 0] == out.tokens
    assert [lp for i, _, lp, _ in seen if i == 0] == out.logprobs
    assert [top for i, _, _, top in seen if i == 0] == out.top_logprobs


def test_a_vocabulary_smaller_than_the_top_logprobs_width_samples():
    """Top log-probabilities are as many as the vocabulary holds when it has fewer than
    MAX_TOP_LOGPROBS tokens; greedy tokens are the most likely of them."""
    small = build(tiny_model(vocab_size=12, num_layers=1, max_seq_len=32), seed=0)
    params = SamplingParams(max_tokens=3, top_logprobs=MAX_TOP_LOGPROBS)
    (out,) = _engine(small, num_pages=12).generate([[1, 2, 3]], params)[0]
    assert len(out.tokens) == 3
    for token, top in zip(out.tokens, out.top_logprobs):
        assert len(top) == 12 and top[0][0] == token
