"""Whole-segment packing on CPU: ``TorchPacker.pack_all`` vs per-rank packs vs a numpy
reference, overlapping plans refused, ``pack_segment``, and the launch-table cache of the
Triton packer (pure numpy: no triton needed) — a cached table equals a fresh one and still
range-checks every token offset."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug import KVLayout
from pdplug.geometry import make_layout
from pdplug.packing import group_rows, pack_groups, pack_regions, pack_segment
from pdplug.types import SendChunk, TransferPlan
from pdplug_dcp.packers import TorchPacker
from pdplug_dcp.planner import make_dcp_planner
from pdplug_dcp.tables import META, LaunchTables

POISON = 0xA5


def _layouts(kind: str, dcp: int) -> tuple[KVLayout, KVLayout]:
    if kind == "mla":
        mk = dict(kind="mla", page_size=8, num_layers=5, head_bytes=656)
        return make_layout(**mk), make_layout(**mk, dcp_size=dcp)
    if kind == "rows":
        return (KVLayout(page_size=4, entry_bytes_per_token=(8, 24, 40)),
                KVLayout(page_size=4, entry_bytes_per_token=(8, 24, 40), dcp_size=dcp))  # fmt: skip
    mk = dict(kind=kind, page_size=8, num_layers=2, head_bytes=32, num_kv_heads=4)
    return make_layout(**mk), make_layout(**mk, tp_size=2, dcp_size=dcp)


def _segment(rng: np.random.Generator, kind: str, dcp: int, tokens: int):
    src, dst = _layouts(kind, dcp)
    p = src.page_size
    pool = 3 * -(-tokens // p)
    regions = pack_regions(src, dst_dcp_size=dcp, depth=2, region_tokens=-(-tokens // dcp) + p)
    chunk = SendChunk(
        room=1, src_pages=rng.permutation(pool)[: -(-tokens // p)].astype(np.int64),
        dst_pages=np.arange(-(-tokens // (dst.page_size * dcp)), dtype=np.int64),
        num_tokens=tokens,
    )  # fmt: skip
    plans = make_dcp_planner().plan_all(chunk, src, dst, [regions[2 * r] for r in range(dcp)])
    raw = [rng.integers(0, 256, pool * src.entry(e).page_stride, dtype=np.uint8)
           for e in range(src.num_entries)]  # fmt: skip
    size = regions[-1].offset + regions[-1].nbytes
    return plans, raw, size


def _reference(plans: list[TransferPlan], raw: list[np.ndarray], size: int) -> np.ndarray:
    out = np.full(size, POISON, dtype=np.uint8)
    for pl in plans:
        for g in pack_groups(pl) if pl.packed else ():
            idx = group_rows(g)[:, None] + np.arange(g.row_bytes)
            for e, off in zip(g.entries, np.asarray(g.offsets).tolist()):
                out[off : off + idx.size] = raw[e][idx].reshape(-1)
    return out


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["mla", "hnd", "nhd", "rows"]),
    dcp=st.integers(1, 4),
    tokens=st.integers(1, 90),
    threads=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_torch_pack_all_matches_per_rank_packs_and_reference(kind, dcp, tokens, threads, seed):
    rng = np.random.default_rng(seed)
    plans, raw, size = _segment(rng, kind, dcp, tokens)
    entries = [torch.from_numpy(r) for r in raw]
    want = _reference(plans, raw, size)
    one = torch.full((size,), POISON, dtype=torch.uint8)
    TorchPacker(threads).pack_all(plans, entries, one)
    each = torch.full((size,), POISON, dtype=torch.uint8)
    for pl in plans:
        TorchPacker(threads).pack(pl, entries, each)
    assert np.array_equal(one.numpy(), want)
    assert np.array_equal(each.numpy(), want)


def test_plans_of_one_segment_must_not_overlap() -> None:
    plans, raw, size = _segment(np.random.default_rng(0), "mla", 2, 40)
    entries = [torch.from_numpy(r) for r in raw]
    buf = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"plans 0 and 2 of one segment write overlapping"):
        TorchPacker().pack_all([plans[0], plans[1], plans[0]], entries, buf)
    with pytest.raises(ValueError, match=r"plans 0 and 1 of one segment write overlapping"):
        LaunchTables().build([plans[0], plans[0]], entries, buf)


def test_pack_segment_uses_pack_all_when_the_packer_has_it() -> None:
    calls: list[str] = []

    class PerPlan:
        def pack(self, plan, entries, buf):  # type: ignore[no-untyped-def]
            calls.append("pack")

    class Whole(PerPlan):
        def pack_all(self, plans, entries, buf):  # type: ignore[no-untyped-def]
            calls.append(f"pack_all {len(plans)}")

    plans, _raw, size = _segment(np.random.default_rng(1), "hnd", 3, 30)
    buf = torch.zeros(size, dtype=torch.uint8)
    pack_segment(PerPlan(), plans, [], buf)
    pack_segment(Whole(), plans, [], buf)
    assert calls == ["pack"] * 3 + ["pack_all 3"]


def test_cached_launch_table_equals_a_fresh_one_and_checks_tokens() -> None:
    rng = np.random.default_rng(2)
    plans, raw, size = _segment(rng, "hnd", 4, 77)
    entries = [torch.from_numpy(r) for r in raw]
    buf = torch.zeros(size, dtype=torch.uint8)
    tables = LaunchTables()
    first = tables.build(plans, entries, buf)
    again = tables.build(plans, entries, buf)
    assert first is not None and again is not None
    assert (tables.misses, tables.hits) == (1, 1) and again.cached and not first.cached
    assert np.array_equal(first.table, again.table)
    assert first.gathers == sum(len(g.entries) for pl in plans for g in pl.pack_groups)
    assert first.grid[1] == first.gathers
    assert first.nbytes == sum(pl.num_tokens * sum(pl.pack_row_bytes) for pl in plans)
    # the same shape with other token offsets (the next segment): a hit, the new offsets
    other = [
        msgspec.structs.replace(pl, pack_groups=tuple(
            msgspec.structs.replace(g, tokens=np.asarray(g.tokens)[::-1].copy())
            for g in pl.pack_groups))
        for pl in plans
    ]  # fmt: skip
    hit = tables.build(other, entries, buf)
    fresh = LaunchTables().build(other, entries, buf)
    assert hit is not None and fresh is not None and hit.cached
    assert np.array_equal(hit.table, fresh.table)
    e = first.gathers
    tok0 = int(first.table[4])  # meta row 0, field 4: where gather 0's tokens start
    n0 = plans[0].num_tokens
    want = np.asarray(plans[0].pack_groups[0].tokens)[::-1]
    assert tok0 >= META * e and np.array_equal(hit.table[tok0 : tok0 + n0], want)
    # a token offset past its entry on a cached shape is refused, named by check_pack
    g = plans[1].pack_groups[0]
    tok = np.array(g.tokens)
    tok[0] = -1
    bad = msgspec.structs.replace(plans[1], pack_groups=(msgspec.structs.replace(g, tokens=tok),))
    with pytest.raises(ValueError, match=r"source rows span bytes \[-"):
        tables.build([plans[0], bad, *plans[2:]], entries, buf)
    assert tables.hits == 3
    # another pack buffer starts the cache over
    tables.build(plans, entries, torch.zeros(size, dtype=torch.uint8))
    assert len(tables._templates) == 1


def test_launch_table_checks_like_check_pack() -> None:
    plans, raw, size = _segment(np.random.default_rng(3), "mla", 2, 33)
    entries = [torch.from_numpy(r) for r in raw]
    buf = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        LaunchTables().build(plans, entries, buf[:100])
    with pytest.raises(ValueError, match=r"holds only 64 bytes"):
        LaunchTables().build(plans, [torch.zeros(64, dtype=torch.uint8)] * len(entries), buf)
    with pytest.raises(ValueError, match="pack entry 4 outside the 4 KV entries given"):
        LaunchTables().build(plans, entries[:4], buf)
    with pytest.raises(ValueError, match="pack_buffer must be uint8"):
        LaunchTables().build(plans, entries, buf.view(torch.int16))
    assert LaunchTables().build([], entries, buf) is None


def test_groups_with_writeable_offsets_are_not_cached() -> None:
    """An id names the content only for read-only offsets (the planner's): a caller moving a
    block by writing its offsets array in place gets a fresh table every time."""
    plans, raw, size = _segment(np.random.default_rng(4), "mla", 2, 24)
    entries = [torch.from_numpy(r) for r in raw]
    buf = torch.zeros(size + 64, dtype=torch.uint8)
    g = plans[0].pack_groups[0]
    offs = np.array(g.offsets)  # writeable copy
    pl = msgspec.structs.replace(plans[0], pack_groups=(msgspec.structs.replace(g, offsets=offs),))
    tables = LaunchTables()
    a = tables.build([pl], entries, buf)
    offs += 8  # the same array object, blocks 8 bytes further
    b = tables.build([pl], entries, buf)
    assert a is not None and b is not None and (tables.hits, tables.misses) == (0, 2)
    e = a.gathers
    assert (b.table[: META * e].reshape(e, META)[:, 2] * b.word_bytes
            == a.table[: META * e].reshape(e, META)[:, 2] * a.word_bytes + 8).all()  # fmt: skip
