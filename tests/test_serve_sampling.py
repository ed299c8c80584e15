"""`jaxllm serve`'s sampling fields through OpenAI's client: stop strings cut the text where
they begin, even across tokens and while streaming; logprobs and top logprobs (completions and
chat, streamed too); penalties, top_k and min_p reach the engine as its own SamplingParams."""

import httpx
import openai
import pytest
from test_serve import KEY, serving

from jaxllm.infer.engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def server(small_run):
    yield from serving(small_run)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _greedy(client, **kw):
    return client.completions.create(model="tiny", prompt="The", temperature=0, **kw)


def test_a_stop_string_across_tokens_cuts_the_text_streamed_or_not(server, client):
    tok = server[2]
    whole = _greedy(client, max_tokens=16, logprobs=0).choices[0]
    pieces = whole.logprobs.tokens
    # a boundary between two tokens with text on both sides: the stop spans it
    k = next(i for i in range(1, len(pieces)) if pieces[i - 1] and pieces[i])
    at = sum(map(len, pieces[:k]))
    stop = whole.text[at - 1 : at + 1]
    assert len(tok.encode(stop).tolist()) >= 1
    want = whole.text[: whole.text.index(stop)]
    cut = _greedy(client, max_tokens=16, stop=[stop, "\x00never"]).choices[0]
    assert cut.text == want and cut.finish_reason == "stop"
    chunks = list(_greedy(client, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop string that never comes changes nothing
    same = _greedy(client, max_tokens=16, stop=["\x00never"]).choices[0]
    assert same.text == whole.text and same.finish_reason == whole.finish_reason


def test_include_stop_str_in_output_keeps_the_stop_streamed_or_not(client):
    kw = dict(model="tiny", prompt="The", max_tokens=12, temperature=1.0, seed=7)
    kw["extra_body"] = {"ignore_eos": True}
    text = client.completions.create(**kw).choices[0].text
    printable = [i for i in range(2, len(text) - 1) if text[i : i + 2].isascii()]
    stop = next(text[i : i + 2] for i in printable if text[i : i + 2].isprintable())
    want = text[: text.index(stop)] + stop  # vLLM's extra: the stop stays in the text
    kw["extra_body"] |= {"include_stop_str_in_output": True}
    r = client.completions.create(**kw, stop=[stop, "\x00never"]).choices[0]
    assert r.text == want and r.finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    kw["extra_body"] = {"ignore_eos": True}
    assert client.completions.create(**kw, stop=stop).choices[0].text == want.removesuffix(stop)


def test_a_stop_string_ends_one_of_n_samples_and_the_others_run_on(client):
    kw = dict(model="tiny", prompt="The", max_tokens=12, temperature=1.0, n=3, seed=11)
    free = sorted(client.completions.create(**kw).choices, key=lambda c: c.index)
    texts = [c.text for c in free]
    stop = next(
        texts[0][i : i + 2]
        for i in range(len(texts[0]) - 1)
        if all(texts[0][i : i + 2] not in t for t in texts[1:])
    )
    cut = sorted(client.completions.create(**kw, stop=stop).choices, key=lambda c: c.index)
    assert cut[0].text == texts[0][: texts[0].index(stop)] and cut[0].finish_reason == "stop"
    assert [c.text for c in cut[1:]] == texts[1:]
    assert [c.finish_reason for c in cut[1:]] == [c.finish_reason for c in free[1:]]


def test_logprobs_and_top_logprobs_streamed_or_not(client):
    r = _greedy(client, max_tokens=6, logprobs=3).choices[0]
    lp = r.logprobs
    assert "".join(lp.tokens) == r.text and len(lp.token_logprobs) == len(lp.tokens)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # tokens that decode alike share a key
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the most likely
    parts = list(_greedy(client, max_tokens=6, logprobs=3, stream=True))
    streamed = [
        v for c in parts if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4
    ).choices[0]
    content = chat.logprobs.content
    assert "".join(c.token for c in content) == chat.message.content
    for c in content:
        values = [t.logprob for t in c.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert c.logprob == pytest.approx(values[0], abs=1e-6)
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    got = [
        c.logprob for ch in stream if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content
    ]
    assert got == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_penalties_top_k_and_min_p_reach_the_engine(server, client):
    url, model, tok, stops, bos, _ = server
    fields = dict(presence_penalty=1.5, frequency_penalty=0.7, top_p=0.9, seed=5)
    extra = dict(repetition_penalty=1.6, top_k=8, min_p=0.05)
    r = client.completions.create(
        model="tiny", prompt="The", max_tokens=12, temperature=0.8, extra_body=extra, **fields
    )
    params = SamplingParams(max_tokens=12, temperature=0.8, stop_tokens=tuple(sorted(stops)))
    params = SamplingParams(**{**params.__dict__, **fields, **extra})
    engine = Engine(model, max_num_seqs=2, page_size=8, num_pages=40, chunk_size=16)
    (ref,) = engine.generate([bos + tok.encode("The").tolist()], params)[0]
    assert r.choices[0].text == tok.decode(ref.tokens)
    plain = _greedy(client, max_tokens=12).choices[0].text
    penalized = _greedy(client, max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].text != plain


@pytest.mark.parametrize(
    "route, body",
    [
        ("completions", {"prompt": "x", "logprobs": 6}),
        ("completions", {"prompt": "x", "presence_penalty": 2.5}),
        ("completions", {"prompt": "x", "repetition_penalty": 0}),
        ("completions", {"prompt": "x", "min_p": 1.5}),
        ("completions", {"prompt": "x", "top_k": -2}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ],
)
def test_out_of_range_sampling_fields_answer_400(server, route, body):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        f"{server[0]}/v1/{route}", json={"model": "tiny", **body}, headers=headers, timeout=60
    )
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenize_and_detokenize_as_the_routes_count(server, client):
    url, tok, bos = server[0], server[2], server[4]
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "Hello"}, timeout=60).json()
    used = _greedy(client, max_tokens=1).usage.prompt_tokens
    assert r["tokens"] == bos + tok.encode("Hello").tolist() and r["count"] == len(r["tokens"])
    assert httpx.post(url + "/tokenize", json={"prompt": "The"}, timeout=60).json()["count"] == used
    assert r["max_model_len"] == client.models.retrieve("tiny").model_extra["max_model_len"]
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    counted = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=60).json()["count"]
    assert counted == chat.usage.prompt_tokens
    text = httpx.post(
        url + "/detokenize", json={"tokens": r["tokens"][len(bos) :]}, timeout=60
    ).json()
    assert text == {"prompt": "Hello"}
    for route, body in [
        ("tokenize", {"prompt": "a", "messages": msgs}),  # one of them
        ("tokenize", {}),
        ("tokenize", {"prompt": 5}),
        ("tokenize", {"prompt": "a", "add_special_tokens": True}),  # a field it does not read
        ("tokenize", {"prompt": "a", "model": "other"}),
        ("detokenize", {"tokens": [1, 10**6]}),
        ("detokenize", {"tokens": ["1"]}),
    ]:
        r = httpx.post(f"{url}/{route}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"], (body, r.text)
