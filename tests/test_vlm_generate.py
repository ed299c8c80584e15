"""Generation with images: a converted tiny Qwen2.5-VL continues prompts with one and with two
images greedily as transformers' `generate` does (prefill with pixels and M-RoPE positions,
decode at position + rope delta), as the cache-free full forward does, and in a batch mixed with
text prompts; `jaxllm generate --chat ... --image PATH` answers from the run's tokenizer and
template; an image on a text-only run and a file that is no image are refused in one line."""

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as hf
from hf_models import run_cli, save_hf, stderr_of_failure
from PIL import Image
from test_qwen2_5_vl import IMAGE, ONE, TEXT, TWO, VISION, pixels, prompt, qwen2_5_vl
from test_vision_chat import QWEN2_VL, VT, tokenizer

import jaxllm
from jaxllm import sharding
from jaxllm.config import GenerateConfig
from jaxllm.config.sections import MeshConfig
from jaxllm.data.images import Pixels
from jaxllm.infer import generate, greedy_continue
from jaxllm.infer.vision import image_spec, prompt_example, vision_inputs

GEN = GenerateConfig(max_new_tokens=12, temperature=0.0, kv_cache_dtype="float32")


def perturbed(model, scale=0.3):
    """Larger weights than the logits tests' (0.05): greedy tokens then vary from step to step,
    so a wrong position after the prompt shows in the tokens."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def hf_generate(model, ids, px, grids, image_id=IMAGE, new=12):
    tokens = np.asarray([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            pixel_values=torch.from_numpy(px),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=torch.tensor(tokens == image_id, dtype=torch.int32),  # 3-D ids
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, tokens.shape[1] :].tolist()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_generate")
    torch.manual_seed(5)
    model = perturbed(qwen2_5_vl())
    src = save_hf(model, tmp / "hf")
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    return model, jaxllm.load_model(tmp / "run"), tmp / "run"


@pytest.mark.parametrize("grids", [ONE, TWO], ids=["one_image", "two_images"])
def test_greedy_tokens_equal_transformers_and_the_full_forward(imported, grids):
    model, ours, _ = imported
    ids, px = prompt(grids)[0].tolist(), pixels(grids)
    want = hf_generate(model, ids, px, grids)
    assert len(set(want)) > 4  # varied tokens: positions matter at every step
    image = Pixels(px, np.asarray(grids))
    assert generate(ours, [ids], GEN, images=[image]).tokens[0] == want
    assert greedy_continue(ours, ids, 12, pixels=image).tolist() == want
    # the rope delta matters: decoding at the plain cache position goes elsewhere
    sys.modules["jaxllm.infer.generate"].vision_inputs = no_delta
    try:
        assert generate(ours, [ids], GEN, images=[image]).tokens[0] != want
    finally:
        sys.modules["jaxllm.infer.generate"].vision_inputs = vision_inputs


def no_delta(*args):
    vision, grids = vision_inputs(*args)
    return (vision[0], vision[1], 0 * vision[2]), grids


def test_a_batch_mixes_image_and_text_prompts(imported):
    """Rows with two images, none, one image, and a short text row: each continues as alone."""
    _, ours, _ = imported
    rows = [prompt(TWO)[0].tolist(), [5, 77, 140, 9], prompt(ONE, seed=4)[0].tolist(), [3, 8]]
    images = [Pixels(pixels(TWO), np.asarray(TWO)), None, Pixels(pixels(ONE, 7), np.asarray(ONE))]
    alone = [generate(ours, [r], GEN, images=[i]).tokens[0] for r, i in zip(rows, images + [None])]
    assert generate(ours, rows, GEN, images=images).tokens == alone
    assert alone[1] == greedy_continue(ours, rows[1], 12).tolist()


def test_on_a_mesh_the_mixed_batch_continues_as_on_one_device(imported):
    """data 4 x fsdp 2 (the odd vocabulary does not split over tensor): rows over the data axes,
    the batch padded to 4 with a text row."""
    _, ours, run = imported
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2))
    placed = jaxllm.load_model(run, mesh=mesh)
    rows = [prompt(TWO)[0].tolist(), [5, 77, 140, 9], prompt(ONE, seed=4)[0].tolist()]
    images = [Pixels(pixels(TWO), np.asarray(TWO)), None, Pixels(pixels(ONE, 7), np.asarray(ONE))]
    want = generate(ours, rows, GEN, images=images).tokens
    assert generate(placed, rows, GEN, images=images, mesh=mesh).tokens == want


def test_text_only_model_refuses_images(imported, small_run):
    from jaxllm.load import restore

    model = restore(small_run).model()
    with pytest.raises(ValueError, match="need a vision-language model"):
        generate(model, [[1, 2, 3]], GEN, images=[Pixels(pixels(ONE), np.asarray(ONE))])


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny Qwen2.5-VL whose image ids are its tokenizer's, imported with the tokenizer."""
    tmp = tmp_path_factory.mktemp("vlm_chat")
    tok = tokenizer(tmp, QWEN2_VL)
    start, pad, end = (VT.pad_id(tok) - 1, VT.pad_id(tok), VT.pad_id(tok) + 1)
    cfg = hf.Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": 320},
        vision_config=VISION,
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        video_token_id=319,
        attn_implementation="eager",
    )
    torch.manual_seed(2)
    model = perturbed(hf.Qwen2_5_VLForConditionalGeneration(cfg).eval())
    src = save_hf(model, tmp / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((tmp / "tok" / name).read_bytes())
    assert run_cli("convert", "import", src, tmp / "run", "model.dtype=float32") == 0
    Image.new("RGB", (40, 30), (200, 30, 30)).save(tmp / "red.png")
    Image.new("RGB", (24, 64), (20, 30, 220)).save(tmp / "blue.png")
    (tmp / "notes.txt").write_text("not an image\n")
    return model, tok, tmp


@pytest.mark.parametrize(
    "names", [["red.png"], ["blue.png"], ["red.png", "blue.png"]], ids=["red", "blue", "two"]
)
def test_cli_chat_with_images_answers_as_transformers(chat_run, capsys, names):
    """A float32 cache, as every exact comparison uses: blue.png's 4th new token is a near-tie
    (transformers' two best logits 6.841 apart by 0.0006), which the default bfloat16 cache
    flips."""
    model, tok, tmp = chat_run
    paths = [str(tmp / n) for n in names]
    argv = ["generate", tmp / "run", "--chat", "what is in the picture?", "--temperature", "0"]
    argv += ["--kv-cache-dtype", "float32"]
    assert run_cli(*argv, "--max-new-tokens", "6", *(a for p in paths for a in ("--image", p))) == 0
    reply = capsys.readouterr().out.strip()
    # the same prompt built by hand: images first in the user turn, then the text
    ours = jaxllm.load_model(tmp / "run")
    text = {"type": "text", "text": "what is in the picture?"}
    content = [*({"type": "image", "image": p} for p in paths), text]
    ids, px = prompt_example(
        [{"role": "user", "content": content}], tok, image_spec(ours.cfg.vision)
    )
    assert len(px.image_grid_thw) == len(names)
    pads = np.flatnonzero(np.asarray(ids) == VT.pad_id(tok))  # the images, then the text
    assert len(pads) == px.image_grid_thw.prod(1).sum() // 4
    assert tok.decode(ids[pads[-1] :]) == "what is in the picture?\nassistant\n"  # specials cut
    new = hf_generate(
        model, ids, px.pixel_values_NxP, px.image_grid_thw.tolist(), VT.pad_id(tok), 6
    )
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    assert len(new) >= 3 and reply == tok.decode(new).strip()


def test_cli_chat_file_reads_image_parts_under_its_directory(chat_run, capsys):
    """A chat JSONL's image part (a path relative to the file) answers as --chat --image does."""
    _, _, tmp = chat_run
    ask = ["--temperature", "0", "--max-new-tokens", "6"]
    q = "what is in the picture?"
    assert run_cli("generate", tmp / "run", "--chat", q, "--image", tmp / "red.png", *ask) == 0
    want = capsys.readouterr().out.strip()
    parts = [{"type": "image", "image": "red.png"}, {"type": "text", "text": q}]
    rows = [{"messages": [{"role": "user", "content": parts}]}]
    (tmp / "sub").mkdir(exist_ok=True)
    (tmp / "sub" / "red.png").write_bytes((tmp / "red.png").read_bytes())
    (tmp / "sub" / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_cli("generate", tmp / "run", "--chat-file", tmp / "sub" / "chats.jsonl", *ask) == 0
    assert json.loads(capsys.readouterr().out) == {"reply": want}


def test_cli_refuses_an_image_on_a_text_only_run(small_run, tmp_path, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    err = stderr_of_failure(
        capsys, "generate", small_run, "--chat", "hi", "--image", tmp_path / "a.png"
    )
    assert err.startswith("jaxllm: ") and len(err.strip().splitlines()) == 1
    assert "vision-language model (model.vision)" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chat", "hi", "--image", "{tmp}/notes.txt"], "notes.txt: "),
        (["--chat", "hi", "--image", "{tmp}/missing.png"], "missing.png"),
        (["--prompt", "hi", "--image", "{tmp}/red.png"], "--image goes with --chat"),
    ],
    ids=["not_an_image", "missing", "without_chat"],
)
def test_cli_refuses_bad_images_in_one_line(chat_run, capsys, argv, message):
    _, _, tmp = chat_run
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    err = stderr_of_failure(capsys, "generate", tmp / "run", *argv)
    assert err.startswith("jaxllm: ") and len(err.strip().splitlines()) == 1
    assert message in err and "Traceback" not in err, err


def test_a_text_only_server_refuses_image_parts_with_400_and_joins_text_parts():
    """A text-only model's server: an image part is a clear 400 before anything runs; a list
    of text parts (OpenAI's content parts) is the text they join into."""
    from fastapi.testclient import TestClient

    from jaxllm.data.vision_chat import flatten
    from jaxllm.infer.chat import EndOfTurn
    from jaxllm.serve.app import Served, make_app
    from jaxllm.serve.images import _checked

    url = {"url": "data:image/png;base64," + "A" * 8}
    parts = [{"type": "image_url", "image_url": url}, {"type": "text", "text": "hi"}]
    # no engine runs: the refusal comes first (Served reads only the engine's context size)
    engine = SimpleNamespace(cfg=SimpleNamespace(max_seq_len=64), pool=SimpleNamespace(num_pages=9))
    worker = SimpleNamespace(engine=SimpleNamespace(**vars(engine), page_size=8))
    served = Served(worker, None, "tiny", [], EndOfTurn("", frozenset(), ()), None)
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}]}
    r = TestClient(make_app(served)).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert "this model is text-only" in r.json()["error"]["message"]
    texts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    checked, count = _checked([{"role": "user", "content": texts}], None, None)
    assert count == 0 and flatten(checked)[0] == [{"role": "user", "content": "a b"}]
