"""Prefix cache: chain hash of a full prompt block → the KV pages holding that block.

One instance per KV cache (per PP rank: each rank caches its own layers in its own pages). Blocks
are refcounted while requests use them; unreferenced blocks stay cached and are evicted LRU (deepest
block of a chain first) only when the allocator runs out. Only full blocks are cached, and a block
spans a whole number of pages.

Lifecycle of a request with chain ``c`` (``trace.block_hash_chain``) and prompt length ``n``:

1. ``hit, pages = pc.match(c, max_tokens=n - 1)``: reuse ``hit`` tokens (refs taken); keep one
   token to compute so the last prompt position yields logits.
2. ``pages = cat(pages, pc.alloc(needed - len(pages)))``; prefill positions ``[hit, n)``.
3. ``pc.insert(c, pages)`` once those blocks' KV is written (idempotent; call after any chunk).
4. ``pc.release(c, pages)`` when the request is done with its pages (e.g. after the KV transfer):
   drops its refs and frees its private pages.

PP ranks stay in agreement on hits as long as each applies the same calls in the same order to
equally sized caches (everything here is deterministic). Pages come back at different times on
different ranks (each frees once its own sends drained), so only PP0 chooses what to evict
(:meth:`PrefixCache.admit` reports the evicted blocks) and the other ranks evict exactly those
(:meth:`PrefixCache.evict_blocks`), never on their own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdplug_host.model import OutOfPagesError

__all__ = ["PageAllocator", "PrefixCache"]


class PageAllocator(Protocol):
    """What the prefix cache needs from a KV cache (``PagedKVCache`` satisfies it)."""

    @property
    def num_free(self) -> int: ...

    def alloc(self, n: int) -> torch.Tensor: ...

    def free(self, ids: torch.Tensor | Sequence[int]) -> None: ...


@dataclass(slots=True)
class _Block:
    pages: tuple[int, ...]
    refs: int


def _as_list(page_ids: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(p) for p in (page_ids.tolist() if isinstance(page_ids, torch.Tensor) else page_ids)]


class PrefixCache:
    """Refcounted, LRU-evicting map from block chain hashes to page ids.

    Args:
        allocator: the KV cache whose pages are cached (``alloc``/``free``/``num_free``).
        block_tokens: tokens per cached block (``TraceRequest.block_tokens``).
        page_size: tokens per page of ``allocator``.

    Raises:
        ValueError: ``block_tokens`` is not a positive multiple of ``page_size``.
    """

    def __init__(self, allocator: PageAllocator, block_tokens: int, page_size: int) -> None:
        if page_size < 1 or block_tokens < page_size or block_tokens % page_size:
            raise ValueError(
                f"block_tokens ({block_tokens}) must be a positive multiple of page_size "
                f"({page_size}); pick a trace scale with 512 / scale >= page_size"
            )
        self.allocator = allocator
        self.block_tokens = block_tokens
        self.page_size = page_size
        self.pages_per_block = block_tokens // page_size
        self._blocks: dict[int, _Block] = {}
        self._page_owner: dict[int, int] = {}  # page id -> chain hash of the block holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # refs == 0, oldest first
        self.hit_tokens = 0  # tokens served from cache by match()
        self.evicted_blocks = 0
        self._evicted_log: list[int] | None = None  # chain hashes evicted inside admit()

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Cached blocks (referenced or not)."""
        return len(self._blocks)

    @property
    def num_evictable_pages(self) -> int:
        """Pages held by unreferenced blocks (reclaimable by ``alloc``)."""
        return len(self._lru) * self.pages_per_block

    def refs(self, chain_hash: int) -> int:
        """Reference count of a cached block; 0 for unreferenced, -1 when not cached."""
        blk = self._blocks.get(chain_hash)
        return -1 if blk is None else blk.refs

    # -- request lifecycle -------------------------------------------------------------------------
    def match(
        self, chain: Sequence[int], max_tokens: int | None = None
    ) -> tuple[int, torch.Tensor]:
        """Longest cached prefix of ``chain``, limited to ``max_tokens`` tokens.

        Takes one reference on every matched block (undo with ``release``).

        Returns:
            ``(num_cached_tokens, page_ids)``: tokens = matched blocks * block_tokens; page_ids
            int64 [matched blocks * pages_per_block], in token order.
        """
        limit = (
            len(chain) if max_tokens is None else min(len(chain), max_tokens // self.block_tokens)
        )
        pages: list[int] = []
        n = 0
        while n < limit and (blk := self._blocks.get(chain[n])) is not None:
            if blk.refs == 0:
                del self._lru[chain[n]]
            blk.refs += 1
            pages.extend(blk.pages)
            n += 1
        self.hit_tokens += n * self.block_tokens
        return n * self.block_tokens, torch.tensor(pages, dtype=torch.int64)

    def insert(self, chain: Sequence[int], page_ids: torch.Tensor | Sequence[int]) -> int:
        """Cache the request's full blocks whose KV is now written.

        ``page_ids`` is the request's page list (token order); block i of ``chain`` is pages
        ``[i * pages_per_block, (i + 1) * pages_per_block)``; blocks beyond the page list are
        skipped. A block already cached with the same pages (matched or inserted before) is left
        alone; one cached with *other* pages (computed concurrently) stays private to the request
        and is freed by ``release``. Newly cached blocks start with one reference (the request's).

        Returns the number of newly cached blocks.

        Raises:
            ValueError: a page already belongs to a different cached block.
        """
        pages = _as_list(page_ids)
        ppb, added = self.pages_per_block, 0
        for i, h in enumerate(chain):
            blk_pages = tuple(pages[i * ppb : (i + 1) * ppb])
            if len(blk_pages) < ppb:
                break
            if h in self._blocks:
                continue
            for p in blk_pages:
                if p in self._page_owner:
                    raise ValueError(
                        f"insert(): page {p} of block {i} already cached under another block"
                    )
            self._blocks[h] = _Block(blk_pages, refs=1)
            for p in blk_pages:
                self._page_owner[p] = h
            added += 1
        return added

    def release(self, chain: Sequence[int], page_ids: torch.Tensor | Sequence[int]) -> None:
        """The request is done with ``page_ids`` (its whole page list, token order).

        Drops its reference on each of its blocks that is cached with exactly its pages;
        unreferenced blocks become evictable (deepest first). Every other page (private
        duplicates, the partial last block, pages past the chain) goes back to the allocator.

        Raises:
            ValueError: a cached block's refcount would go negative (double release).
        """
        pages = _as_list(page_ids)
        ppb = self.pages_per_block
        to_free: list[int] = []
        unreferenced: list[int] = []
        covered = 0
        for i, h in enumerate(chain):
            blk_pages = tuple(pages[i * ppb : (i + 1) * ppb])
            if len(blk_pages) < ppb:
                break
            covered = (i + 1) * ppb
            blk = self._blocks.get(h)
            if blk is None or blk.pages != blk_pages:
                to_free.extend(blk_pages)
                continue
            if blk.refs < 1:
                raise ValueError(f"release(): block {i} (hash {h}) is not referenced")
            blk.refs -= 1
            if blk.refs == 0:
                unreferenced.append(h)
        to_free.extend(pages[covered:])
        # Deepest blocks first in LRU order: a chain's parents are the likelier shared prefix.
        for h in reversed(unreferenced):
            self._lru[h] = None
        if to_free:
            self.allocator.free(to_free)

    def admit(
        self, chain: Sequence[int], num_pages: int, max_tokens: int | None = None
    ) -> tuple[int, torch.Tensor, list[int]] | None:
        """Match ``chain`` and allocate the rest of a request's ``num_pages`` pages, or do
        nothing when they cannot all be had now (the caller waits for pages to come back).

        :param num_pages: pages of the whole request (matched ones included).
        :returns: ``(hit_tokens, page_ids, evicted)``: ``page_ids`` int64 [num_pages] in token
            order (matched blocks first); ``evicted`` the chain hashes of the blocks evicted to
            make room (oldest first); ``None`` when free plus evictable pages (blocks this
            request matches excluded) are fewer than it needs, leaving the cache unchanged.
        """
        limit = (
            len(chain) if max_tokens is None else min(len(chain), max_tokens // self.block_tokens)
        )
        hit_blocks, matched_lru = 0, 0
        while hit_blocks < limit and (blk := self._blocks.get(chain[hit_blocks])) is not None:
            matched_lru += blk.refs == 0
            hit_blocks += 1
        extra = num_pages - hit_blocks * self.pages_per_block
        evictable = self.num_evictable_pages - matched_lru * self.pages_per_block
        if extra > self.allocator.num_free + evictable:
            return None
        hit, pages = self.match(chain, max_tokens)
        evicted: list[int] = []
        self._evicted_log = evicted
        try:
            rest = self.alloc(max(0, extra))
        finally:
            self._evicted_log = None
        return hit, torch.cat([pages, rest]), evicted

    def evict_blocks(self, hashes: Sequence[int]) -> bool:
        """Evict exactly the blocks ``hashes`` (another rank's :meth:`admit` choice), once none
        of them is referenced here.

        :returns: True when evicted; False (nothing evicted) while one is still referenced
            (its request has not released it on this rank yet: call again later).
        :raises ValueError: a block is not cached here (the caches diverged).
        """
        for h in hashes:
            blk = self._blocks.get(h)
            if blk is None:
                raise ValueError(f"evict_blocks(): block {h} is not cached here")
            if blk.refs:
                return False
        freed: list[int] = []
        for h in hashes:
            del self._lru[h]
            blk = self._blocks.pop(h)
            for p in blk.pages:
                del self._page_owner[p]
            freed.extend(blk.pages)
            self.evicted_blocks += 1
        if freed:
            self.allocator.free(freed)
        return True

    # -- allocation --------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor:
        """Allocate ``n`` pages, evicting least-recently-released unreferenced blocks if needed.

        Returns int64 [n]. Raises OutOfPagesError (evicting nothing) when free plus evictable
        pages are fewer than ``n``."""
        short = n - self.allocator.num_free
        if short > 0:
            if short > self.num_evictable_pages:
                raise OutOfPagesError(
                    f"alloc({n}): {self.allocator.num_free} free + "
                    f"{self.num_evictable_pages} evictable pages"
                )
            self.evict(short)
        return self.allocator.alloc(n)

    def evict(self, num_pages: int) -> int:
        """Evict unreferenced blocks (LRU first) until ``num_pages`` pages are freed or none are
        left. Returns the number of pages freed."""
        freed: list[int] = []
        while len(freed) < num_pages and self._lru:
            h, _ = self._lru.popitem(last=False)
            if self._evicted_log is not None:
                self._evicted_log.append(h)
            blk = self._blocks.pop(h)
            for p in blk.pages:
                del self._page_owner[p]
            freed.extend(blk.pages)
            self.evicted_blocks += 1
        if freed:
            self.allocator.free(freed)
        return len(freed)
