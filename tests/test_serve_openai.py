"""`jaxllm serve` as an OpenAI user meets it: `stream_options.include_usage`, prompts as lists of
token ids, a missing max_tokens filling the context, fields the server does not honour refused
with 400 (never ignored), bad messages, token ids and JSON answered in OpenAI's error shape; and
the command's own mistakes (a port in use, an unknown flag value) one `jaxllm:` line, exit 2.
The server runs in a thread on 127.0.0.1 over a pool of 8 pages of 8 tokens: a 64-token
context."""

import json
import socket

import httpx
import openai
import pytest
from test_serve import KEY, in_thread

import jaxllm
from jaxllm.cli import main
from jaxllm.serve.cli import build, load

CONTEXT = 64
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(small_run):
    model, tok, stops, bos = load(small_run)
    app, worker = build(
        model, tok, stops, bos, "tiny", api_key=KEY, max_num_seqs=4, page_size=8, num_pages=9
    )
    with in_thread(app) as url:
        yield url, tok, bos, worker


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _events(url, route, body) -> list:
    with httpx.stream("POST", url + route, json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_options_include_usage_ends_with_the_usage(server, client, chat):
    url = server[0]
    common = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    if chat:
        route, body = (
            "/v1/chat/completions",
            {**common, "messages": [{"role": "user", "content": "hi"}]},
        )
        whole = client.chat.completions.create(**body)
    else:
        route, body = "/v1/completions", {**common, "prompt": "ab", "n": 2}
        whole = client.completions.create(**body)
    events = _events(
        url, route, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole.usage.model_dump(exclude_none=True)
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert all("usage" not in c for c in _events(url, route, {**body, "stream": True}))
    every = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's: counts so far
    *chunks, last = _events(url, route, {**body, "stream": True, "stream_options": every})
    assert last["usage"] == whole.usage.model_dump(exclude_none=True)
    done = {}
    for c in chunks:
        (choice,) = c["choices"]
        assert c["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
        assert c["usage"]["completion_tokens"] >= done.get(choice["index"], 0)
        done[choice["index"]] = c["usage"]["completion_tokens"]
    assert sum(done.values()) == whole.usage.completion_tokens
    alone = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    r = httpx.post(url + route, json={**body, **alone}, headers=HEADERS, timeout=60)
    assert r.status_code == 400 and "include_usage" in r.json()["error"]["message"]
    stream = client.completions.create(  # the official client reads it as a user's program does
        model="tiny", prompt="ab", max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    assert [c.usage.completion_tokens for c in stream if c.usage] == [3]


@pytest.mark.parametrize(
    "field",
    [
        {"suffix": "}"},
        {"best_of": 2},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"tool_choice": "auto"},
        {"stream_options": {"include_usage": True}},  # without stream
    ],
    ids=lambda f: next(iter(f)),
)
def test_fields_not_honoured_are_400_never_ignored(server, field):
    url = server[0]
    chat = not {"suffix", "best_of"} & set(field)
    route = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "tiny", "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "ab"}
    r = httpx.post(url + route, json={**body, **field}, headers=HEADERS, timeout=60)
    name = next(iter(field))
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    # the values that ask for nothing more are served
    fine = {"best_of": 1, "response_format": {"type": "text"}, "tool_choice": "none", "user": "u"}
    extra = {k: v for k, v in fine.items() if (k in ("user", "best_of")) != chat}
    assert (
        httpx.post(url + route, json={**body, **extra}, headers=HEADERS, timeout=60).status_code
        == 200
    )


def test_prompts_of_token_ids_and_ids_outside_the_vocabulary(server, client):
    url, tok, bos, _ = server
    ids = [bos + tok.encode(p).tolist() for p in ("one", "two two")]
    both = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0)
        for p in ("one", "two two")
    ]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == sum(map(len, ids))
    for bad in ([], [[]], [-1], [320], [[5, 6], [320]]):
        body = {"model": "tiny", "prompt": bad, "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


def test_a_missing_max_tokens_fills_the_context(server, client):
    url, tok, bos, _ = server
    near = [5] * (CONTEXT - 3)  # OpenAI's default of 16 would not fit: the rest does
    r = client.completions.create(model="tiny", prompt=near, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    short = client.completions.create(model="tiny", prompt="ab", extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="tiny", messages=msgs, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.total_tokens == CONTEXT  # a chat reply may take the whole rest
    body = {"model": "tiny", "prompt": [5] * CONTEXT}
    r = httpx.post(url + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 400 and "no room" in r.json()["error"]["message"]
    for route, body in [  # a prompt and max_tokens past the context: the field named
        ("completions", {"prompt": [5] * 10, "max_tokens": CONTEXT - 9}),
        ("chat/completions", {"messages": msgs, "max_completion_tokens": CONTEXT}),
    ]:
        r = httpx.post(
            f"{url}/v1/{route}", json={"model": "tiny", **body}, headers=HEADERS, timeout=60
        )
        err = r.json()["error"]
        assert r.status_code == 400 and f"context is {CONTEXT} tokens" in err["message"], r.text
        assert err["param"] == next(k for k in body if k.startswith("max_"))
    fits = {"model": "tiny", "prompt": [5] * 10, "max_tokens": CONTEXT - 10, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=fits, headers=HEADERS, timeout=120)
    assert r.json()["usage"]["total_tokens"] == CONTEXT


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user"}]],
    ids=["empty", "bad-role", "no-role", "no-content"],
)
def test_bad_messages_are_400(server, client, messages):
    body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages"), r.text
    assert client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    ).choices


def test_invalid_json_and_unknown_routes_answer_in_openai_shape(server):
    url = server[0]
    headers = {**HEADERS, "Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content="{not json", headers=headers, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and "not valid JSON" in err["message"] and err["param"] is None
    for content, kind in (
        (b"model=tiny&prompt=x", "application/x-www-form-urlencoded"),
        (b'["tiny"]', "application/json"),
    ):
        r = httpx.post(
            url + "/v1/completions",
            content=content,
            headers={**HEADERS, "Content-Type": kind},
            timeout=60,
        )
        assert r.status_code == 400 and "a JSON object" in r.json()["error"]["message"], r.text
    r = httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": 5}, headers=HEADERS, timeout=60
    )
    assert (
        r.json()["error"]["message"]
        == "prompt: Input should be a valid string or a valid list (got 5)"
    )
    r = httpx.get(url + "/v1/nothing", headers=HEADERS, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/completions", headers=HEADERS, timeout=60)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_failed_step_fails_its_requests_and_the_server_keeps_serving(server, client):
    url, worker = server[0], server[3]
    step = worker.engine.step

    def broken():
        worker.engine.step = step  # one step fails, as a bug in the engine would
        raise RuntimeError("boom")

    worker.engine.step = broken
    with pytest.raises(openai.InternalServerError, match="boom"):  # not a hang
        client.with_options(timeout=60).completions.create(model="tiny", prompt="ab", max_tokens=3)
    worker.engine.step = broken
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert "boom" in lines[-2] and lines[-1] == "data: [DONE]"
    assert worker.engine.pool.num_used == 0
    add = worker.engine.add_request

    def failing(*args, **kw):  # taking a request fails for a reason of the engine's own
        worker.engine.add_request = add
        raise TypeError("bust")

    worker.engine.add_request = failing
    with pytest.raises(openai.InternalServerError, match="bust"):
        client.with_options(timeout=60).completions.create(model="tiny", prompt="ab", max_tokens=3)
    assert worker._thread.is_alive()
    # a top_k past int32 (every token) is served, not a failed step
    r = client.completions.create(
        model="tiny", prompt="ab", max_tokens=3, extra_body={"top_k": 10**30}
    )
    assert r.usage.completion_tokens == 3


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxllm: "), err
    return err[0]


def test_serve_command_mistakes_are_one_line_exit_2(small_run, capsys):
    with socket.socket() as held:  # a port another server holds
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", str(small_run), "--port", str(port)]) == 2
        assert "give a free --port" in _one_line(capsys)
        for flag in ("--api-key", "--served-model-name"):  # an empty key would serve with none
            assert main(["serve", str(small_run), "--port", str(port), f"{flag}= "]) == 2
            assert f"{flag} is empty" in _one_line(capsys)
    assert main(["serve", str(small_run), "--port", "70000"]) == 2
    assert "1 to 65535" in _one_line(capsys)
    for bad in (["--kv-cache-dtype", "fp8"], ["--page-size", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(small_run), *bad])
        assert e.value.code == 2 and bad[1] in _one_line(capsys)


def test_retrieve_the_served_model_and_404_for_another(server, client):
    url = server[0]
    card = client.models.retrieve("tiny")
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "jaxllm")
    assert (
        card.model_extra["max_model_len"] == CONTEXT == client.models.list().data[0].max_model_len
    )
    for other in ("other", "org/tiny"):  # an id with a slash is one id, not another route
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.models.retrieve(other)
        r = httpx.get(f"{url}/v1/models/{other}", headers=HEADERS, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found", r.text
        assert err["type"] == "not_found_error" and err["param"] == "model"
    assert (
        httpx.get(url + "/v1/models/tiny", timeout=60).status_code == 401
    )  # the key is needed there too
    assert httpx.get(url + "/version", timeout=60).json() == {"version": jaxllm.__version__}


STRICT = [
    ("completions", {"stream": "yes"}),
    ("completions", {"stream": 1}),
    ("completions", {"n": "2"}),
    ("completions", {"n": 2.5}),
    ("completions", {"n": True}),
    ("completions", {"logprobs": "x"}),
    ("completions", {"logprobs": True}),
    ("completions", {"temperature": "hot"}),
    ("completions", {"temperature": "0.5"}),
    ("completions", {"top_p": True}),
    ("completions", {"echo": 1}),
    ("completions", {"max_tokens": "3"}),
    ("completions", {"seed": 1.5}),
    ("completions", {"stop": 5}),
    ("completions", {"stop_token_ids": [True]}),
    ("completions", {"ignore_eos": "false"}),
    ("completions", {"prompt": [True, 5]}),
    ("completions", {"user": 5}),
    ("chat", {"logprobs": "true"}),
    ("chat", {"logprobs": 1}),
    ("chat", {"top_logprobs": "2", "logprobs": True}),
    ("chat", {"max_completion_tokens": False}),
    ("chat", {"presence_penalty": "1"}),
    ("chat", {"messages": [{"role": "user", "content": 5}]}),
    ("completions", {"min_tokens": 4}),  # fields the server does not know
    ("completions", {"max_token": 4}),
    ("chat", {"guided_regex": 5}),
    ("chat", {"store": True}),
]


@pytest.mark.parametrize("route, field", STRICT, ids=[f"{r}-{f}" for r, f in STRICT])
def test_wrong_typed_and_unknown_fields_are_400_naming_the_field(server, route, field):
    """As OpenAI's API: strings are not read as booleans or numbers, nor booleans as numbers."""
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": "ab"}
    body = {"model": "tiny", "max_tokens": 2, **body, **field}
    r = httpx.post(server[0] + path, json=body, headers=HEADERS, timeout=60)
    name = next(iter(field))
    err = r.json()["error"]
    assert r.status_code == 400, r.text
    assert err["param"].split(".")[0] == name and err["message"].startswith(name), err


def test_whole_numbers_written_as_floats_nulls_and_no_op_values_are_served(server, client):
    r = client.completions.create(
        model="tiny",
        prompt="ab",
        temperature=0,
        extra_body={"n": 2.0, "max_tokens": 3.0, "top_k": -1.0, "ignore_eos": True},
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6
    msgs = [{"role": "user", "content": "hi"}]
    extra = {"store": False, "skip_special_tokens": True, "service_tier": "auto"}
    chat = client.chat.completions.create(
        model="tiny", messages=msgs, max_completion_tokens=2, temperature=1, extra_body=extra
    )
    assert chat.usage.completion_tokens <= 2
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "stop", "seed", "logprobs"])
    nulls |= dict.fromkeys(["presence_penalty", "echo", "user", "logit_bias", "stream_options"])
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 2, **nulls}
    r = httpx.post(server[0] + "/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text  # nulls: defaults


def test_several_prompts_stream_as_choices_prompt_times_n_plus_sample(server, client):
    url = server[0]
    body = {"model": "tiny", "prompt": ["one", "two two"], "max_tokens": 4, "n": 2}
    body |= {"temperature": 1.0, "seed": 3, "logprobs": 0}
    whole = client.completions.create(**body)
    events = _events(
        url, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, last = events
    texts, logprobs, reasons = {}, {}, {}
    for c in chunks:
        (choice,) = c["choices"]
        i = choice["index"]
        texts[i] = texts.get(i, "") + choice["text"]
        logprobs[i] = logprobs.get(i, []) + choice["logprobs"]["token_logprobs"]
        reasons[i] = choice["finish_reason"] or reasons.get(i)
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    for c in whole.choices:
        assert logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-6)
        assert reasons[c.index] == c.finish_reason
    assert last["usage"] == whole.usage.model_dump(exclude_none=True)
