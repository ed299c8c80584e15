"""The engine's page pool: a free list of KV pages with reference counts, and full pages keyed
by a hash of their token block chain so identical prefixes are stored once.

Page 0 is the scratch page (`jaxllm.infer.kv_cache`): block table entries a sequence does not
own point at it, so padding writes land there; it is never handed out. A full page of tokens is
registered under `block_hash(parent, tokens)`, the hash of its tokens and of every block before
it (as vLLM's prefix cache keys blocks), so two sequences share a page only when everything
before it is identical too.

Prefix caching, as vLLM v1's KV cache manager does it: a registered page whose last user lets
go of it is not forgotten but kept, with its hash, in an evictable least-recently-released set.
`lookup` revives such a page (0 -> 1 reference), so a system prompt no running request holds
is still prefilled only once; `allocate` takes a never-registered free page first and only
then evicts the least recently released cached page, forgetting its hash. Both kinds count as
free (`num_free`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hash(parent: int | None, tokens: Sequence[int], salt: int | None = None) -> int:
    """The key of one full page: its tokens and the key of the page before it; `salt`: what
    else its keys and values depend on (the digest of an image whose tokens begin in it)."""
    return hash((parent, tuple(tokens))) if salt is None else hash((parent, tuple(tokens), salt))


def block_hashes(
    tokens: Sequence[int], page_size: int, num_blocks: int, salts: dict | None = None
) -> list[int]:
    """Keys of the first `num_blocks` full pages of `tokens`, chained; `salts`: page index ->
    salt."""
    out, parent, salts = [], None, salts or {}
    for i in range(num_blocks):
        block = tokens[i * page_size : (i + 1) * page_size]
        parent = block_hash(parent, block, salts.get(i))
        out.append(parent)
    return out


def prefill_blocks(
    prompt: Sequence[int], hashed: int, page_size: int, salts: dict | None = None
) -> list[int]:
    """Keys of a prompt's full pages from the `hashed`-th on: those a sequence prefilling it has
    yet to register."""
    return block_hashes(prompt, page_size, len(prompt) // page_size, salts)[hashed:]


class PagePool:
    """`num_pages` pages (scratch page 0 included): a free list, reference counts, the hash ->
    page map of full pages that can be shared, and the LRU set of cached pages nobody holds."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: the pool needs the scratch page and more")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._refs = [0] * num_pages
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages nobody holds that keep a registered prefix block until the pool needs them."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages held by at least one sequence (the scratch page not counted)."""
        return self.num_pages - 1 - self.num_free

    def allocate(self) -> int | None:
        """A fresh page with one reference, or None when the pool is empty. A cached page is
        taken only when no free page is left: the least recently released, its hash dropped."""
        if self._free:
            page = self._free.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(page)]
            self.num_evictions += 1
        else:
            return None
        self._refs[page] = 1
        return page

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page. A page nobody holds any more goes back to the free
        list, or, if it holds a registered block, to the cached set. A sequence's pages are let
        go last first, so its deeper blocks (whose chain is less likely to be asked for) are
        evicted before the prefix they continue."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The registered pages of the longest leading run of `hashes`, each with one more
        reference (the caller now holds them); cached pages are revived."""
        pages = []
        for h in hashes:
            page = self._by_hash.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
            pages.append(page)
        return pages

    def count(self, hashes: Sequence[int]) -> int:
        """How many of the leading `hashes` `lookup` would find (no reference taken)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._by_hash:
            n += 1
        return n

    def register(self, h: int, page: int) -> None:
        """Makes a full page findable by its hash (the first page under a hash keeps it)."""
        if h not in self._by_hash and page not in self._hash_of:
            self._by_hash[h] = page
            self._hash_of[page] = h

    def refs(self, page: int) -> int:
        return self._refs[page]
