"""`jaxllm serve` with images: a server on a tiny Qwen2.5-VL (run in a thread on 127.0.0.1)
answers chat messages holding an image part (data URLs, two at once; a local file under
--allowed-local-media-path) as the cache-free full forward and `jaxllm generate --chat ...
--image` (with a float32 cache, as the server's) do, and refuses a bad image, a remote URL and a file
outside the allowed path with one 400 message each."""

import base64
import concurrent.futures
import json

import httpx
import pytest
from hf_models import run_cli, stderr_of_failure
from test_serve import in_thread
from test_vlm_generate import chat_run  # noqa: F401 (a fixture)

from jaxllm.infer import greedy_continue
from jaxllm.infer.chat import end_of_turn
from jaxllm.infer.vision import image_spec, prompt_example
from jaxllm.serve.cli import build, load

Q = "what is in the picture?"


@pytest.fixture(scope="module")
def server(chat_run):  # noqa: F811
    _, _, tmp = chat_run
    (tmp / "media").mkdir(exist_ok=True)
    (tmp / "media" / "red.png").write_bytes((tmp / "red.png").read_bytes())
    model, tok, stops, bos = load(tmp / "run")
    app, _ = build(
        model, tok, stops, bos, "vl", media=tmp / "media", max_num_seqs=2, page_size=4, chunk_size=8
    )
    with in_thread(app) as url:
        yield url, tmp, (model, tok, stops)


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def ask(url, image_url, text=Q, stream=False):
    parts = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]
    body = {
        "model": "vl",
        "messages": [{"role": "user", "content": parts}],
        "temperature": 0,
        "max_tokens": 6,
        "stream": stream,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=600)


def reference(tmp, name, tok, model, stops) -> str:
    """The reply the cache-free full forward (equal to transformers', tests/test_vlm_engine)
    gives: its 6 greedy tokens up to the first stop, decoded."""
    content = [{"type": "image", "image": str(tmp / name)}, {"type": "text", "text": Q}]
    ids, px = prompt_example(
        [{"role": "user", "content": content}], tok, image_spec(model.cfg.vision)
    )
    new = greedy_continue(model, ids, 6, pixels=px).tolist()
    stop = end_of_turn(tok, sorted(stops)).stop_ids | set(stops)
    cut = next((i for i, t in enumerate(new) if t in stop), len(new))
    return tok.decode(new[:cut]).strip()


@pytest.mark.slow
def test_image_parts_answer_as_the_reference_and_generate_do(server, capsys):
    url, tmp, (model, tok, stops) = server
    want = [reference(tmp, n, tok, model, stops) for n in ("red.png", "blue.png")]
    assert want[0] and want[0] != want[1]
    argv = ["generate", tmp / "run", "--chat", Q, "--temperature", "0", "--max-new-tokens", "6"]
    for name, reply in zip(("red.png", "blue.png"), want):  # as `jaxllm generate --image` does
        assert run_cli(*argv, "--kv-cache-dtype", "float32", "--image", tmp / name) == 0
        assert capsys.readouterr().out.strip() == reply
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both at once
        rs = list(pool.map(lambda n: ask(url, data_url(tmp / n)), ("red.png", "blue.png")))
    got = [r.json()["choices"][0]["message"]["content"].strip() for r in rs]
    assert got == want
    local = ask(url, f"file://{tmp / 'media' / 'red.png'}")
    assert local.json()["choices"][0]["message"]["content"].strip() == want[0]
    streamed = ask(url, data_url(tmp / "red.png"), stream=True).text.splitlines()
    chunks = [json.loads(ln[6:]) for ln in streamed if ln.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks).strip() == want[0]


@pytest.mark.parametrize(
    "image_url, message",
    [
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "image"),
        ("https://example.com/cat.png", "data URL"),
        ("{tmp}/red.png", "is not under the allowed media path"),
    ],
    ids=["not_an_image", "remote", "outside_media"],
)
def test_bad_images_answer_one_400(server, image_url, message):
    url, tmp, _ = server
    r = ask(url, image_url.replace("{tmp}", str(tmp)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and "\n" not in err["message"], err
    assert ask(url, data_url(tmp / "red.png")).status_code == 200  # still serving


def test_allowed_media_path_must_be_a_directory(chat_run, capsys):  # noqa: F811
    _, _, tmp = chat_run
    err = stderr_of_failure(capsys, "serve", tmp / "run", "--allowed-local-media-path", tmp / "x")
    assert err.startswith("jaxllm: ") and "not a directory" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
