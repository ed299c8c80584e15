"""The engine: requests, the host scheduler, and the loop around the jitted device step.

Each `Engine.step()` (1) gives every running sequence, oldest first, the pages its next tokens
need, preempting the newest running sequences when the pool runs dry; (2) admits waiting
sequences into free slots while pages allow, after looking up their leading full pages in the
prefix cache; (3) runs one device step (`runner.step`) in which a prefilling sequence feeds
its next chunk and a decoding one its last token; (4) appends the sampled tokens, registers
newly filled pages, and retires finished sequences, whose pages go back to the pool.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm import sharding
from jaxllm.config import MeshConfig
from jaxllm.config.sections import KV_CACHE_DTYPE
from jaxllm.infer import kv_cache
from jaxllm.infer.engine import kivi, linear, prompts, runner, structured, swap, vision
from jaxllm.infer.engine.pages import PagePool, block_hash, block_hashes, prefill_blocks
from jaxllm.infer.engine.requests import Output, Seq, StepResult, check_request, token_ids
from jaxllm.infer.engine.sampling import RowBuilder, SamplingParams, accept
from jaxllm.infer.generate import resolve_decode_impl


class Engine:
    """Continuous batching of requests over a pool of KV pages allocated once.

    `max_num_seqs` slots run at a time; `num_pages` pages of `page_size` tokens (page 0 is
    scratch) hold every sequence's cache; a prompt is prefilled `chunk_size` tokens (a power
    of two) per step. Device programs compile once per query bucket (1, 2, 4 .. chunk_size)
    and block-table width (1, 2, 4 .. pages, up to max_seq_len's pages: `table_width`).
    `swap`: how a preempted sequence comes back, "recompute" (its tokens prefilled again) or
    "host" (its pages copied to host memory and back, `swap.py`). `kv_group`: the int4 / int2
    quantization group, a divisor of `page_size` (`kivi.py`); `page_size` defaults to 16 tokens,
    for int4 / int2 the least multiple of 16 and that group (32 at the default group). A hybrid model's linear layers
    keep a state per slot beside the pages (`linear.py`); it shares no prefix pages.

    With `mesh` the engine runs sharded on it, as `generate(..., mesh=mesh)` does: the model's
    parameters are laid out by their logical axes, the pages' kv heads split over `tensor`, the
    slots over the data axes (`max_num_seqs` is rounded up to a multiple of their degree);
    `mesh_config` (a run's `mesh` section) brings its settings, such as `expert_dispatch`.
    `tokenizer` (the model's `jaxllm.data.tokenizer`): for structured outputs (`structured.py`).
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        max_num_seqs: int = 8,
        page_size: int | None = None,
        num_pages: int = 64,
        chunk_size: int = 32,
        kv_cache_dtype: str = KV_CACHE_DTYPE,
        decode_impl: str = "auto",
        prefix_sharing: bool = True,
        swap: str = "recompute",
        kv_group: int = 32,
        mesh: Mesh | None = None,
        mesh_config: MeshConfig | None = None,
        tokenizer=None,
    ):
        cfg = model.cfg
        if cfg.kind != "decoder" or getattr(model, "soft_prompt", None) is not None:
            raise ValueError("the engine serves decoder-only models without soft prompts")
        if page_size is None:
            kivi = kv_cache_dtype in kv_cache.KIVI_KINDS and kv_group > 0
            page_size = math.lcm(16, kv_group) if kivi else 16
        if min(page_size, max_num_seqs, kv_group) < 1:
            raise ValueError("page_size, max_num_seqs and kv_group must be at least 1")
        self._group = kv_group if kv_cache_dtype in kv_cache.KIVI_KINDS else None
        if self._group is not None and page_size % kv_group:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype}: page_size={page_size} must be a multiple of "
                f"its quantization group ({kv_group})"
            )
        if chunk_size < 1 or chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk_size={chunk_size} must be a power of two")
        self.cfg, self.page_size, self.chunk_size = cfg, page_size, chunk_size
        self.prefix_sharing = prefix_sharing and not cfg.layer_pattern  # see linear.py
        if swap not in ("recompute", "host"):
            raise ValueError(f"swap={swap!r}: expected 'recompute' or 'host'")
        self.swap = swap
        # on a mesh: parameters by their logical axes, pages' kv heads over `tensor`, slots
        # over the data axes (their count rounded up to split evenly)
        self._parallel = (
            sharding.Parallel(mesh)
            if mesh_config is None
            else sharding.Parallel.of(mesh, mesh_config)
        )
        if mesh is not None and (
            mesh.shape.get("stage", 1) > 1 or mesh.shape.get("sequence", 1) > 1
        ):
            raise ValueError(
                "the engine splits slots, heads and experts over a mesh, not pipeline stages or "
                "the sequence: give it a mesh with stage=1 and sequence=1"
            )
        dp = runner.data_degree(self._parallel)
        max_num_seqs = -(-max_num_seqs // dp) * dp
        self._graphdef, self._state = nnx.split(model)
        self._state = runner.place_params(self._state, self._parallel)
        self._impl, self._interpret = resolve_decode_impl(decode_impl, cfg)
        self.pages_per_slot = pps = -(-cfg.max_seq_len // page_size)
        # compiled shapes: Q (tokens per slot) and J (block-table pages) each from a few buckets
        self.query_buckets = tuple(1 << i for i in range(chunk_size.bit_length()))
        self.page_buckets = tuple(1 << i for i in range((pps - 1).bit_length())) + (pps,)
        self.pool = PagePool(num_pages)
        self._kv = runner.empty_cache(
            cfg,
            slots=max_num_seqs,
            pages_per_slot=self.pages_per_slot,
            page_size=page_size,
            num_pages=num_pages,
            kind=kv_cache_dtype,
            group=kv_group,
            parallel=self._parallel,
        )
        self._linear = linear.empty_state(cfg, max_num_seqs, self._parallel)  # hybrid models
        self._slots: list[Seq | None] = [None] * max_num_seqs
        self._rows = RowBuilder(max_num_seqs, cfg.max_seq_len)
        self._guide = structured.Guide(tokenizer, cfg.vocab_size)
        self._waiting: list[Seq] = []  # by arrival
        self._requests: dict[int, list[Seq]] = {}
        self._next_id = 0
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # tokens fed to the model: prefill, recompute, decode
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found cached

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), images=None
    ):
        """Queues a prompt; returns its request id. It joins the batch at a later `step`.
        `images` (a vision-language model): the prompt's images, a `jaxllm.data.images.Pixels`
        whose image pad tokens the prompt holds expanded (`vision.py`)."""
        prompt = token_ids(prompt_ids, params)
        check_request(prompt, params, self.cfg, self.page_size, self.pool.num_pages)
        matchers = self._guide.matchers(params)  # structured outputs: one per sample
        if images is not None and len(images.image_grid_thw):
            images = vision.prepare(
                self._graphdef,
                self._state,
                self.cfg,
                prompt,
                images,
                self.page_size,
                self._parallel,
            )
        else:
            images = None
        rid = self._next_id
        self._next_id += 1
        base = rid if params.seed is None else params.seed
        seqs = []
        for j in range(params.n):
            seq = Seq(rid, j, prompt, params, (base * 1_000_003 + j) % 2**31, self._arrivals)
            seq.images, seq.matcher = images, matchers and matchers[j]
            self._arrivals += 1
            seqs.append(seq)
            self._waiting.append(seq)
        self._requests[rid] = seqs
        return rid

    def abort(self, request_id: int, index: int | None = None) -> bool:
        """Drops a request's unfinished samples (only sample `index` if given), waiting or
        running; their pages go back to the pool. False when the request is unknown or already
        finished."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return False
        dropped = False
        for seq in seqs:
            if seq.done or index not in (None, seq.index):
                continue
            dropped = True
            if seq.slot is not None:
                self._slots[seq.slot], seq.slot = None, None
            elif seq in self._waiting:
                self._waiting.remove(seq)
            self.pool.release(seq.pages)
            seq.pages, seq.done = [], True
        if all(seq.done for seq in seqs):
            del self._requests[request_id]
        return dropped

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()
    ) -> list[list[Output]]:
        """Runs the engine until every request (these and any queued before) has finished;
        returns these prompts' samples, [prompt][sample]."""
        ids = [self.add_request(p, params) for p in prompts]
        done: dict[int, list[Output]] = {}
        while self.has_unfinished():
            for o in self.step().finished:
                done.setdefault(o.request_id, []).append(o)
        return [sorted(done[i], key=lambda o: o.index) for i in ids]

    # -- scheduling -------------------------------------------------------------------------

    def _running(self) -> list[Seq]:
        return sorted((s for s in self._slots if s is not None), key=lambda s: s.arrival)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (first admissions
        only; 0 before any)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def _preempt(self, seq: Seq) -> None:
        """Frees a running sequence's pages and queues it to be recomputed from its tokens, or
        (swap="host") to have its computed pages copied back from host memory."""
        if self.swap == "host" and seq.computed:
            n = -(-seq.computed // self.page_size)
            seq.swapped = swap.save(self._kv, seq.pages[:n], seq.slot)
            seq.swapped.linear = linear.save(self._linear, seq.slot)
        else:
            seq.computed = 0
        self.pool.release(seq.pages)
        seq.pages, seq.hashed, seq.last_hash, seq.resumed = [], 0, None, True
        self._slots[seq.slot], seq.slot = None, None
        bisect.insort(self._waiting, seq, key=lambda s: s.arrival)
        self.num_preemptions += 1

    def _grow(self, seq: Seq, num_tokens: int) -> bool:
        """Gives `seq` pages for `num_tokens`, preempting the newest running sequences while
        the pool is empty; False if `seq` itself had to go."""
        while len(seq.pages) < -(-num_tokens // self.page_size):
            page = self.pool.allocate()
            if page is None:
                victim = self._running()[-1]
                self._preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.pages.append(page)
        return True

    def _take(self, seq: Seq) -> int:
        """Tokens `seq` feeds next: a chunk, or (int4 / int2) what `kivi.chunk_limit` allows."""
        take = min(len(seq.tokens) - seq.computed, self.chunk_size)
        if self._group is not None:
            take = min(take, kivi.chunk_limit(seq.computed, self._group))
        return take

    def _ready(self, seq: Seq) -> bool:
        """A later sample of a request waits until the first has its prompt in pages, so it
        finds them in the prefix cache instead of computing them again."""
        if seq.index == 0 or not self.prefix_sharing:
            return True
        first = self._requests[seq.request_id][0]
        return first.done or first.computed >= len(first.prompt)

    def _admit(self) -> list[Seq]:
        admitted = []
        free_slots = [i for i, s in enumerate(self._slots) if s is None]
        ps, pending = self.page_size, set()  # blocks that running prefills are computing
        for s in self._slots:
            if self.prefix_sharing and s is not None and s.computed < len(s.prompt):
                pending.update(prefill_blocks(s.prompt, s.hashed, ps, s.salts))
        for seq in list(self._waiting):
            if not free_slots:
                break
            if not self._ready(seq):
                continue
            tokens, swapped = seq.tokens, seq.computed  # computed: 0 unless swapped to host
            # full pages only, and at least one token left to feed; none while it needs its
            # prompt's log-probabilities
            if self.prefix_sharing and not prompts.asks(seq):
                hashes = block_hashes(tokens, ps, (len(tokens) - 1) // ps, seq.salts)
                n = self.pool.count(hashes)
                if n < len(hashes) and hashes[n] in pending and not swapped:
                    continue  # its next block is being prefilled: it will find it cached
                seq.pages = self.pool.lookup(hashes)
                seq.hashed = len(seq.pages)
                seq.last_hash = hashes[seq.hashed - 1] if seq.pages else None
            hit = len(seq.pages) * ps
            seq.computed = max(hit, swapped)
            take = self._take(seq)
            need = -(-(seq.computed + take) // ps) - len(seq.pages)
            if need > self.pool.num_free:
                self.pool.release(seq.pages)
                seq.pages, seq.computed, seq.hashed, seq.last_hash = [], swapped, 0, None
                break
            self._grow(seq, seq.computed + take)
            seq.slot = free_slots.pop(0)
            if hit < swapped:  # the pages the prefix cache no longer has come back from host
                new = seq.pages[hit // ps : -(-swapped // ps)]
                self._kv = swap.restore(self._kv, seq.swapped, new, hit // ps, seq.slot)
                self._linear = linear.restore(self._linear, seq.swapped.linear, seq.slot)
            seq.swapped = None
            if self.prefix_sharing and not seq.resumed:
                self.prefix_queries += len(seq.prompt)
                self.prefix_hits += min(hit, len(seq.prompt))
            if self.prefix_sharing and seq.computed < len(seq.prompt):
                pending.update(prefill_blocks(seq.prompt, seq.hashed, ps, seq.salts))
            self._slots[seq.slot] = seq
            self._waiting.remove(seq)
            admitted.append(seq)
        return admitted

    def _schedule(self) -> list[tuple[Seq, int]]:
        """(sequence, tokens it feeds this step) for every sequence that runs."""
        batch = []
        preempted = self.num_preemptions
        for seq in self._running():
            if seq.slot is None:  # preempted for an older sequence in this loop
                continue
            take = self._take(seq)
            if self._grow(seq, seq.computed + take):
                batch.append((seq, take))
        if self.num_preemptions == preempted:  # no admissions while the pool is short
            for seq in self._admit():
                batch.append((seq, self._take(seq)))
        if self._group is not None and batch:  # int4 / int2: no padding may close a group
            takes = kivi.fit([s.computed for s, _ in batch], [t for _, t in batch], self._group)
            batch = [(seq, take) for (seq, _), take in zip(batch, takes)]
        self.num_scheduled_tokens += sum(take for _, take in batch)
        return batch

    # -- the step ---------------------------------------------------------------------------

    def table_width(self, batch: list[tuple[Seq, int]], q: int) -> int:
        """Block-table pages the step attends over: enough for every slot's start + Q tokens
        (its real ones and its padding), rounded up to a power of two, at most
        `pages_per_slot`. Attention then costs what the live lengths need, not what
        max_seq_len allows, and each (Q, width) bucket compiles once."""
        ps = self.page_size
        pages = max(max(-(-(seq.computed + q) // ps), len(seq.pages)) for seq, _ in batch)
        return min(1 << (pages - 1).bit_length(), self.pages_per_slot)

    def step(self) -> StepResult:
        """One engine iteration: schedule, one device step, bookkeeping."""
        batch = self._schedule()
        if not batch:
            return StepResult([], [])
        s, ps = len(self._slots), self.page_size
        q = 1 << (max(take for _, take in batch) - 1).bit_length()
        tokens_SxQ = np.zeros((s, q), np.int32)
        start_S, real_S = np.zeros(s, np.int32), np.zeros(s, np.int32)
        table_SxJ = np.zeros((s, self.table_width(batch, q)), np.int32)
        for seq, take in batch:
            r = seq.slot
            tokens_SxQ[r, :take] = seq.tokens[seq.computed : seq.computed + take]
            start_S[r], real_S[r] = seq.computed, take
            table_SxJ[r, : len(seq.pages)] = seq.pages
        rows = runner.put_rows(self._parallel, tokens_SxQ, start_S, real_S, table_SxJ)
        put = functools.partial(runner.put_rows, self._parallel)
        sampling = self._rows.build([seq for seq, _ in batch], put)
        allowed_SxB = structured.masks(batch, s, self.cfg.vocab_size)  # None: nothing guided
        if allowed_SxB is not None:
            sampling = sampling._replace(allowed_SxB=put(allowed_SxB)[0])
        images = None  # a vision-language model: [S, 3, Q] positions, the chunks' image features
        if self.cfg.vision is not None:
            pos, feats = vision.chunk_inputs(
                [(seq.slot, seq.computed, t, len(seq.prompt), seq.images) for seq, t in batch], s, q
            )
            if feats is not None:
                feats = tuple(None if f is None else put(f)[0] for f in feats)
            images = (put(pos)[0], feats)
        targets_SxQ = prompts.targets(batch, s, q)
        if targets_SxQ is not None:
            (targets_SxQ,) = put(targets_SxQ)
        picked, self._kv, self._linear, prompt = runner.step(
            self._graphdef,
            self._state,
            self._kv,
            self._linear,
            *rows,
            sampling,
            images,
            impl=self._impl,
            interpret=self._interpret,
            parallel=self._parallel,
            targets_SxQ=targets_SxQ,
        )
        if prompt is not None:
            prompts.record(batch, prompt)
        tok_S, logp_S, ids_SxK, top_SxK = map(np.asarray, picked)
        new, finished, new_logprobs = [], [], []
        for seq, take in batch:
            seq.computed += take
        done = [(x.request_id, x.index, x.prompt_lp) for x in prompts.finished(batch)]
        for seq, take in batch:
            while self.prefix_sharing and (seq.hashed + 1) * ps <= seq.computed:
                block = seq.tokens[seq.hashed * ps : (seq.hashed + 1) * ps]
                seq.last_hash = block_hash(seq.last_hash, block, (seq.salts or {}).get(seq.hashed))
                self.pool.register(seq.last_hash, seq.pages[seq.hashed])
                seq.hashed += 1
            if seq.computed < len(seq.tokens):  # mid-prefill: its sample is not used
                continue
            if not seq.params.max_tokens:  # the prompt only (scoring it): nothing sampled
                finished.append(self._finish(seq, "length"))
                continue
            r, p = seq.slot, seq.params
            top = None
            if p.top_logprobs:
                top = [(int(i), float(v)) for i, v in zip(ids_SxK[r], top_SxK[r])]
                top = top[: p.top_logprobs]
            complete = structured.advance(seq, int(tok_S[r]))
            shown, reason = accept(seq, int(tok_S[r]), float(logp_S[r]), top, complete)
            new += [(seq.request_id, seq.index, t) for t, _, _ in shown]
            new_logprobs += [(lp, top) for _, lp, top in shown]
            if reason is not None:
                finished.append(self._finish(seq, reason))
        return StepResult(new, finished, new_logprobs, done)

    def _finish(self, seq: Seq, reason: str) -> Output:
        self.pool.release(seq.pages)
        self._slots[seq.slot], seq.slot, seq.pages, seq.done = None, None, [], True
        p = seq.params
        logprobs = list(seq.logprobs) if p.logprobs or p.top_logprobs else None
        top = list(seq.top) if p.top_logprobs else None
        if all(s.done for s in self._requests[seq.request_id]):
            del self._requests[seq.request_id]
        return Output(
            seq.request_id, seq.index, list(seq.out), reason, logprobs, top, seq.prompt_lp
        )
