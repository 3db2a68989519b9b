"""The send path's shortcuts (issue 24), each against the bytes that land: a write the engine
reports ended inside its post call (``done_at_post``) completes at once (its room turns
``Success`` before ``send`` returns, the session never asks the engine about it again, its
handle is released); a page-aligned segment of the commonest pair is posted from the planner's
direct template instead of a plan, straight from ``send`` once the template is bound (the direct
lane), by page ids into the engine's prepared lists."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _rig import Decode, Prefill, exact, expected, rendezvous, send_room

from pdplug import KVPoll, PluginManager
from pdplug.testing import require

P = 16


class _EndsAtPost:
    """Wraps the real NIXL engine: ``post`` returns only once the write has ended (its own
    status calls), and says so through ``done_at_post``; asking about such a write again
    fails the test."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.notifications = inner.notifications
        self.ended: set[int] = set()
        self.released: set[int] = set()
        self.asked_again: list[int] = []
        self.kept: list[Any] = []

    def post(self, peer: Any, src: Any, dst: Any, length: Any, tag: bytes) -> Any:
        h = self.inner.post(peer, src, dst, length, tag)
        while self.inner.check(h) == "PROC":
            self.inner.progress()
        assert self.inner.check(h) == "DONE"
        self.ended.add(id(h))
        self.kept.append(h)  # alive, so no later handle reuses its id
        return h

    def done_at_post(self, xfer: Any) -> bool:
        return id(xfer) in self.ended

    def check(self, xfer: Any) -> str:
        if id(xfer) in self.ended:
            self.asked_again.append(id(xfer))
        return str(self.inner.check(xfer))

    def release(self, xfer: Any) -> None:
        self.released.add(id(xfer))
        self.inner.release(xfer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_pages(self, peer: Any, grid: Any) -> None:
        """No page lists: every write goes through :meth:`post`, which this wrapper changes."""
        return None


def test_a_write_ended_at_post_completes_in_send_and_is_never_polled() -> None:
    require("nixl")
    pm = PluginManager()
    with rendezvous() as server:
        pre = Prefill(pm, "nixl", server.endpoint, pp=1)
        dec = Decode(pm, "nixl", server.endpoint, dcp=1)
        try:
            sender = pre.senders[0]
            eng = _EndsAtPost(sender.engine)
            sender.engine = eng
            rng = np.random.default_rng(7)
            for room, total in ((1, 5 * P + 3), (2, P)):  # a partial last page, one page
                sp = rng.permutation(64)[:8].astype(np.int64)
                dp = rng.permutation(96)[:8].astype(np.int64)
                dec.recvs[0].expect(room, dp, num_tokens=total)
                sender.start(room)
                send_room(pre, room, sp)
                # ended inside the post call: Success before any poll reaped anything
                assert sender.rooms.status(room) == KVPoll.Success, sender.failure_reason(room)
                want = expected(pre, dec, total, 0, sp, [dp])
                for _ in range(500):
                    if dec.recvs[0].poll(room) in (KVPoll.Success, KVPoll.Failed):
                        break
                    time.sleep(0.01)
                assert dec.recvs[0].poll(room) == KVPoll.Success
                assert exact(dec, want, [dp])
                assert sender.wait(room, timeout_s=1.0) == KVPoll.Success
            assert eng.ended and not eng.asked_again
            assert eng.released == eng.ended  # every handle went back to the engine
            st = sender.stats()
            assert st["xfers"] == 0 and st["posts"] == len(eng.ended)
            # two entry classes (64 and 48 B per token): planned, no direct template
            assert st.get("direct_plans", 0) == 0, st
        finally:
            dec.close()
            pre.close()


@contextlib.contextmanager
def _direct_pair(backend: str) -> Iterator[tuple[Any, Any, list[Any], list[Any]]]:
    """A sender and a receiver of one class of whole rows (3 entries of 32 B per token, page
    ``P``, 64 pages each side, no DCP: the commonest pair), registered and connected:
    ``(sender, receiver, source tensors, destination tensors)``."""
    require(backend)
    import torch

    from pdplug import KVConfig, KVLayout
    from pdplug.bootstrap import resolve

    lay = KVLayout(page_size=P, entry_bytes_per_token=(32, 32, 32), dtype="uint8")
    pm = PluginManager()
    with rendezvous() as server:
        cfg = dict(bootstrap_endpoint=server.endpoint, bootstrap_timeout_s=20.0,
                   waiting_timeout_s=20.0, transfer_timeout_s=5.0)  # fmt: skip
        sender = pm.make_kv_sender(
            KVConfig(instance="p", role="prefill", layout=lay, pack_region_tokens=P, **cfg),
            name=backend,
        )
        recv = pm.make_kv_receiver(KVConfig(instance="d", role="decode", layout=lay, **cfg),
                                   name=backend)  # fmt: skip
        src = [torch.randint(0, 256, (64 * P, 32), dtype=torch.uint8) for _ in range(3)]
        dst = [torch.zeros((64 * P, 32), dtype=torch.uint8) for _ in range(3)]
        try:
            sender.register_kv(src)
            recv.register_kv(dst)
            recv.connect(resolve(server.endpoint, "p", timeout_s=20))
            yield sender, recv, src, dst
        finally:
            recv.close()
            sender.close()


def _landed(src: list[Any], dst: list[Any], sp: np.ndarray, dp: np.ndarray, total: int) -> bool:
    """Whether tokens ``[0, total)`` of source pages ``sp`` sit in destination pages ``dp``."""
    tok = np.arange(total)
    s_rows = sp[tok // P] * P + tok % P
    d_rows = dp[tok // P] * P + tok % P
    return all(np.array_equal(d.numpy()[d_rows], s.numpy()[s_rows]) for s, d in zip(src, dst))


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_sends_of_the_commonest_pair_take_the_direct_template_and_land_exactly(
    backend: str,
) -> None:
    """One class of whole rows, equal page sizes, no DCP: a page-aligned segment is posted
    from the planner's direct template (``stats()["direct_plans"]``), a segment that starts
    inside a page is planned as before, and every byte lands where the reference says."""
    from pdplug.types import Segment

    rng = np.random.default_rng(11)
    with _direct_pair(backend) as (sender, recv, src, dst):
        total, room = 5 * P + 7, 42
        sp = rng.permutation(64)[:6].astype(np.int64)
        dp = rng.permutation(64)[:6].astype(np.int64)
        recv.expect(room, dp, num_tokens=total)
        sender.start(room)
        assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
        # [0, 2P) aligned, [2P, 2P + 5) aligned, [2P + 5, total) starts inside a page
        cuts = [(0, 2 * P), (2 * P, 2 * P + 5), (2 * P + 5, total)]
        for i, (a, b) in enumerate(cuts):
            seg = Segment(token_start=a, token_end=b, page_start=a // P, num_tokens=b - a,
                          chunk_id=i, is_last=i == len(cuts) - 1)  # fmt: skip
            sender.send(room, seg, sp[a // P :])
        assert sender.wait(room, timeout_s=10) == KVPoll.Success, sender.failure_reason(room)
        assert recv.wait(room, timeout_s=10) == KVPoll.Success, recv.failure_reason(room)
        assert _landed(src, dst, sp, dp, total)
        st = sender.stats()
        assert st["direct_plans"] == 2 and st["posts"] == 3, st
        # the first binds the template on the general path, the second takes the lane;
        # both by page ids (NIXL: into its prepared lists; the second's last page a 5-token
        # tail)
        pages = "engine_grid_xfer" if backend == "nixl" else "engine_page_posts"
        assert st["direct_lane"] == 1 and st[pages] == 2, st


class _PagesSeen:
    """Wraps a real engine, forwarding every other attribute to it, and records the kinds of
    page ids its own ``post_pages`` gets, which reads them as int64 arrays only (``.shape``,
    ``.dtype``), as an engine (or a wrapper) written before lists did: the real engine's
    ``page_id_lists``, reached through the forwarding, is not this class's declaration
    (helper-32's find)."""

    declares = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: list[tuple[type, type]] = []

    def post_pages(self, peer: Any, lists: Any, sp: Any, dp: Any, last: int, tag: bytes) -> Any:
        self.seen.append((type(sp), type(dp)))
        if not self.declares:
            assert sp.dtype == np.int64 and dp.dtype == np.int64 and sp.shape == dp.shape
        return self.inner.post_pages(peer, lists, sp, dp, last, tag)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _PagesSeenLists(_PagesSeen):
    """:class:`_PagesSeen` that declares it takes lists."""

    declares = True
    page_id_lists = True


@pytest.mark.parametrize("declares", [True, False])
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_short_sends_hand_the_engine_page_id_lists_only_when_it_takes_them(
    backend: str, declares: bool
) -> None:
    """A short send's page ids (an int64 array or a list of Python ints from the host) reach
    ``post_pages`` as lists of Python ints when the engine declares ``page_id_lists`` (no numpy
    operation on the way), as int64 arrays otherwise; ids the short lane does not take (an int32
    array) go as an array; every byte lands where the reference says, and the host's lists stay
    as given."""
    from pdplug.types import Segment

    rng = np.random.default_rng(5)
    with _direct_pair(backend) as (sender, recv, src, dst):
        eng = (_PagesSeenLists if declares else _PagesSeen)(sender.engine)
        sender.engine = eng
        for room, n_pages, kind in (
            (1, 2, "int64"),
            (2, 6, "list"),
            (3, 64, "int64"),
            (4, 5, "int32"),
        ):
            total = n_pages * P - 3  # a partial last page: the tail lists
            sp = rng.permutation(64)[:n_pages].astype(np.int64)
            dp = rng.permutation(64)[:n_pages].astype(np.int64)
            recv.expect(room, dp, num_tokens=total)
            sender.start(room)
            assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
            # the first send binds the template on the planned path; the next ones take the lane
            seg = Segment(token_start=0, token_end=total, page_start=0, num_tokens=total,
                          chunk_id=0, is_last=True)  # fmt: skip
            given: Any = sp.tolist() if kind == "list" else sp.astype(kind)
            sender.send(room, seg, given)
            assert sender.wait(room, timeout_s=10) == KVPoll.Success, sender.failure_reason(room)
            assert recv.wait(room, timeout_s=10) == KVPoll.Success, recv.failure_reason(room)
            assert _landed(src, dst, sp, dp, total)
            assert list(given) == sp.tolist()
        lists, arrays = (list, list), (np.ndarray, np.ndarray)
        # room 1 binds the template and posts from the planned path (arrays); rooms 2 and 3
        # take the lane with short ids; room 4's int32 ids are converted by page_ids (an array;
        # its destination ids, kept as a list since the bootstrap, stay one)
        want = [lists] * 2 + [(np.ndarray, list)] if declares else [arrays] * 3
        assert eng.seen == [arrays, *want], eng.seen
        assert sender.stats()["direct_lane"] == 3


def test_a_send_checks_its_pages_and_segment_and_waits_for_a_busy_engine() -> None:
    """``KVSender.send`` with an int64 page array, no ready marker: an id below 0 or past the
    registered pages is refused by name, in a short list and past the check's list bound
    alike, and the room is untouched; so is a segment whose fields disagree; a send while a
    round holds the engine lock is posted once it is free; a page list that is not an int64
    array takes the general checks; every byte lands."""
    import threading

    from pdplug.packing import pages as pagesmod
    from pdplug.types import Segment

    with _direct_pair("nixl") as (sender, recv, src, dst):
        rooms = {1: (2 * P, 0), 2: (3 * P + 5, 10), 3: (P, 20)}
        for room, (total, first) in rooms.items():
            recv.expect(room, np.arange(first, first + 4, dtype=np.int64), num_tokens=total)
            sender.start(room)
            assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput

        def seg(total: int, i: int = 0) -> Segment:
            return Segment(token_start=0, token_end=total, page_start=0, num_tokens=total,
                           chunk_id=i, is_last=True)  # fmt: skip

        long = np.zeros(pagesmod.SHORT_IDS + 1, dtype=np.int64)
        for bad, page in ((np.array([3, -1], dtype=np.int64), -1),
                          (np.array([3, 64], dtype=np.int64), 64)):  # fmt: skip
            with pytest.raises(ValueError, match=f"src_pages has page {page}, outside"):
                sender.send(1, seg(2 * P), bad)
            long[-1] = page
            with pytest.raises(ValueError, match=f"src_pages has page {page}, outside"):
                sender.send(1, seg(2 * P), long)
        # a segment whose fields disagree (num_tokens would decide the tokens written)
        for bad_seg, what in (
            (Segment(token_start=0, token_end=2 * P, page_start=0, num_tokens=10, chunk_id=0,
                     is_last=True), f"num_tokens=10 but token_end - token_start = {2 * P}"),
            (seg(2 * P, -1), "chunk_id=-1 must be >= 0"),
            (Segment(token_start=0, token_end=0, page_start=0, num_tokens=0, chunk_id=0,
                     is_last=False), "holds no token but is not the last one"),
            # msgspec does not check field types: each went out in the tag unmatched
            (Segment(token_start=0, token_end=2 * P, page_start=0, num_tokens=2 * P,
                     chunk_id=False, is_last=True), "chunk_id must be an int, got bool False"),
            (Segment(token_start=0, token_end=2 * P, page_start=0, num_tokens=2 * P,
                     chunk_id=np.int64(0), is_last=True), "chunk_id must be an int, got int64"),
            (Segment(token_start=0, token_end=2.0 * P, page_start=0, num_tokens=2 * P,
                     chunk_id=0, is_last=True), "token_end must be an int, got float"),
            (Segment(token_start=0, token_end=2 * P, page_start=0, num_tokens=2 * P,
                     chunk_id=0, is_last=1), "is_last must be a bool, got int 1"),
        ):  # fmt: skip
            for pages in (np.array([5, 9], dtype=np.int64), [5, 9]):  # an int64 array, a list
                with pytest.raises(ValueError, match=what):
                    sender.send(1, bad_seg, pages)
        # too few pages for the segment's tokens (it used to fail the room later, both sides)
        for short in (np.array([5], dtype=np.int64), [], np.zeros(0, dtype=np.int64)):
            want = f"src_pages holds {len(short)} pages but segment tokens \\[0, {2 * P}\\) span 2"
            with pytest.raises(ValueError, match=want):
                sender.send(1, seg(2 * P), short)
        assert sender.poll(1) == KVPoll.WaitingForInput  # nothing was counted
        sp = {1: np.array([5, 9], dtype=np.int64), 2: np.array([7, 1, 30, 2], dtype=np.int64),
              3: [44]}  # fmt: skip
        held, go = threading.Event(), threading.Event()

        def round_in_progress() -> None:
            with sender._loop.lock:  # what a round of the loop thread holds
                held.set()
                go.wait(5)

        t = threading.Thread(target=round_in_progress)
        t.start()
        held.wait(5)
        sender.send(2, seg(3 * P + 5), sp[2])  # engine busy: handed to the loop thread
        go.set()
        t.join()
        sender.send(1, seg(2 * P), sp[1])
        sender.send(3, seg(P), sp[3])  # a list: the general checks
        for room, (total, first) in rooms.items():
            assert sender.wait(room, timeout_s=10) == KVPoll.Success, sender.failure_reason(room)
            assert recv.wait(room, timeout_s=10) == KVPoll.Success, recv.failure_reason(room)
            dp = np.arange(first, first + 4, dtype=np.int64)
            assert _landed(src, dst, np.asarray(sp[room], dtype=np.int64), dp, total)


def test_segments_go_in_chunk_order_and_nothing_follows_the_last() -> None:
    """A gap, a repeat or a segment after the last is refused by name with the room unchanged
    (the decode completes a room only with chunks ``0..last`` and drops what follows the last:
    each used to leave the prefill ``Success`` and the decode waiting until its timeout); the
    segments sent in order then complete both sides with every byte in place."""
    import threading

    from pdplug.types import Segment

    def seg(i: int, a: int, b: int, last: bool) -> Segment:
        return Segment(token_start=a, token_end=b, page_start=a // P, num_tokens=b - a,
                       chunk_id=i, is_last=last)  # fmt: skip

    with _direct_pair("nixl") as (sender, recv, src, dst):
        room, total = 5, 3 * P
        sp = np.array([9, 3, 17], dtype=np.int64)
        dp = np.array([4, 40, 11], dtype=np.int64)
        recv.expect(room, dp, num_tokens=total)
        sender.start(room)
        assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
        with pytest.raises(ValueError, match="chunk_id=1 out of order: no segment sent so far"):
            sender.send(room, seg(1, P, total, True), sp[1:])
        assert sender.poll(room) == KVPoll.WaitingForInput
        sender.send(room, seg(0, 0, P, False), sp)
        for bad in (seg(0, 0, P, False), seg(2, 2 * P, total, True)):  # a repeat, a gap
            with pytest.raises(
                ValueError,
                match=f"chunk_id={bad.chunk_id} out of order: "
                "chunk_id 0..0 sent so far, so the next one is chunk_id=1",
            ):
                sender.send(room, bad, sp[bad.page_start :])
        # a token gap after chunk 0 (tokens [P, P + 5) never written, both sides Success) and
        # an overlap: refused, the room unchanged
        for start in (P + 5, P - 1):
            with pytest.raises(
                ValueError,
                match=f"chunk_id=1 starts at token_start={start} but chunk_id=0 ended at "
                f"token {P}: segments must follow each other",
            ):
                sender.send(room, seg(1, start, total, True), sp[start // P :])
        with pytest.raises(TypeError, match="send_many: item 0 must be \\(room, segment, "):
            sender.send_many([(room, seg(1, P, total, True))])
        for item in (seg(1, P, total, True), "room"):  # not a tuple: named, nothing sent
            with pytest.raises(
                TypeError,
                match=f"send_many: item 0 must be .* got {type(item).__name__}$",
            ):
                sender.send_many([item])
        with pytest.raises(TypeError, match=r"send_many: sends must be a sequence .* got NoneType"):
            sender.send_many(None)  # type: ignore[arg-type]
        # a set has no order (a room's segments go in chunk_id order): refused, even empty
        for unordered in (set, frozenset):
            with pytest.raises(
                TypeError, match=f"sends must be a sequence .* got {unordered.__name__}$"
            ):
                sender.send_many(unordered())
        # an item's own error names the item (the ones before it are sent)
        with pytest.raises(ValueError, match=r"^KVSender.send_many: item 0: room .* out of order"):
            sender.send_many([(room, seg(2, P, total, True), sp[1:])])
        for bad_room in (True, float(room), str(room), -1, 2**63):  # True: room 1, 2.0: room 2
            with pytest.raises(
                ValueError,
                match=re.escape(f"KVSender.send: room={bad_room!r} must be an int in [0, 2**63)"),
            ):
                sender.send(bad_room, seg(1, P, total, True), sp[1:])  # type: ignore[arg-type]
        held, go = threading.Event(), threading.Event()

        def round_in_progress() -> None:
            with sender._loop.lock:  # the last segment stays pending while a round holds it
                held.set()
                go.wait(5)

        t = threading.Thread(target=round_in_progress)
        t.start()
        try:
            held.wait(5)
            sender.send(room, seg(1, P, total, True), sp[1:])
            with pytest.raises(
                ValueError, match="chunk_id=2 comes after the room's last segment \\(chunk_id=1\\)"
            ):
                sender.send(room, seg(2, total, total, True), sp[3:])
        finally:
            go.set()
            t.join()
        assert sender.wait(room, timeout_s=10) == KVPoll.Success, sender.failure_reason(room)
        assert recv.wait(room, timeout_s=10) == KVPoll.Success, recv.failure_reason(room)
        assert _landed(src, dst, sp, dp, total)
        assert sender.stats()["posts"] == 2


def test_room_ids_are_python_ints_on_both_sides() -> None:
    """``True`` or ``2.0`` as a room aliased room 1 or 2 (equal dict keys) and went out as a
    bool or float in the chunk tags: the prefill said ``Success`` while the decode dropped the
    tags and waited; a NumPy integer room could not be encoded on the engine thread. Both are
    refused or converted where the room is leased, named."""
    from pdplug.types import Segment

    whole = Segment(token_start=0, token_end=P, page_start=0, num_tokens=P, chunk_id=0,
                    is_last=True)  # fmt: skip
    with _direct_pair("nixl") as (sender, recv, src, dst):
        for bad in (True, 2.0, "2", -1, 2**63):
            for call in (sender.start, lambda r: recv.expect(r, np.array([4]), num_tokens=P)):
                with pytest.raises(ValueError, match=re.escape(f"room={bad!r} must be an int")):
                    call(bad)
            with pytest.raises(ValueError, match=re.escape(f"room={bad!r} must be an int")):
                recv.decline(bad, "no pages")
            for side in (sender, recv):  # True would abort or clear room 1
                for call in (side.abort, side.clear):
                    with pytest.raises(ValueError, match=re.escape(f"room={bad!r} must be")):
                        call(bad)
        assert not sender.rooms and not recv.rooms  # nothing leased
        recv.expect(3, np.array([5]), num_tokens=P)
        sender.start(3)
        assert sender.wait(3, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
        for not_a_segment in (None, {"chunk_id": 0}, (0, P, 0, P, 0, True)):
            with pytest.raises(ValueError, match="segment must be a pdplug Segment, got"):
                sender.send(3, not_a_segment, np.array([9]))  # type: ignore[arg-type]
        sender.abort(3)
        sp, dp = np.array([9], dtype=np.int64), np.array([4], dtype=np.int64)
        recv.expect(np.int64(2), dp, num_tokens=P)
        sender.start(np.uint16(2))
        assert sender.wait(2, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
        sender.send(np.int32(2), whole, sp)
        assert sender.wait(2, timeout_s=10) == KVPoll.Success, sender.failure_reason(2)
        assert recv.wait(2, timeout_s=10) == KVPoll.Success, recv.failure_reason(2)
        assert _landed(src, dst, sp, dp, P)


def test_a_first_segment_that_starts_after_the_decodes_prefix_fails_both_sides() -> None:
    """The decode's KV starts at its ``decode_prefix_len``: a first segment starting later
    used to complete both sides with the tokens before it never written; now the room fails on
    both sides naming the span."""
    from pdplug.types import Segment

    with _direct_pair("nixl") as (sender, recv, _src, _dst):
        room = 9
        recv.expect(room, np.array([2, 6], dtype=np.int64), num_tokens=2 * P)
        sender.start(room)
        assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
        seg = Segment(token_start=5, token_end=2 * P, page_start=0, num_tokens=2 * P - 5,
                      chunk_id=0, is_last=True)  # fmt: skip
        sender.send(room, seg, np.array([3, 4], dtype=np.int64))
        assert sender.wait(room, timeout_s=10) == KVPoll.Failed
        assert recv.wait(room, timeout_s=10) == KVPoll.Failed
        why = sender.failure_reason(room) or ""
        assert "first segment starts at token 5" in why and "tokens [0, 5)" in why, why


def test_a_segment_whose_ready_marker_completes_after_abort_is_never_posted() -> None:
    """``abort()`` fails the room's engine-side lease before it returns when the engine is
    free: a host that reaps right after (``wait``) used to post a parked segment whose ready
    marker had just completed into the aborted room (its bytes landing in decode pages of a
    ``Failed`` room) before the loop thread took the abort."""
    from pdplug.types import Segment

    class Marker:
        done = False

        def query(self) -> bool:
            return self.done

    with _direct_pair("nixl") as (sender, recv, _src, dst):
        before = [d.clone() for d in dst]
        for room in range(20):
            dp = np.arange(4 * (room % 8), 4 * (room % 8) + 2, dtype=np.int64)
            recv.expect(room, dp, num_tokens=2 * P)
            sender.start(room)
            assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
            ready = Marker()
            seg = Segment(token_start=0, token_end=2 * P, page_start=0, num_tokens=2 * P,
                          chunk_id=0, is_last=True)  # fmt: skip
            sender.send(room, seg, np.array([3, 5], dtype=np.int64), ready)
            sender.abort(room)
            ready.done = True
            assert sender.wait(room, timeout_s=2) == KVPoll.Failed
            assert sender.drained(room)
        assert sender.stats().get("posts", 0) == 0
        assert all(torch_equal(a, b) for a, b in zip(before, dst))
        for room in range(20):
            assert recv.wait(room, timeout_s=10) == KVPoll.Failed, recv.failure_reason(room)


def torch_equal(a: Any, b: Any) -> bool:
    return bool((a == b).all())


def test_mooncake_page_posts_refuse_bad_sizes_and_leave_long_writes_to_addresses() -> None:
    """``post_pages`` names a bad last-page size, and returns ``None`` (the session posts the
    addresses it computes) for a write of more runs than it builds as Python ints."""
    require("mooncake")
    from pdplug import KVConfig, KVLayout
    from pdplug.types import PageGrid
    from pdplug_mooncake.engine import SHORT_RUNS, MooncakeEngine

    lay = KVLayout(page_size=P, entry_bytes_per_token=(32, 32), dtype="uint8")
    eng = MooncakeEngine(KVConfig(instance="p", role="prefill", layout=lay))
    try:
        g = PageGrid(src_first=(0, 1 << 20), dst_first=(0, 1 << 20), src_stride=P * 32,
                     dst_stride=P * 32, run_bytes=P * 32)  # fmt: skip
        lists = eng.prepare_pages(None, g)  # type: ignore[arg-type]
        one = np.array([1], dtype=np.int64)
        for bad in (0, P * 32 + 1):
            with pytest.raises(ValueError, match=f"last_bytes={bad}"):
                eng.post_pages(None, lists, one, one, bad, b"")  # type: ignore[arg-type]
        many = np.arange(SHORT_RUNS // 2 + 1, dtype=np.int64)  # two entries: past SHORT_RUNS
        assert eng.post_pages(None, lists, many, many, P * 32, b"") is None  # type: ignore[arg-type]
    finally:
        eng.close()


def test_an_engine_wrapped_to_inject_faults_sees_every_direct_send() -> None:
    """A direct-template send goes through the wrapping engine's own ``post`` (where faults
    apply), also when the wrapper replaced the engine after the peer's page lists were made
    with the real one: an injected failure fails the room instead of being bypassed."""
    require("nixl")
    from pdplug import KVConfig, KVLayout
    from pdplug.bootstrap import resolve
    from pdplug.transfer.faults import FaultyEngine
    from pdplug.types import Segment

    lay = KVLayout(page_size=P, entry_bytes_per_token=(32, 32), dtype="uint8")
    pm = PluginManager()
    with rendezvous() as server:
        cfg = dict(bootstrap_endpoint=server.endpoint, bootstrap_timeout_s=20.0,
                   waiting_timeout_s=20.0, transfer_timeout_s=5.0)  # fmt: skip
        sender = pm.make_kv_sender(
            KVConfig(instance="p", role="prefill", layout=lay, pack_region_tokens=P, **cfg),
            name="nixl",
        )
        recv = pm.make_kv_receiver(KVConfig(instance="d", role="decode", layout=lay, **cfg),
                                   name="nixl")  # fmt: skip
        import torch

        src = [torch.ones((32 * P, 32), dtype=torch.uint8) for _ in range(2)]
        dst = [torch.zeros((32 * P, 32), dtype=torch.uint8) for _ in range(2)]
        try:
            sender.register_kv(src)
            recv.register_kv(dst)
            recv.connect(resolve(server.endpoint, "p", timeout_s=20))
            pages = np.arange(4, dtype=np.int64)
            inner = sender.engine
            for room in (1, 2, 3):
                if room == 2:  # lists made with the real engine by room 1's send
                    sender.engine = FaultyEngine(inner, fail=lambda: True)
                recv.expect(room, pages, num_tokens=2 * P + 3)
                sender.start(room)
                assert sender.wait(room, (KVPoll.WaitingForInput,), 20) == KVPoll.WaitingForInput
                seg = Segment(token_start=0, token_end=2 * P + 3, page_start=0,
                              num_tokens=2 * P + 3, chunk_id=0, is_last=True)  # fmt: skip
                sender.send(room, seg, pages)
                want = KVPoll.Success if room == 1 else KVPoll.Failed
                assert sender.wait(room, timeout_s=10) == want, sender.failure_reason(room)
                assert recv.wait(room, timeout_s=10) == want
                if room > 1:  # the faulty engine's own post failed it
                    assert "failed (engine ERR)" in sender.failure_reason(room)
            st = sender.stats()
            assert st["direct_plans"] == 3 and st["engine_grid_xfer"] == 1, st
            assert sender.engine.failed == 2
        finally:
            recv.close()
            sender.close()
