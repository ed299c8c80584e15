"""A whole batch of prompts through the engine, as the static generator takes it: rollouts and
chat call `generate` here with `jaxllm.infer.generate.generate`'s arguments and get its
`Generation` back (`tokens`, `ends`, `stopped`).

Consecutive equal prompts (a GRPO group: each prompt G times in a row), with the same images
for a vision-language model (`images=`, one `Pixels` or None per prompt), are one request with
n = G, so the group shares the prompt's full pages (`jaxllm.infer.engine.pages`), its prefill
and its tower run once. Request k samples with the seed `request_seed(gen.seed, k)`, or with its
first row's seed when `seeds` gives one per row, and its sample j with the engine's (seed, j):
the same seeds give the same completions, whatever else the engine runs. The pool is sized so nothing is preempted: every slot can hold a sequence of
`max_len` tokens at once.

Stops follow the static generator exactly: the engine ends a sample at any stop token or stop
sequence (an end-of-turn marker spelled as several tokens) and returns it (`include_stop`);
the sample's tokens are those before it, and it is the sample's `ends` entry.

On a mesh the engine runs sharded as `generate` does (`Engine(mesh=...)`); every cache dtype,
int4 / int2 (KIVI) pages too. `static_reason` says when the static generator runs instead: a
pipeline stage or sequence axis on the mesh, an encoder-decoder model or a soft prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxllm.config import ConfigError, GenerateConfig
from jaxllm.infer import kv_cache
from jaxllm.infer.engine import Engine, SamplingParams
from jaxllm.infer.generate import Generation, _first_stop, _stop_at
from jaxllm.infer.generate import generate as static_generate

MAX_SLOTS = 256
"""The most sequences one engine runs at once; a larger batch waits for free slots."""


def static_reason(model, gen: GenerateConfig, mesh) -> str | None:
    """Why this generation runs on the static generator (None: it runs on the engine)."""
    split = {a: mesh.shape.get(a, 1) for a in ("stage", "sequence")} if mesh is not None else {}
    if any(d > 1 for d in split.values()):
        return "the engine splits slots, heads and experts over a mesh, not stages or sequence"
    if model.cfg.kind != "decoder":
        return f"model.kind={model.cfg.kind}: the engine serves decoder-only models"
    if getattr(model, "soft_prompt", None) is not None:
        return "a soft prompt (peft.method=prompt) is not fed through the engine's pages"
    return None


def request_seed(seed: int, k: int) -> int:
    """The engine seed of request k of a batch generated with `seed`."""
    return int(np.random.SeedSequence([seed, k]).generate_state(1)[0] % 2**31)


def group_runs(
    prompts: Sequence[Sequence[int]], group: int | None = None, images: Sequence | None = None
) -> list[tuple[int, list[int], int]]:
    """(first row, prompt, how many rows) of each run of equal consecutive prompts; with
    `group`, a run also ends at every multiple of `group` rows; with `images` (one per prompt),
    a run's rows hold the same images too."""
    runs: list[tuple[int, list[int], int]] = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if (
            runs
            and runs[-1][1] == p
            and (images is None or _same_images(images[runs[-1][0]], images[i]))
            and not (group and i % group == 0)
        ):
            runs[-1] = (runs[-1][0], p, runs[-1][2] + 1)
        else:
            runs.append((i, p, 1))
    return runs


def _same_images(a, b) -> bool:
    """Whether two prompts' images (`Pixels` or None) are the same pixels and grids."""
    if a is b or a is None or b is None:
        return a is b
    return np.array_equal(a.image_grid_thw, b.image_grid_thw) and np.array_equal(
        a.pixel_values_NxP, b.pixel_values_NxP
    )


def make_engine(
    model, gen: GenerateConfig, *, slots: int, max_len: int, mesh=None, mesh_config=None
) -> Engine:
    """An engine of `slots` slots (at most MAX_SLOTS) whose pool holds that many sequences
    of `max_len` tokens at once (no preemption), pages of `gen.kv_page_size` tokens or 16 (int4
    / int2: a multiple of `gen.kv_group`), on `mesh` (None: one device) with the run's
    `mesh_config`."""
    page_size = gen.kv_page_size or 16
    if gen.kv_cache_dtype in kv_cache.KIVI_KINDS:
        page_size = math.lcm(page_size, gen.kv_group)
    slots = max(1, min(slots, MAX_SLOTS))
    chunk = 1 << (max(max_len, 1) - 1).bit_length()  # a whole prompt in one prefill step
    return Engine(
        model,
        max_num_seqs=slots,
        page_size=page_size,
        num_pages=slots * -(-max_len // page_size) + 1,  # + the scratch page
        chunk_size=min(chunk, 512),
        kv_cache_dtype=gen.kv_cache_dtype,
        kv_group=gen.kv_group,
        decode_impl=gen.decode_impl,
        mesh=mesh,
        mesh_config=mesh_config,
    )


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    gen: GenerateConfig = GenerateConfig(),
    *,
    stop_tokens: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    mesh=None,
    mesh_config=None,
    slots: int | None = None,
    max_len: int | None = None,
    seeds: Sequence[int] | None = None,
    group: int | None = None,
    images: Sequence | None = None,
) -> Generation:
    """`jaxllm.infer.generate.generate`'s continuation of `prompts`, on the engine where
    `static_reason` allows (else on the static generator itself); `mesh_config`: the run's
    `mesh` section, for the engine's settings on `mesh`. `slots` and `max_len` size
    the engine (defaults: one slot per prompt, the longest prompt + max_new_tokens); give the
    same values on every call of a loop and its device programs compile once. `seeds`: one
    per prompt, in place of `gen.seed` (a run of equal prompts samples with its first one's);
    `group`: runs never cross a multiple of it (a GRPO group samples the same whatever rows
    surround it, even beside a group of the same prompt); `images`: one `Pixels` or None per
    prompt (a vision-language model's; `Engine.add_request`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"generate got {len(images)} image sets for {len(prompts)} prompts")
    stops = sorted({*(int(t) for t in stop_tokens), *gen.stop_tokens})
    kw = {"stop_tokens": stops, "stop_sequences": stop_sequences}
    if seeds is not None:
        if len(seeds) != len(prompts):
            raise ValueError(f"generate got {len(seeds)} seeds for {len(prompts)} prompts")
        kw["seeds"] = seeds
    if images is not None and any(p is not None for p in images):
        kw["images"] = images
    if static_reason(model, gen, mesh) is not None:
        return static_generate(model, prompts, gen, mesh=mesh, **kw)
    longest = max(len(p) for p in prompts)
    if longest + gen.max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({gen.max_new_tokens}) exceeds the "
            f"model's max_seq_len ({model.cfg.max_seq_len})"
        )
    max_len = max(max_len or 0, longest + gen.max_new_tokens)
    sharded = mesh is not None and mesh.size > 1  # a one-device mesh is one device
    try:
        engine = make_engine(
            model,
            gen,
            slots=slots or len(prompts),
            max_len=max_len,
            mesh=mesh if sharded else None,  # (a sharded pool compiles a program per engine)
            mesh_config=mesh_config,
        )
    except (ConfigError, ValueError):
        if not sharded:
            raise
        # the engine lays the parameters out by their logical axes, which some trained layouts
        # do not follow (a QLoRA run's NF4 base): the static generator reads them as they lie
        return static_generate(model, prompts, gen, mesh=mesh, **kw)
    seqs = sorted({tuple(int(t) for t in q) for q in stop_sequences if len(q)})
    ids = []
    for k, (first, prompt, n) in enumerate(group_runs(prompts, group, images)):
        seed = request_seed(gen.seed, k) if seeds is None else int(seeds[first]) % 2**31
        params = SamplingParams(
            max_tokens=gen.max_new_tokens,
            temperature=float(gen.temperature),
            top_k=gen.top_k,
            top_p=float(gen.top_p),
            stop_tokens=tuple(stops),
            stop_sequences=tuple(seqs),
            include_stop=True,
            seed=seed,
            n=n,
        )
        ids.append(
            engine.add_request(prompt, params, images=None if images is None else images[first])
        )
    done: dict[int, list] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for o in engine.step().finished:
            done[o.request_id].append(o)
    tokens, stopped, ends = [], [], []
    for rid in ids:
        for o in sorted(done[rid], key=lambda o: o.index):
            row = o.tokens  # the stop that ended it included
            cut = _first_stop(row, set(stops), seqs)
            tokens.append(row if cut is None else row[:cut])
            stopped.append(cut is not None)
            ends.append([] if cut is None else _stop_at(row, cut, set(stops), seqs))
    per_token = kv_cache.model_bytes_per_token(model.cfg, gen.kv_cache_dtype, gen.kv_group)
    pool_tokens = engine.pool.num_pages * engine.page_size
    return Generation(tokens, stopped, per_token, per_token * pool_tokens, ends)
