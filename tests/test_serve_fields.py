"""The request fields vLLM users expect, through OpenAI's client: `logit_bias` and `min_tokens`
(streamed or not, beside requests without them), `echo` with the prompt's log-probabilities and
vLLM's `prompt_logprobs`, and chat messages with null assistant content or lists of text
parts; their bad values answer 400 naming the field."""

import concurrent.futures
import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from test_serve import KEY, serving

HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(small_run):
    yield from serving(small_run)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _complete(client, **kw):
    return client.completions.create(model="tiny", prompt="The", **kw)


def _greedy(client, **kw):
    return _complete(client, temperature=0, **kw)


def _streamed(client, **kw) -> tuple[str, str]:
    """(text, finish reason) of a streamed completion."""
    chunks = list(_complete(client, stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def _post(url, route, body):
    return httpx.post(url + route, json={"model": "tiny", **body}, headers=HEADERS, timeout=120)


def test_logit_bias_forces_a_token_beside_plain_requests(server, client):
    url, tok = server[0], server[2]
    x = tok.encode("a").tolist()[-1]
    forced = dict(max_tokens=5, logit_bias={str(x): 100}, extra_body={"ignore_eos": True})
    plain = _greedy(client, max_tokens=8).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # one continuous batch
        runs = [pool.submit(_greedy, client, max_tokens=8)]
        runs += [pool.submit(_greedy, client, **forced) for _ in range(2)]
        texts = [r.result().choices[0].text for r in runs]
    assert texts == [plain] + [tok.decode([x] * 5)] * 2
    assert _streamed(client, temperature=0, **forced)[0] == tok.decode([x] * 5)
    for bad in ({"a": 1}, {"-1": 1}, {"4096": 1}, {str(x): 100.5}, {"1": "high"}):
        r = _post(url, "/v1/completions", {"prompt": "The", "logit_bias": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"].startswith("logit_bias"), (bad, r.text)
    chat = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}
    assert _post(url, "/v1/chat/completions", chat).json()["error"]["param"] == "logit_bias"


def test_min_tokens_holds_stop_tokens_and_stop_strings(server, client):
    url, tok = server[0], server[2]
    x = tok.encode("a").tolist()[-1]
    kw = dict(max_tokens=8, logit_bias={str(x): 100})  # x comes whenever it may
    early = _greedy(client, **kw, extra_body={"stop_token_ids": [x]})
    assert early.choices[0].text == "" and early.usage.completion_tokens == 0
    body = {"stop_token_ids": [x], "min_tokens": 3}
    held = _greedy(client, **kw, extra_body=body)
    assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].text and tok.decode([x]) not in held.choices[0].text
    assert _streamed(client, temperature=0, **kw, extra_body=body) == (
        held.choices[0].text,
        "stop",
    )
    # a stop string inside the first tokens ends nothing until min_tokens; none comes later
    sampled = dict(max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    whole = _complete(client, **sampled, logprobs=0).choices[0]
    at = next(i for i in range(len(whole.text) - 1) if whole.text.count(whole.text[i : i + 2]) == 1)
    stop, ends = whole.text[at : at + 2], np.cumsum([len(t) for t in whole.logprobs.tokens])
    assert _complete(client, **sampled, stop=stop).choices[0].text == whole.text[:at]
    sampled["extra_body"] |= {"min_tokens": int(np.searchsorted(ends, at + 2)) + 2}
    late = _complete(client, **sampled, stop=stop).choices[0]
    assert late.text == whole.text and late.finish_reason == "length"
    assert _streamed(client, **sampled, stop=stop) == (whole.text, "length")
    r = _post(url, "/v1/completions", {"prompt": "The", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


def test_echo_returns_the_prompt_and_its_logprobs_streamed_or_not(server, client):
    url, model, tok, _, bos, _ = server
    text = "The quick brown fox"
    ids = bos + tok.encode(text).tolist()
    n = len(ids)
    kw = dict(prompt=text, max_tokens=4, temperature=0, model="tiny")
    plain = client.completions.create(**kw, logprobs=2).choices[0]
    echo = client.completions.create(**kw, logprobs=2, echo=True).choices[0]
    lp = echo.logprobs
    assert echo.text == text + plain.text
    assert lp.tokens == [tok.decode([t]) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == plain.logprobs.token_logprobs
    logits = model(jnp.asarray([ids])).logits[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    want = [logp[i - 1, ids[i]] for i in range(1, n)]
    np.testing.assert_allclose(lp.token_logprobs[1:n], want, atol=1e-4)
    for i in range(1, n):
        assert 1 <= len(lp.top_logprobs[i]) <= 2
        np.testing.assert_allclose(max(lp.top_logprobs[i].values()), logp[i - 1].max(), atol=1e-4)
    chunks = list(client.completions.create(**kw, logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echo.text
    streamed = [
        v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == lp.token_logprobs
    bare = client.completions.create(**kw, echo=True).choices[0]
    assert bare.text == echo.text and bare.logprobs is None
    # vLLM's prompt_logprobs: the prompt token's own entry (with its rank) and the top ones
    r = _post(url, "/v1/completions", {**kw, "prompt_logprobs": 1}).json()
    pl = r["choices"][0]["prompt_logprobs"]
    assert len(pl) == n and pl[0] is None
    for i in range(1, n):
        own = pl[i][str(ids[i])]
        np.testing.assert_allclose(own["logprob"], want[i - 1], atol=1e-4)
        assert own["rank"] == 1 + int(np.sum(logp[i - 1] > want[i - 1] + 1e-5))
        assert 1 <= len(pl[i]) <= 2 and own["decoded_token"] == tok.decode([ids[i]])
    r = _post(url, "/v1/completions", {**kw, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_null_assistant_content_and_text_parts_are_read(server):
    url = server[0]

    def ids(messages):
        r = _post(url, "/tokenize", {"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    turns.append({"role": "user", "content": "again"})
    empty = [{**m, "content": m["content"] or ""} for m in turns]
    assert ids(turns) == ids(empty)
    r = _post(url, "/v1/chat/completions", {"messages": turns, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]
    assert ids([{"role": "user", "content": parts}]) == ids(
        [{"role": "user", "content": "hi there"}]
    )
    r = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}
    r = _post(url, "/v1/chat/completions", {"messages": [turns[0], call]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls", r.text


def test_max_tokens_0_with_echo_scores_the_prompt_streamed_or_not(server, client):
    url, _, tok, _, bos, _ = server
    text = "The quick brown fox"
    n = len(bos + tok.encode(text).tolist())
    kw = dict(prompt=[text, "A cat"], temperature=0, model="tiny", logprobs=1, echo=True)
    one = client.completions.create(**kw, max_tokens=1)
    only = client.completions.create(**kw, max_tokens=0)
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == one.usage.prompt_tokens
    assert only.choices[0].text == text and only.choices[1].text == "A cat"
    for a, b in zip(only.choices, one.choices):  # the prompt's entries; no token after them
        assert a.finish_reason == "length"
        assert a.logprobs.tokens == b.logprobs.tokens[:-1]
        assert a.logprobs.token_logprobs == b.logprobs.token_logprobs[:-1]
        assert a.logprobs.top_logprobs == b.logprobs.top_logprobs[:-1]
    assert len(only.choices[0].logprobs.tokens) == n
    chunks = list(client.completions.create(**kw, max_tokens=0, stream=True))
    for c in only.choices:
        mine = [x.choices[0] for x in chunks if x.choices[0].index == c.index]
        assert "".join(x.text for x in mine) == c.text and mine[-1].finish_reason == "length"
        lps = [v for x in mine if x.logprobs for v in x.logprobs.token_logprobs]
        assert lps == c.logprobs.token_logprobs
    r = _post(url, "/v1/completions", {"prompt": text, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert _post(url, "/v1/chat/completions", chat).status_code == 400


def test_chat_echo_puts_the_last_assistant_text_before_the_reply(server):
    url = server[0]
    start = [{"role": "user", "content": "hi"}]
    turns = start + [{"role": "assistant", "content": [{"type": "text", "text": "Sure: "}]}]

    def reply(messages, **kw):
        body = {"messages": messages, "max_tokens": 3, "temperature": 0, **kw}
        r = _post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        if not kw.get("stream"):
            return r.json()["choices"][0]["message"]["content"]
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
        return "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events)

    plain = reply(turns)
    assert reply(turns, echo=True) == "Sure: " + plain
    assert reply(turns, echo=True, stream=True) == "Sure: " + plain
    assert reply(start, echo=True) == reply(start)  # the last message is not the assistant's
