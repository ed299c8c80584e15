"""The engine's logit bias, min_tokens and prompt log-probabilities, per request inside one
continuous batch: greedy tokens are the argmax of the biased logits of a direct forward, stop
tokens and stop sequences cannot end a sample before min_tokens, prompt log-probabilities
equal the model's log-softmax at every position (across prefill chunks and with the prompt's
pages already cached), and requests without these fields are unchanged beside them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx
from test_engine_sampling import PROMPTS, WIDTH, _engine

from jaxllm.infer.engine import SamplingParams, runner
from jaxllm.infer.engine.sampling import MAX_LOGIT_BIAS
from jaxllm.model.transformer import build

PLAIN = SamplingParams(max_tokens=8)


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


def _run(engine, requests):
    """Outputs of (prompt, params) requests added together, by request order."""
    ids = [engine.add_request(p, params) for p, params in requests]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step().finished})
    return [outs[i] for i in ids]


def test_logit_bias_moves_greedy_tokens_and_leaves_the_batch_alone(model, next_logits):
    engine = _engine(model)
    plain = [o.tokens for o in _run(engine, [(p, PLAIN) for p in PROMPTS])]
    # the bias against the first greedy token, and toward a token the model does not favour
    bias = {plain[0][0]: -100.0, 7: 5.0, 11: 2.5}
    biased = SamplingParams(max_tokens=8, logit_bias=bias, logprobs=True)
    forced = SamplingParams(max_tokens=8, temperature=1.0, seed=1, logit_bias={9: 100})
    requests = [(PROMPTS[0], biased), (PROMPTS[1], PLAIN), (PROMPTS[2], forced)]
    got, same, all_9 = _run(engine, requests + [(PROMPTS[3], PLAIN)])[:2] + _run(
        engine, [(PROMPTS[2], forced)]
    )
    assert same.tokens == plain[1]
    assert all_9.tokens == [9] * 8
    assert got.tokens[0] != plain[0][0]
    for i, t in enumerate(got.tokens):
        logits_V = next_logits(PROMPTS[0] + got.tokens[:i])
        logp_V = jax.nn.log_softmax(logits_V)
        for k, b in bias.items():
            logits_V[k] += b
        assert t == np.argmax(logits_V)
        np.testing.assert_allclose(got.logprobs[i], logp_V[t], atol=2e-5)  # the model's own


def test_min_tokens_masks_stop_tokens_and_sequences_until_reached(model, next_logits):
    engine = _engine(model)
    (ref,) = [o.tokens for o in _run(engine, [(PROMPTS[0], PLAIN)])]
    stop = SamplingParams(max_tokens=8, stop_tokens=(ref[0], ref[2]))
    assert _run(engine, [(PROMPTS[0], stop)])[0].tokens == []
    held = SamplingParams(max_tokens=8, stop_tokens=(ref[0], ref[2]), min_tokens=3)
    out, beside = _run(engine, [(PROMPTS[0], held), (PROMPTS[1], PLAIN)])
    assert beside.tokens == _run(engine, [(PROMPTS[1], PLAIN)])[0].tokens
    assert len(out.tokens) >= 3 and not {ref[0], ref[2]} & set(out.tokens[:3])
    for i, t in enumerate(out.tokens):
        logits_V = next_logits(PROMPTS[0] + out.tokens[:i])
        if i < 3:
            logits_V[[ref[0], ref[2]]] = -np.inf
        assert t == np.argmax(logits_V)
    # a stop sequence of the first two tokens ends nothing before min_tokens
    seq = SamplingParams(max_tokens=8, stop_sequences=(tuple(ref[:2]),))
    assert _run(engine, [(PROMPTS[0], seq)])[0].tokens == []
    late = SamplingParams(max_tokens=8, stop_sequences=(tuple(ref[:2]),), min_tokens=3)
    assert _run(engine, [(PROMPTS[0], late)])[0].tokens == ref  # the pair comes only first
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 100.5})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={10**6: 1.0}))


def test_prompt_logprobs_equal_the_models_at_every_position(model, next_logits):
    engine = _engine(model, chunk_size=4)  # the prompt spans chunks
    prompt = PROMPTS[1]
    asked = SamplingParams(max_tokens=3, prompt_logprobs=3, n=2, seed=0)
    for run in range(2):  # the second time its pages are in the prefix cache
        traces = runner.TRACES[0]
        out, beside = _run(engine, [(prompt, asked), (PROMPTS[0], PLAIN)])
        if run:
            assert runner.TRACES[0] == traces  # nothing new compiles
        assert beside.tokens == _run(_engine(model), [(PROMPTS[0], PLAIN)])[0].tokens
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            logp_V = np.asarray(jax.nn.log_softmax(next_logits(prompt[:i])))
            logp, rank, top = lps[i]
            np.testing.assert_allclose(logp, logp_V[prompt[i]], atol=2e-5)
            assert rank == 1 + np.sum(logp_V > logp_V[prompt[i]] + 1e-5)
            assert [t for t, _ in top] == np.argsort(-logp_V, kind="stable")[:3].tolist()
    assert _run(engine, [(prompt, PLAIN)])[0].prompt_logprobs is None
    assert engine.pool.num_used == 0


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(model):
    engine = _engine(model, chunk_size=4)  # the prompt spans chunks
    prompt = PROMPTS[1]
    (scored,) = _run(engine, [(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))])
    only, beside, bare = _run(
        engine,
        [
            (prompt, SamplingParams(max_tokens=0, prompt_logprobs=2, n=2)),
            (PROMPTS[0], PLAIN),
            (PROMPTS[2], SamplingParams(max_tokens=0)),
        ],
    )
    assert (only.tokens, only.finish_reason, only.logprobs) == ([], "length", None)
    assert only.prompt_logprobs == scored.prompt_logprobs
    assert beside.tokens == _run(_engine(model), [(PROMPTS[0], PLAIN)])[0].tokens
    assert (bare.tokens, bare.finish_reason, bare.prompt_logprobs) == ([], "length", None)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
