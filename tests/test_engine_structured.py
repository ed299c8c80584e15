"""Structured outputs in the engine: with a random-weight model every guided sample matches its
regex, JSON schema or choice fully and ends with reason "stop", with the byte tokenizer and a
Hugging Face tokenizer.json; a request without a constraint in the same batch keeps its tokens
and log-probabilities exactly; preemption keeps the matcher's state; a guided batch compiles one
more program per bucket, once; on a mesh they sample as on one device; invalid constraints are
refused before anything is queued."""

import json
import re
import sys

import jax
import pytest
from conftest import tiny_model

from jaxllm import sharding
from jaxllm.config import MeshConfig
from jaxllm.data.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from jaxllm.infer.engine import Engine, SamplingParams, Structured, runner
from jaxllm.model.transformer import build

BYTES = ByteTokenizer()
EOS = (BYTES.eos_id,)
PROMPT = list(b"the answer: ")
REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model():
    return build(tiny_model(vocab_size=BYTES.vocab_size, max_seq_len=96), seed=0)


def _engine(model, tokenizer=BYTES, **kw):
    kw = dict(max_num_seqs=4, page_size=8, num_pages=48, chunk_size=16) | kw
    return Engine(model, tokenizer=tokenizer, **kw)


def _guided(structured, **kw):
    kw = dict(max_tokens=40, temperature=1.0, seed=3, stop_tokens=EOS) | kw
    return SamplingParams(structured=structured, **kw)


def _run(engine, requests):
    ids = [engine.add_request(p, params) for p, params in requests]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step().finished:
            outs.setdefault(o.request_id, []).append(o)
    return [sorted(outs[i], key=lambda o: o.index) for i in ids]


def test_regex_choice_and_schema_hold_beside_an_unguided_request(model):
    engine = _engine(model)
    plain = SamplingParams(max_tokens=12, logprobs=True)
    (alone,) = _run(engine, [(PROMPT, plain)])
    (cached,) = _run(engine, [(PROMPT, plain)])  # its first page from the prefix cache
    traces = runner.TRACES[0]
    requests = [
        (PROMPT, _guided(Structured(regex=REGEX), n=2)),
        (PROMPT, plain),
        (PROMPT, _guided({"choice": ["yes", "no", "maybe so"]}, n=2)),
        (PROMPT, _guided({"json": SCHEMA})),
    ]
    regex, beside, choice, schema = _run(engine, requests)
    assert [(o.tokens, o.logprobs) for o in beside] == [(o.tokens, o.logprobs) for o in alone]
    for o in regex:
        assert re.fullmatch(REGEX, BYTES.decode(o.tokens)) and o.finish_reason == "stop"
    assert {BYTES.decode(o.tokens) for o in choice} <= {"yes", "no", "maybe so"}
    got = json.loads(BYTES.decode(schema[0].tokens))
    assert schema[0].finish_reason == "stop" and set(got) == {"color", "ok"}
    assert got["color"] in ("red", "green") and isinstance(got["ok"], bool)
    # the guided program compiled once per bucket: the same requests again compile nothing
    compiled = runner.TRACES[0] - traces
    again = _run(engine, requests)
    assert runner.TRACES[0] - traces == compiled
    first = (regex, beside, choice, schema)
    assert [[o.tokens for o in r] for r in again] == [[o.tokens for o in r] for r in first]
    (after,) = _run(engine, [(PROMPT, plain)])  # unguided steps run their programs of before
    assert runner.TRACES[0] - traces == compiled and after[0].logprobs == cached[0].logprobs


def test_json_object_and_stop_only_when_the_matcher_accepts(model):
    engine = _engine(model)
    (obj,) = _run(engine, [(PROMPT, _guided({"json_object": True}, max_tokens=60, seed=1))])
    if obj[0].finish_reason == "stop":  # a random model may nest deeper than 60 tokens
        assert isinstance(json.loads(BYTES.decode(obj[0].tokens)), dict)
    # an EOS-biased request still cannot end before the regex is complete
    biased = _guided({"regex": "a{5}b*"}, logit_bias={EOS[0]: 100.0}, include_stop=True)
    (out,) = _run(engine, [(PROMPT, biased)])
    assert out[0].tokens == list(b"aaaaa") + list(EOS) and out[0].finish_reason == "stop"


@pytest.mark.slow
def test_preemption_keeps_the_matchers_state(model):
    long = r"[a-z]{16}-[0-9]{3}"  # 20 tokens: four samples outgrow the pool
    requests = [
        (PROMPT[:4] + [i], _guided({"regex": long}, seed=i, max_tokens=24)) for i in range(4)
    ]
    calm = _run(_engine(model), requests)
    for swap in ("recompute", "host"):
        engine = _engine(model, page_size=4, num_pages=12, chunk_size=8, swap=swap)
        outs = _run(engine, requests)
        assert engine.num_preemptions > 0
        assert [r[0].tokens for r in outs] == [r[0].tokens for r in calm]
    assert all(re.fullmatch(long, BYTES.decode(r[0].tokens)) for r in calm)


def test_a_hugging_face_tokenizer_is_guided_too(tmp_path):
    corpus = [f"order {i:03d}-ab shipped, value {i * 7}\n" for i in range(200)]
    tok = HFTokenizer(train_bpe(iter(corpus), 300, tmp_path))
    model = build(tiny_model(vocab_size=320, max_seq_len=64), seed=1)
    engine = _engine(model, tokenizer=tok)
    prompt = tok.encode("order ").tolist()
    params = _guided({"regex": REGEX}, stop_tokens=(tok.eos_id,), n=3)
    (outs,) = _run(engine, [(prompt, params)])
    for o in outs:
        assert all(t < tok.vocab_size for t in o.tokens)  # never the model's extra ids
        assert re.fullmatch(REGEX, tok.decode(o.tokens)) and o.finish_reason == "stop"


def test_invalid_constraints_are_refused_before_queueing(model, monkeypatch):
    engine = _engine(model)
    bad = [
        ({"regex": "[0-9"}, "structured regex: .*regex"),
        ({"json": {"type": "nonsense"}}, "structured json: .*nonsense"),
        ({"json": "{not json"}, "structured json"),
        ({"grammar": "start: undefined_rule"}, "structured grammar"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(PROMPT, _guided(spec))
    assert engine.num_waiting == 0 and not engine.has_unfinished()
    for spec in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"pattern": "a"}):
        with pytest.raises(ValueError, match="structured"):
            SamplingParams(structured=spec)
    with pytest.raises(ValueError, match="tokenizer"):
        _engine(model, tokenizer=None).add_request(PROMPT, _guided({"regex": "a"}))
    monkeypatch.setitem(sys.modules, "llguidance", None)  # not installed
    with pytest.raises(ValueError, match="pip install"):
        engine.add_request(PROMPT, _guided({"regex": "a"}))


@pytest.mark.slow
def test_guided_samples_on_a_mesh_equal_one_devices(model):
    degrees = MeshConfig(data=2, tensor=2)
    mesh = sharding.make_mesh(degrees, jax.devices()[:4])
    params = _guided({"regex": REGEX}, n=3)
    (on_mesh,) = _run(_engine(model, mesh=mesh, mesh_config=degrees), [(PROMPT, params)])
    (alone,) = _run(_engine(model), [(PROMPT, params)])
    assert [o.tokens for o in on_mesh] == [o.tokens for o in alone]
    assert all(re.fullmatch(REGEX, BYTES.decode(o.tokens)) for o in on_mesh)
