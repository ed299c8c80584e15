"""Structured outputs through `jaxllm serve`: OpenAI's `response_format` (json_object,
json_schema) with the official client, vLLM's guided_regex / guided_choice / guided_json /
guided_grammar and `structured_outputs`, streamed and not; more than one constraint, an unknown
form or an invalid schema or regex is a 400 naming the field. One server, a random-weight model
over the byte tokenizer: the point is that the constraint holds."""

import json
import re

import httpx
import openai
import pytest
from conftest import tiny_model
from test_engine_structured import REGEX, SCHEMA
from test_serve import KEY, in_thread

from jaxllm.data.tokenizer import ByteTokenizer
from jaxllm.model.transformer import build
from jaxllm.serve.cli import build as build_app

HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url():
    tok = ByteTokenizer()
    model = build(tiny_model(vocab_size=tok.vocab_size, max_seq_len=128), seed=0)
    app, _ = build_app(model, tok, {tok.eos_id}, [], "tiny", api_key=KEY, max_num_seqs=4)
    with in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _body(body):
    return {"model": "tiny", "max_tokens": 40, "temperature": 1.0, "seed": 0, **body}


def _post(url, route, body):
    return httpx.post(url + route, json=_body(body), headers=HEADERS, timeout=120)


def test_response_format_with_the_openai_client(client):
    messages = [{"role": "user", "content": "a color?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(
        model="tiny", messages=messages, response_format=fmt, max_tokens=40, n=2, seed=1
    )
    for choice in reply.choices:
        got = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and set(got) == {"color", "ok"}
        assert got["color"] in ("red", "green") and isinstance(got["ok"], bool)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=60,
        seed=2,
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    if chunks[-1].finish_reason == "stop":  # a random model may nest past 60 tokens
        assert isinstance(json.loads(text), dict)
    plain = client.chat.completions.create(
        model="tiny", messages=messages, response_format={"type": "text"}, max_tokens=3
    )
    assert plain.choices[0].finish_reason == "length"


def test_vllm_guided_fields(url):
    text = {"response_format": {"type": "text"}}  # asks for nothing beside a constraint
    body = {"prompt": "id: ", "guided_regex": REGEX, "n": 3, **text}
    out = _post(url, "/v1/completions", body).json()
    for c in out["choices"]:
        assert re.fullmatch(REGEX, c["text"]) and c["finish_reason"] == "stop"
    choice = {"guided_choice": ["alpha", "beta"], "n": 2}
    out = _post(url, "/v1/completions", {"prompt": "x", **choice}).json()
    assert {c["text"] for c in out["choices"]} <= {"alpha", "beta"}
    body = {"messages": [{"role": "user", "content": "?"}], "guided_json": SCHEMA}
    out = _post(url, "/v1/chat/completions", body).json()
    assert set(json.loads(out["choices"][0]["message"]["content"])) == {"color", "ok"}
    grammar = 'start: "yes" | "no" " way"'
    out = _post(url, "/v1/completions", {"prompt": "x", "guided_grammar": grammar}).json()
    assert out["choices"][0]["text"] in ("yes", "no way")
    newer = {"prompt": "x", "structured_outputs": {"regex": "[ab]{4}"}, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/completions", json=_body(newer), headers=HEADERS, timeout=120
    ) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    text = "".join(json.loads(ln)["choices"][0]["text"] for ln in lines[:-1])
    assert re.fullmatch("[ab]{4}", text)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(url, fields, param):
    r = _post(url, "/v1/completions", {"prompt": "x", **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert param in r.json()["error"]["message"]
