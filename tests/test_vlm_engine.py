"""Images in the inference engine: a converted tiny Qwen2.5-VL's greedy continuation of prompts
with one and with two images (and a tall one), prefilled in chunks that cut through the images,
equals transformers' `generate` and the static generator's (`generate(..., images=)`); two
requests with the same text and different images running at once each get their own answer; the
prefix cache shares pages before the first image token only, unless the images are the same."""

import numpy as np
import pytest
from test_qwen2_5_vl import ONE, TWO, pixels, prompt
from test_vlm_generate import GEN, hf_generate, imported  # noqa: F401 (a fixture)

from jaxllm.data.images import Pixels
from jaxllm.infer import generate
from jaxllm.infer.engine import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def engine(model, **kw):
    return Engine(
        model, **{"max_num_seqs": 2, "page_size": 2, "num_pages": 64, "chunk_size": 4, **kw}
    )


def image(grids, seed=1):
    return Pixels(pixels(grids, seed), np.asarray(grids))


def run(e, requests):
    """Adds (ids, images) requests at once, steps until all finish: their tokens in order."""
    ids = [e.add_request(p, GREEDY, images=im) for p, im in requests]
    done = {}
    while e.has_unfinished():
        for o in e.step().finished:
            done[o.request_id] = o.tokens
    return [done[i] for i in ids]


TALL = [(1, 12, 4)]  # an image taller than wide: its rows set the rope delta


@pytest.mark.parametrize("grids", [ONE, TWO, TALL], ids=["one_image", "two_images", "tall"])
def test_greedy_tokens_equal_transformers_and_the_static_generator(imported, grids):  # noqa: F811
    hf_model, ours, _ = imported
    ids, im = prompt(grids)[0].tolist(), image(grids)
    want = hf_generate(hf_model, ids, im.pixel_values_NxP, grids)
    assert len(set(want)) > 4
    assert run(engine(ours), [(ids, im)]) == [want]
    assert generate(ours, [ids], GEN, images=[im]).tokens[0] == want


def test_two_requests_with_different_images_each_get_their_own(imported):  # noqa: F811
    """The same text, two images, at once (and beside a text request): each as alone."""
    _, ours, _ = imported
    ids = prompt(TWO)[0].tolist()
    a, b = image(TWO, 1), image(TWO, 9)
    alone = [generate(ours, [ids], GEN, images=[i]).tokens[0] for i in (a, b)]
    assert alone[0] != alone[1]  # the image decides the answer
    text = [5, 77, 140, 9]
    want_text = generate(ours, [text], GEN).tokens[0]
    e = engine(ours, max_num_seqs=3)
    assert run(e, [(ids, a), (ids, b), (text, None)]) == alone + [want_text]


@pytest.mark.parametrize("swap", ["recompute", "host"])
def test_preempted_image_requests_answer_as_alone(imported, swap):  # noqa: F811
    """41 tokens a sequence (21 pages of 2), a pool of 30: one is preempted and comes back
    (its features recomputed into the pages again, or its pages from host memory)."""
    _, ours, _ = imported
    ids = prompt(TWO)[0].tolist()
    requests = [(ids, image(TWO, 1)), (ids, image(TWO, 9))]
    want = [run(engine(ours), [r])[0] for r in requests]
    e = engine(ours, num_pages=30, swap=swap)
    assert run(e, requests) == want
    assert e.num_preemptions > 0


def test_prefix_pages_are_shared_before_the_first_image_only(imported):  # noqa: F811
    _, ours, _ = imported
    ids = prompt(ONE)[0].tolist()  # 3 text tokens, the image's start at 3, its tokens from 4
    a, b = image(ONE, 1), image(ONE, 9)
    e = engine(ours)
    want_a, want_b = (generate(ours, [ids], GEN, images=[i]).tokens[0] for i in (a, b))
    assert run(e, [(ids, a)]) == [want_a]
    hits = e.prefix_hits
    assert run(e, [(ids, b)]) == [want_b]  # a different image: pages 0-1 (tokens 0-3) only
    assert e.prefix_hits - hits == 4
    hits = e.prefix_hits
    assert run(e, [(ids, image(ONE, 1))]) == [want_a]  # the same image again: every full page
    assert e.prefix_hits - hits == (len(ids) - 1) // 2 * 2
    hits = e.prefix_hits
    assert run(e, [(ids, None)]) != [want_a]  # the same ids without the image: none past 3
    assert e.prefix_hits - hits == 4


def test_refusals(imported, small_run):  # noqa: F811
    from jaxllm.load import restore

    _, ours, _ = imported
    with pytest.raises(ValueError, match="image tokens for 2 image"):
        engine(ours).add_request(prompt(ONE)[0].tolist(), GREEDY, images=image(TWO))
    text_model = restore(small_run).model()
    with pytest.raises(ValueError, match="need a vision-language model"):
        engine(text_model, page_size=8).add_request([1, 2, 3], GREEDY, images=image(ONE))


def test_on_a_mesh_image_requests_answer_as_on_one_device(imported):  # noqa: F811
    """data 4 x fsdp 2: slots over the data axes, the tower under the engine's mesh."""
    import jaxllm
    from jaxllm import sharding
    from jaxllm.config.sections import MeshConfig

    _, ours, path = imported
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2))
    placed = jaxllm.load_model(path, mesh=mesh)
    requests = [(prompt(TWO)[0].tolist(), image(TWO)), (prompt(ONE)[0].tolist(), image(ONE, 9))]
    want = run(engine(ours), requests)
    assert run(engine(placed, mesh=mesh, max_num_seqs=4), requests) == want
