"""`jaxllm serve`: one in-thread server on a small run, used through OpenAI's own client:
greedy completions equal `generate`, chat, streaming, n > 1, concurrent clients, 400s that leave
the server serving, 401 with an API key, /metrics and /health, a dropped stream frees its
pages; and the command itself (a subprocess) exits 0 on SIGTERM."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from jaxllm.config import GenerateConfig
from jaxllm.infer.generate import generate
from jaxllm.serve.cli import build, load

KEY = "sk-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc=None, timeout=300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def serving(small_run):
    """(url, model, tokenizer, stops, bos, worker) of a server on small_run in a thread, until
    the generator is closed."""
    model, tok, stops, bos = load(small_run)
    app, worker = build(
        model, tok, stops, bos, "tiny", api_key=KEY, max_num_seqs=4, page_size=8, chunk_size=16
    )
    with in_thread(app) as url:
        yield url, model, tok, stops, bos, worker


@contextlib.contextmanager
def in_thread(app):
    """The URL of `app` served by uvicorn on a free 127.0.0.1 port in a thread, until exit."""
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    _wait(url)
    try:
        yield url
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(small_run):
    yield from serving(small_run)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _metrics(url) -> dict:
    text = httpx.get(url + "/metrics", timeout=60).text  # a loaded machine answers slowly
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln[:1] != "#"}


def test_greedy_completion_equals_generate(server, client):
    url, model, tok, stops, bos, _ = server
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
    ids = bos + tok.encode("Hello").tolist()
    gen = GenerateConfig(kv_cache_dtype="float32", max_new_tokens=8, temperature=0.0)
    ref = generate(model, [ids], gen, stop_tokens=sorted(stops)).tokens[0]
    assert r.choices[0].text == tok.decode(ref)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streaming_n_and_logprobs(client):
    whole = client.completions.create(model="tiny", prompt="ab", max_tokens=6, temperature=0)
    parts = client.completions.create(
        model="tiny", prompt="ab", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text
    r = client.completions.create(
        model="tiny", prompt="ab", max_tokens=5, temperature=1.0, n=3, seed=1, logprobs=0
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        lp = c.logprobs.token_logprobs
        assert len(lp) == len(c.logprobs.tokens) and all(v <= 0 for v in lp)


def test_chat_and_chat_streaming(client):
    msgs = [{"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == r.choices[0].message.content


def test_concurrent_clients_get_their_own_answers(client):
    prompts = ["one", "two two", "three three three", "four", "five five", "six"]
    alone = {
        p: client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts[:3]
    }
    got = {}

    def ask(p):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
        got[p] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {p: got[p] for p in alone} == alone and len(got) == len(prompts)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "x", "max_tokens": -1},
        {"model": "tiny", "prompt": "x", "max_tokens": "many"},
        {"model": "tiny", "prompt": 5},
        {"model": "other", "prompt": "x"},
        {"model": "tiny", "prompt": "x" * 5000},
        "{not json",
    ],
)
def test_bad_requests_answer_400_and_the_server_keeps_serving(server, client, body):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    if isinstance(body, str):
        headers["Content-Type"] = "application/json"
        r = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=60)
    else:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_api_key_is_required(server):
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server[0] + "/v1/models", timeout=60).status_code == 401


def test_health_metrics_and_a_dropped_stream_frees_its_pages(server):
    url, worker = server[0], server[5]
    assert httpx.get(url + "/health", timeout=60).json() == {"status": "ok"}
    aborted, abort = [], worker.engine.abort  # the disconnect must reach the engine
    worker.engine.abort = lambda rid: (aborted.append(rid), abort(rid))[1]
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 40, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(  # the first token may wait on a compile
        "POST", url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived: leave mid-stream
    t0 = time.time()
    while _metrics(url)["jaxllm_kv_pages_used"] != 0 and time.time() - t0 < 30:
        time.sleep(0.1)
    worker.engine.abort = abort
    m = _metrics(url)
    assert aborted and m["jaxllm_kv_pages_used"] == 0 and m["jaxllm_requests_running"] == 0
    assert m["jaxllm_generation_tokens_total"] > 0 and "jaxllm_requests_waiting" in m


def test_sigterm_exits_0_and_a_refused_page_size_is_one_line(small_run):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxllm", "serve", str(small_run)]
    # int4 pages hold whole quantization groups (32 tokens): a page of 8 is refused
    bad_flags = ["--kv-cache-dtype", "int4", "--page-size", "8"]
    bad = subprocess.run([*cmd, *bad_flags], env=env, capture_output=True)
    assert bad.returncode == 2 and bad.stderr.decode().strip().startswith("jaxllm:")
    assert "group" in bad.stderr.decode() and len(bad.stderr.decode().strip().splitlines()) == 1
    port = _free_port()
    proc = subprocess.Popen(  # int2 with the default page size: the group's
        [*cmd, "--port", str(port), "--max-num-seqs", "2", "--kv-cache-dtype", "int2"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url, proc)
        body = {"model": small_run.name, "prompt": "ab", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
