"""Prefix cache: refcounts, LRU eviction, and the hit path giving the same tokens as a cold run."""

from __future__ import annotations

import pytest
import torch

from pdplug_host.model import (
    ModelConfig,
    OutOfPagesError,
    PagedKVCache,
    TinyLlama,
    build_model,
    decode_step,
    greedy,
    pages_needed,
    prefill_chunk,
)
from pdplug_host.prefix_cache import PrefixCache
from pdplug_host.reference import reference_run
from pdplug_host.trace import TraceRequest, block_hash_chain, prompt_tokens

PS = 16


def _req(rid: int, hash_ids: list[int], input_len: int, output_len: int = 8) -> TraceRequest:
    return TraceRequest(
        rid=rid,
        arrival_ms=0.0,
        input_len=input_len,
        output_len=output_len,
        hash_ids=tuple(hash_ids),
        block_tokens=16,
        raw_input_length=input_len * 32,
        raw_output_length=output_len,
    )


def _pc(num_pages: int = 16, block_tokens: int = 16) -> tuple[PagedKVCache, PrefixCache]:
    cache = PagedKVCache(ModelConfig(num_layers=1), num_pages, PS)
    return cache, PrefixCache(cache, block_tokens, PS)


def test_rejects_blocks_not_whole_pages() -> None:
    cache = PagedKVCache(ModelConfig(num_layers=1), 4, PS)
    with pytest.raises(ValueError, match="multiple of page_size"):
        PrefixCache(cache, 8, PS)
    with pytest.raises(ValueError, match="multiple of page_size"):
        PrefixCache(cache, 24, PS)
    assert PrefixCache(cache, 32, PS).pages_per_block == 2


def test_match_insert_release_refcounts() -> None:
    cache, pc = _pc()
    chain = [11, 12, 13]
    assert pc.match(chain)[0] == 0
    pages = pc.alloc(4)  # 3 full blocks + partial
    assert pc.insert(chain, pages) == 3
    assert pc.insert(chain, pages) == 0  # idempotent
    assert [pc.refs(h) for h in chain] == [1, 1, 1]
    n, got = pc.match([11, 12, 99])
    assert n == 32 and got.tolist() == pages[:2].tolist() and got.dtype == torch.int64
    assert [pc.refs(h) for h in chain] == [2, 2, 1]
    assert pc.match(chain, max_tokens=47)[0] == 32  # only blocks fully within the limit
    pc.release(chain[:2], got)  # undo that match
    pc.release(chain[:2], got)  # and the max_tokens one
    free_before = cache.num_free
    pc.release(chain, pages)  # owner done: blocks stay cached, partial page freed
    assert [pc.refs(h) for h in chain] == [0, 0, 0]
    assert cache.num_free == free_before + 1 and pc.num_evictable_pages == 3
    with pytest.raises(ValueError, match="not referenced"):
        pc.release(chain, pages[:3])
    assert pc.match(chain)[0] == 48  # hit again after release
    assert pc.match(chain)[0] == 48
    assert pc.refs(11) == 2 and pc.num_evictable_pages == 0
    assert pc.hit_tokens == 32 + 32 + 48 + 48


def test_concurrent_duplicate_stays_private() -> None:
    cache, pc = _pc()
    a, b = pc.alloc(2), pc.alloc(2)
    assert pc.insert([1, 2], a) == 2
    assert pc.insert([1, 2], b) == 0  # same blocks computed twice: b keeps its own pages
    free = cache.num_free
    pc.release([1, 2], b)
    assert cache.num_free == free + 2 and pc.refs(1) == 1
    with pytest.raises(ValueError, match="already cached"):
        pc.insert([7], a[:1])


def test_lru_eviction_deepest_and_oldest_first() -> None:
    cache, pc = _pc(num_pages=6)
    a = pc.alloc(3)
    pc.insert([1, 2, 3], a)
    b = pc.alloc(3)
    pc.insert([4, 5, 6], b)
    pc.release([1, 2, 3], a)  # released first → evicted first, deepest block first
    pc.release([4, 5, 6], b)
    assert cache.num_free == 0
    pc.alloc(2)
    assert pc.refs(3) == -1 and pc.refs(2) == -1 and pc.refs(1) == 0
    assert pc.match([1, 2, 3])[0] == 16
    assert pc.evicted_blocks == 2
    # Referenced blocks are never evicted; a too-large request evicts nothing.
    with pytest.raises(OutOfPagesError):
        pc.alloc(4)
    assert pc.refs(4) == 0 and pc.num_blocks == 4
    assert pc.alloc(3).numel() == 3 and pc.refs(1) == 1 and pc.num_blocks == 1


def test_two_pages_per_block() -> None:
    _, pc = _pc(num_pages=8, block_tokens=32)
    pages = pc.alloc(5)  # 2 blocks of 2 pages + 1
    assert pc.insert([5, 6, 7], pages) == 2  # third block has no pages: skipped
    n, got = pc.match([5, 6, 7])
    assert n == 64 and got.tolist() == pages[:4].tolist()


def test_admit_takes_everything_or_nothing() -> None:
    cache, pc = _pc(num_pages=6)
    a = pc.alloc(3)
    pc.insert([1, 2, 3], a)
    pc.release([1, 2, 3], a)  # cached, evictable
    b = pc.alloc(3)  # referenced by a live request
    assert cache.num_free == 0 and pc.num_evictable_pages == 3
    # reuses 2 cached blocks, needs 3 more pages: only 1 evictable block besides its own hit
    assert pc.admit([1, 2, 9], 5) is None
    assert pc.refs(1) == 0 and pc.hit_tokens == 0 and pc.num_evictable_pages == 3  # untouched
    got = pc.admit([1, 2, 9], 3)
    assert got is not None
    hit, pages, evicted = got
    assert hit == 32 and pages.tolist() == [*a[:2].tolist(), a[2].item()]
    assert evicted == [3] and pc.refs(3) == -1  # the only unreferenced block not matched
    pc.release([1, 2, 9], pages)
    pc.release([], b)
    assert pc.admit([7], 6) is not None  # everything evictable: fits


def test_followers_evict_exactly_the_leaders_blocks_once_released() -> None:
    lead_cache, lead = _pc(num_pages=4)
    _, follow = _pc(num_pages=4)
    for pc in (lead, follow):
        p = pc.alloc(2)
        pc.insert([1, 2], p)
        pc.release([1, 2], p)
    live = follow.match([1])[1]  # this rank still uses block 1 (its release comes later)
    got = lead.admit([5], 4)
    assert got is not None and got[2] == [2, 1] and lead_cache.num_free == 0  # deepest first
    assert follow.evict_blocks(got[2]) is False  # block 1 still referenced here: wait
    assert follow.refs(1) == 1 and follow.refs(2) == 0  # nothing evicted meanwhile
    follow.release([1], live)
    assert follow.evict_blocks(got[2]) is True
    assert follow.num_blocks == 0 and follow.evicted_blocks == 2
    with pytest.raises(ValueError, match="not cached here"):
        follow.evict_blocks([3])


# -- hit path through the model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return build_model()


def _serve(
    model: TinyLlama, pc: PrefixCache, cache: PagedKVCache, req: TraceRequest, chunk: int
) -> tuple[list[int], int]:
    """Prefill with prefix reuse (suffix only, in chunks), then decode; returns (tokens, hit)."""
    ids = torch.from_numpy(prompt_tokens(req))
    chain = block_hash_chain(req)
    hit, pages = pc.match(chain, max_tokens=req.input_len - 1)
    need = pages_needed(req.input_len + req.output_len - 1, PS)
    pages = torch.cat([pages, pc.alloc(need - pages.numel())])
    for start in range(hit, req.input_len, chunk):
        logits = prefill_chunk(model, cache, ids[start : start + chunk], pages, start)
        pc.insert(chain[: min(req.input_len, start + chunk) // req.block_tokens], pages)
    out = [int(greedy(logits))]
    while len(out) < req.output_len:
        pos = req.input_len + len(out) - 1
        out.append(int(greedy(decode_step(model, cache, torch.tensor(out[-1:]), [pages], [pos]))))
    pc.release(chain, pages)
    return out, hit


def test_prefix_hit_path_equals_cold_run(model: TinyLlama) -> None:
    reqs = [
        _req(0, [1, 2, 3, 4, 5], 75),
        _req(1, [1, 2, 3, 9, 10, 11], 90),  # shares 3 blocks with req 0
        _req(2, [1, 2, 3, 4, 5], 80),  # 4 blocks cached by req 0; computes block 5
        _req(3, [1, 2, 3, 4], 64),  # full hit but exactly 4 blocks: recomputes the last block
        _req(4, [1, 2, 77], 40),  # diverges after block 2
    ]
    cold = reference_run(reqs, model=model)
    cache = PagedKVCache(model.config, 40, PS)
    pc = PrefixCache(cache, 16, PS)
    hits = {}
    for r in reqs:
        toks, hits[r.rid] = _serve(model, pc, cache, r, chunk=24)
        assert toks == cold[r.rid], f"request {r.rid}"
    assert hits == {0: 0, 1: 48, 2: 64, 3: 48, 4: 32}
    assert pc.refs(block_hash_chain(reqs[0])[0]) == 0  # everything released
    assert cache.num_free + pc.num_evictable_pages == 40


def test_prefix_hits_survive_eviction_pressure(model: TinyLlama) -> None:
    # A cache too small to keep everything: eviction must never hand out pages still in use,
    # and reused blocks must still produce cold-run tokens.
    reqs = [_req(i, [100 + i % 3, 200 + i, 300 + i], 40, output_len=4) for i in range(8)]
    cold = reference_run(reqs, model=model)
    cache = PagedKVCache(model.config, 7, PS)
    pc = PrefixCache(cache, 16, PS)
    for r in reqs:
        toks, _ = _serve(model, pc, cache, r, chunk=16)
        assert toks == cold[r.rid], f"request {r.rid}"
    assert pc.evicted_blocks > 0 and pc.hit_tokens > 0
