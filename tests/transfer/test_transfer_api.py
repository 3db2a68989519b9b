"""The host-facing API: sessions satisfy the KVSender/KVReceiver Protocols (same method names
and parameters), factories come through the plugin manager, public names are documented, and
bad input is refused with a message naming the field and the value."""

from __future__ import annotations

import importlib
import inspect
import sys
import time
from types import ModuleType

import numpy as np
import pytest
import torch

import pdplug.bootstrap
import pdplug.rooms
import pdplug.transfer
from pdplug import KVConfig, KVLayout, KVSender, PluginManager
from pdplug.protocols import KVReceiver
from pdplug.testing import require, undocumented
from pdplug.transfer import KVReceiverSession, KVSenderSession
from pdplug.types import Segment


@pytest.mark.parametrize(
    ("proto", "impl"), [(KVSender, KVSenderSession), (KVReceiver, KVReceiverSession)]
)
def test_sessions_match_the_protocols(proto: type, impl: type) -> None:
    for name in [n for n in dir(proto) if not n.startswith("_")]:
        want = list(inspect.signature(getattr(proto, name)).parameters)
        got = list(inspect.signature(getattr(impl, name)).parameters)
        assert got == want, (impl.__name__, name, got, want)


_MODULES = [
    pdplug.transfer,
    pdplug.rooms,
    pdplug.bootstrap,
    *(
        importlib.import_module(f"pdplug.transfer.{m}")
        for m in (
            "arrivals",
            "channel",
            "engine",
            "faults",
            "gather",
            "handoff",
            "handshake",
            "inbox",
            "leases",
            "loop",
            "messages",
            "pageids",
            "peers",
            "pipeline",
            "posting",
            "receiver",
            "records",
            "refind",
            "regions",
            "sender",
            "session",
            "sources",
            "writes",
        )
    ),
]


@pytest.mark.parametrize("module", _MODULES, ids=lambda m: m.__name__)
def test_public_names_are_documented(module: ModuleType) -> None:
    # each object's own __doc__: inspect.getdoc would inherit msgspec.Struct's docstring
    assert (module.__doc__ or "").strip(), f"{module.__name__} has no docstring"
    assert undocumented(module) == []


def test_transfer_modules_are_small_and_say_their_job() -> None:
    for module in _MODULES[3:]:
        path = module.__file__
        assert path is not None
        with open(path) as f:
            lines = f.read().splitlines()
        assert len(lines) <= 460, (path, len(lines))
        first = (module.__doc__ or "").strip().splitlines()[0]
        assert first.endswith(".") and len(first) > 20, (path, first)


def test_the_receiver_imports_nothing_from_the_sender() -> None:
    import ast

    for name in ("receiver", "arrivals", "sources"):
        path = importlib.import_module(f"pdplug.transfer.{name}").__file__
        assert path is not None
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = {
            n.module
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module is not None
        }
        for side in ("sender", "leases", "peers", "pipeline", "regions", "writes", "records"):
            assert f"pdplug.transfer.{side}" not in imported, (name, side)


def _layout(**kw: int) -> KVLayout:
    return KVLayout(page_size=16, entry_bytes_per_token=(32, 32), **kw)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_factories_through_the_manager_and_named_input_errors(backend: str) -> None:
    require(backend)  # skip, or fail when PDPLUG_REQUIRE lists it
    pm = PluginManager()
    sender = pm.make_kv_sender(
        KVConfig(instance="p", role="prefill", layout=_layout(), pack_region_tokens=16),
        name=backend,
    )
    recv = pm.make_kv_receiver(
        KVConfig(instance="d", role="decode", layout=_layout(dcp_size=2)), name=backend
    )
    try:
        assert isinstance(sender, KVSender) and isinstance(recv, KVReceiver)
        assert sender.engine.name == backend
        with pytest.raises(ValueError, match="got 1 entries, layout has 2"):
            sender.register_kv([torch.ones(16 * 4, 32, dtype=torch.uint8)])
        kv = [torch.ones(16 * 4, 32, dtype=torch.uint8) for _ in range(2)]
        sender.register_kv(kv)
        assert sender.peer_info().role == "prefill"
        assert sender.peer_info().extra["rank"] == "0"
        with pytest.raises(KeyError, match="room 5 is not leased"):
            sender.poll(5)
        sender.start(5)
        with pytest.raises(ValueError, match="room 5 is already leased"):
            sender.start(5)
        seg = Segment(
            token_start=0, token_end=16, page_start=0, num_tokens=16, chunk_id=0, is_last=True
        )
        with pytest.raises(ValueError, match="room 5 is Bootstrapping"):
            sender.send(5, seg, np.array([0]))

        class TwoArgs(TypeError):  # an error type that takes more than a message
            def __init__(self, what: str, code: int) -> None:
                super().__init__(f"{what} ({code})")

        class Marker:
            @property
            def query(self) -> None:
                raise TwoArgs("marker gone", 7)

        # send_many names the item without rebuilding an error it cannot rebuild (it raised
        # a TypeError of its own from inside the handler, naming neither)
        with pytest.raises(TwoArgs, match=r"marker gone \(7\)") as ei:
            sender.send_many([(5, seg, np.array([0]), Marker())])
        if sys.version_info >= (3, 11):
            assert "KVSender.send_many: item 0" in ei.value.__notes__

        class Broken:  # a marker that fails in its own way: raised as itself, item noted
            @property
            def query(self) -> None:
                raise RuntimeError("device lost")

        with pytest.raises(RuntimeError, match=r"^device lost") as er:
            sender.send_many([(5, seg, np.array([0]), Broken())])
        if sys.version_info >= (3, 11):
            assert er.value.__notes__ == ["KVSender.send_many: item 0"]
        recv.register_kv([torch.ones(16 * 4, 32, dtype=torch.uint8) for _ in range(2)])
        with pytest.raises(ValueError, match=r"when this rank knows 0 prefill instances \(\[\];"):
            recv.expect(1, np.array([0]))
        # two known, none connected (as when a re-find gave a handshake up, one connected and
        # one found alike): named, nothing leased; it depended on the moment before
        recv.find("pre-b", "tcp://127.0.0.1:9")
        recv.find("pre-a", "tcp://127.0.0.1:9")
        two = r"instance is required when this rank knows 2 prefill instances \(\['pre-a', 'pre-b'"
        with pytest.raises(ValueError, match=two):
            recv.expect(1, np.array([0]))
        with pytest.raises(ValueError, match="KVReceiver.decline: " + two):
            recv.decline(1)
        with pytest.raises(ValueError, match=r"^KVReceiver.expect: prefill instance 'pre-c' not"):
            recv.expect(1, np.array([0]), instance="pre-c")  # named, but neither found nor known
        with pytest.raises(ValueError, match=r"expect: instance must be a str, got \['pre-a'\]"):
            recv.expect(1, np.array([0]), instance=["pre-a"])  # raised "unhashable type: 'list'"
        # helper-27: a str subclass leased the room, which failed 0.5 s later (msgspec cannot
        # encode numpy.str_); the session keeps the plain str
        assert type(recv._instance(np.str_("pre-a"))) is str
        for bad in (["x"], 5, b"pre-a"):  # ["x"]: "unhashable type"; 5 and bytes were kept
            with pytest.raises(ValueError, match=r"^KVReceiver.find: instance=.*non-empty str$"):
                recv.find(bad, "tcp://127.0.0.1:9")
        with pytest.raises(ValueError, match=r"rendezvous=5: both must be non-empty str$"):
            recv.find("pre-d", 5)
        with pytest.raises(KeyError):
            recv.poll(1)
        with pytest.raises(ValueError, match="prefill is empty"):
            recv.connect([])
        sender.clear(5)
    finally:
        sender.close()
        recv.close()
        sender.close()  # idempotent


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_ping_times_the_engine_thread_round_trip_and_fails_once_closed(backend: str) -> None:
    """``ping`` runs a no-op on the session's engine thread and returns the round trip in
    seconds; a timeout that is not a finite number > 0 is refused naming it (0 would report a
    live engine thread as dead); once the session is closed it raises naming it."""
    require(backend)
    from pdplug.errors import TransferError

    pm = PluginManager()
    sender = pm.make_kv_sender(
        KVConfig(instance="p", role="prefill", layout=_layout(), pack_region_tokens=16),
        name=backend,
    )
    recv = pm.make_kv_receiver(
        KVConfig(instance="d", role="decode", layout=_layout()), name=backend
    )
    try:
        for s in (sender, recv):
            assert all(0.0 < s.ping() < 5.0 for _ in range(3))
            assert 0.0 < s.ping(np.float32(2.0)) < 2.0 and 0.0 < s.ping(np.int64(2)) < 2.0
            for bad in (0, 0.0, -1.0, float("nan"), float("inf"), "1", None, True, 1e300, 2**1100):
                with pytest.raises(ValueError, match=r"timeout_s must be a finite number"):
                    s.ping(bad)  # type: ignore[arg-type]
    finally:
        sender.close()
        recv.close()
    for s in (sender, recv):
        with pytest.raises(TransferError, match="closed"):
            s.ping(0.5)


def test_config_role_is_checked() -> None:
    class _Engine:
        name = "x"

    with pytest.raises(ValueError, match=r"KVConfig\.role must be 'decode', got 'prefill'"):
        KVReceiverSession(
            KVConfig(instance="p", role="prefill", layout=_layout()),
            _Engine(),  # type: ignore[arg-type]
        )


def test_dedup_regions_merges_duplicates_overlaps_and_neighbours() -> None:
    from pdplug.transfer import dedup_regions

    regions = [(100, 50), (100, 50), (120, 10), (150, 10), (300, 0), (400, 8), (404, 100)]
    assert dedup_regions(regions) == [(100, 60), (400, 104)]
    assert dedup_regions([]) == []
    with pytest.raises(ValueError, match=r"region 1 = \(-5, 3\) is negative"):
        dedup_regions([(1, 1), (-5, 3)])


def test_nixl_engine_prepares_a_repeated_small_pattern_and_moves_the_bytes() -> None:
    require("nixl")
    from pdplug_nixl.engine import NixlEngine

    lay = _layout()
    a = NixlEngine(KVConfig(instance="p", role="prefill", layout=lay))
    b = NixlEngine(KVConfig(instance="d", role="decode", layout=lay))
    src = torch.randint(1, 256, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    try:
        a.register([(src.data_ptr(), src.numel())])
        b.register([(dst.data_ptr(), dst.numel())])
        from pdplug.types import PeerInfo

        peer = a.connect(PeerInfo(instance="d", role="decode", layout=lay, agent=b.agent()))
        n = 64  # 64 descriptors of 512 B, scattered
        order = np.random.default_rng(0).permutation(128)[:n].astype(np.int64) * 512
        s_addr, d_addr = src.data_ptr() + order, dst.data_ptr() + order[::-1]
        ln = np.full(n, 512, dtype=np.int64)
        got: list[tuple[str, bytes]] = []
        for k in range(3):
            h = a.post(peer, s_addr, d_addr, ln, b"tag%d" % k)
            t_end = time.monotonic() + 10
            while (st := a.check(h)) == "PROC" and time.monotonic() < t_end:
                got.extend(b.poll_notifications())  # the target progresses too
            a.release(h)
            assert st == "DONE"
        t_end = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < t_end:
            got.extend(b.poll_notifications())
        assert [m for _, m in got] == [b"tag0", b"tag1", b"tag2"]
        assert {name for name, _ in got} == {a.agent_name()}
        assert a.counts["initialize_xfer"] == 1 and a.counts["make_prepped_xfer"] == 2
        want = torch.zeros_like(dst)
        want[torch.from_numpy(order[::-1].copy())[:, None] + torch.arange(512)] = src[
            torch.from_numpy(order.copy())[:, None] + torch.arange(512)
        ]
        assert torch.equal(dst, want)
    finally:
        a.close()
        b.close()


def test_every_control_socket_bounds_frames_and_lingers_0() -> None:
    """Every control socket (and the engine loop's wake-up pair) is made by the wire rules:
    ``MAXMSGSIZE`` is the wire's limit exactly, linger 0; a DEALER keeps libzmq's routing id
    (peers are known by their sealed identity, not by a routing id they chose)."""
    from collections import Counter

    import zmq

    from pdplug import WireConfig
    from pdplug.transfer.channel import DealerChannel, RouterChannel
    from pdplug.transfer.loop import EngineLoop
    from pdplug.transfer.messages import control_codec

    wire = WireConfig(max_message_bytes=4096)
    loop = EngineLoop("api-test", lambda now: None, lambda: False)
    router = RouterChannel(
        loop, wire, control_codec(wire, identity="p tp0 pp0"), lambda got, now: None, Counter()
    )
    dealers = DealerChannel(loop, wire, "d tp0 pp0", "d", lambda cid, msg, now: None, Counter())
    try:
        cid = dealers.open(router.endpoint, "p tp0 pp0")
        dealer = dealers._socks[cid]
        for sock in (router.sock, dealer):
            assert sock.getsockopt(zmq.MAXMSGSIZE) == 4096
            assert sock.getsockopt(zmq.LINGER) == 0
        assert dealer.getsockopt(zmq.ROUTING_ID) == b""
    finally:
        dealers.close_all()
        router.close()
        loop.stop()


def test_a_dealer_cut_by_an_oversized_frame_reconnects_and_keeps_its_sequence() -> None:
    """libzmq ends a DEALER's connection for good when a frame over ``ZMQ_MAXMSGSIZE`` arrives
    (it never reconnects by itself after that protocol error). :class:`DealerChannel` reopens
    it (``control_reconnected``) under the same sealed codec: the prefill's ROUTER keeps
    accepting the decode's frames (next sequence numbers, a new routing id) and its replies
    reach the decode again."""
    from collections import Counter
    from typing import Any

    from pdplug import WireConfig
    from pdplug.transfer.channel import DealerChannel, RouterChannel
    from pdplug.transfer.loop import EngineLoop
    from pdplug.transfer.messages import Heartbeat, control_codec

    wire = WireConfig(max_message_bytes=4096)
    up: list[Any] = []  # (route, epoch, seq) at the prefill
    down: list[Any] = []  # heartbeats at the decode
    counts: Counter[str] = Counter()
    holder: dict[str, Any] = {}
    loop = EngineLoop("api-cut", lambda now: holder["d"].revive(now), lambda: False)
    router = RouterChannel(
        loop,
        wire,
        control_codec(wire, identity="p tp0 pp0"),
        lambda got, now: up.append((got.route, got.epoch, got.msg.seq)),
        Counter(),
    )
    dealers = holder["d"] = DealerChannel(
        loop, wire, "d tp0 pp0", "d", lambda cid, msg, now: down.append(msg.seq), counts
    )
    loop.start()

    def until(cond: Any, timeout_s: float = 10.0) -> bool:
        t_end = time.monotonic() + timeout_s
        while not cond() and time.monotonic() < t_end:
            time.sleep(0.02)
        return bool(cond())

    try:
        cid = loop.call(lambda: dealers.open(router.endpoint, "p tp0 pp0"), 5)
        loop.call(lambda: dealers.send(cid, Heartbeat(seq=1)), 5)
        assert until(lambda: len(up) == 1)
        route = up[0][0]
        # an oversized raw frame down the decode's connection: libzmq cuts it
        loop.call(lambda: router.sock.send_multipart([route, b"\x00" * 8192]), 5)
        assert until(lambda: counts["control_reconnected"] == 1), counts
        loop.call(lambda: dealers.send(cid, Heartbeat(seq=2)), 5)
        assert until(lambda: len(up) == 2), up
        assert up[1][0] != route and up[1][1] == up[0][1], up  # new route, same epoch
        assert up[1][2] == 2
        loop.call(lambda: router.send(up[1][0], Heartbeat(seq=3)), 5)
        assert until(lambda: down == [3]), down
        assert dealers.stats()["dropped"] == 0
    finally:  # sockets are closed on the thread that polls them
        loop.call(dealers.close_all, 5)
        loop.call(router.close, 5)
        loop.stop()


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_sessions_sockets_use_the_wire_limit(backend: str) -> None:
    import zmq

    require(backend)
    pm = PluginManager()
    cfg = KVConfig(instance="p", role="prefill", layout=_layout(), pack_region_tokens=16)
    sender = pm.make_kv_sender(cfg, name=backend)
    try:
        sock = sender._channel.sock  # type: ignore[attr-defined]
        assert sock.getsockopt(zmq.MAXMSGSIZE) == cfg.wire.max_message_bytes
        assert sock.getsockopt(zmq.LINGER) == 0
    finally:
        sender.close()


def test_after_round_runs_once_the_round_released_the_engine_lock() -> None:
    """Issue 24: a change that wakes a host (a room turning WaitingForInput) is published after
    the engine thread's round released the engine lock, so the woken host posts at once; off
    the loop thread it runs at once; and one queued outside a round still runs promptly."""
    import threading

    from pdplug.transfer.loop import EngineLoop

    loop = EngineLoop("api-after", lambda now: None, lambda: False, idle_s=1.0)
    loop.start()
    try:
        seen: list[tuple[str, bool, bool]] = []
        done = threading.Event()

        def later(what: str) -> None:
            seen.append((what, loop.lock.locked(), loop.on_thread()))
            if what == "nested":
                done.set()

        def in_round() -> None:
            loop.after_round(lambda: later("round"))
            seen.append(("in round", loop.lock.locked(), loop.on_thread()))
            # queued from after_round work itself: runs after the next round, not after idle_s
            loop.after_round(lambda: loop.after_round(lambda: later("nested")))

        t0 = time.monotonic()
        loop.call(in_round, 5.0)
        assert done.wait(5.0) and time.monotonic() - t0 < 0.5, seen
        assert seen[:2] == [("in round", True, True), ("round", False, True)], seen
        assert seen[2] == ("nested", False, True), seen
        loop.after_round(lambda: later("host"))  # not the loop thread: at once
        assert seen[-1] == ("host", False, False)
    finally:
        loop.stop()
