"""Mooncake adapter of :class:`pdplug.transfer.TransferEngine` (TransferEngine, P2P handshake).

Mooncake's Python API (SGLang's and vLLM's Mooncake connectors use the same calls):
``TransferEngine.initialize(host, "P2PHANDSHAKE", protocol, device)`` binds a random RPC port
and names the engine ``host:port``, which is what a peer writes to (the session id). Memory is
registered in one ``batch_register_memory`` call over de-duplicated regions (overlapping
re-registration is rejected, Mooncake#3153). A write to a session whose segment is open goes
out as asynchronous single-run batches from the thread that posts it and is advanced by
:meth:`MooncakeEngine.check` (:mod:`pdplug_mooncake.runs`): no Python thread per write. Each
peer also has a worker thread, for what can block: the first write to a session, and the first
after a failed one, which must probe the session first (below); writes posted while the worker
has one queued follow it there, so a peer's writes land in post order. The worker submits each
run as its own asynchronous batch too and polls them with backing-off sleeps:
``batch_transfer_sync_write`` spins a core while it waits, which a write stuck on a vanished
peer turns into seconds of a core. At most ``max_batch`` runs are in flight per peer because
a TCP lane whose queue overflows rejects the batch and stays unusable (measured on mooncake
0.3.13), and fewer while the peer's writes have not yet landed: a window that starts at four
runs and grows with each run that lands, so a write the peer refuses has few runs left with
the engine to drain. The engine has no completion notifications: the session reports
completion and failure over the ZMQ control channel.

**Probe before the handshake.** The first write to a session (and the first after a failed
one, after which the binding forgets the session) opens it with a metadata handshake that the
Python binding runs while holding the one mutex every write takes, with no timeout on the
peer's answer (mooncake 0.3.13; later releases bound it by 60 s). A peer whose address accepts
TCP and never answers (a frozen host, a NAT or firewall that swallows the reply, a wrong
advertised host) therefore wedged every write of the process, to healthy peers too (field case
C17). So a session is opened only right after ``send_probe`` answered within
``probe_timeout_s`` (an empty batch write opens it then, on the peer's worker, when the session
is first connected): the probe runs on a daemon thread of its own and takes no binding lock, so
a probe that never returns costs its peer's writes only (they fail at once, naming the probe);
a peer that answers again later is probed again by the next write bound for it.

**Teardown holds the GIL.** Destroying a ``TransferEngine`` blocks for about 0.5-0.7 s with the
GIL held (its native threads are joined; mooncake 0.3.13, measured on this project's 2-core
machine). Left to the cyclic garbage collector, that happens at a random later moment, inside
whatever the process is doing: a collection that freed a few closed sessions' engines stalled
every Python thread of the process for seconds, long enough for live sessions' peers to declare
them silent (seen in the test suite, where NIXL rooms failed while old Mooncake sessions were
collected). So :meth:`MooncakeEngine.close` destroys the engine itself, at once, on the
closing thread; an engine that a thread may still call (a write stuck on a peer, a probe that
has not returned) is kept in :data:`RETIRED` until the process exits instead, so its last
reference never drops on a thread in the middle of other work.
"""

from __future__ import annotations

import atexit
import bisect
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import numpy as np

from pdplug import KVConfig, TransferError
from pdplug.types import PageGrid, PeerInfo
from pdplug_mooncake.runs import DONE as _DONE
from pdplug_mooncake.runs import IN_FLIGHT as _IN_FLIGHT
from pdplug_mooncake.runs import WINDOW_MIN as _WINDOW_MIN
from pdplug_mooncake.runs import AsyncRuns, AsyncWrite

__all__ = ["RETIRED", "MooncakeEngine", "coalesce_runs"]

#: closed engines a thread may still call (a stuck write, a probe not returned): never destroyed
#: before the process exits (see the module docstring, "Teardown holds the GIL")
RETIRED: list[Any] = []

#: probe threads that may still be inside ``send_probe`` (joined, bounded, at interpreter exit)
_PROBES: set[threading.Thread] = set()
#: a probe is added and started under it, so the exit's snapshot holds started threads only
_PROBES_LOCK = threading.Lock()
#: set with the exit's snapshot: no probe starts after it (it would not be joined)
_EXITING = False


@atexit.register
def _wait_for_probes(limit_s: float = 2.0) -> None:
    """Give live probes up to ``limit_s`` to return before the interpreter finalizes: a daemon
    thread that comes back from Mooncake's native code after that point is ended by CPython
    with a forced unwind through C++ frames, which aborts the process (std::terminate, exit
    code 134). A probe still blocked on a silent peer after ``limit_s`` stays blocked."""
    global _EXITING
    t_end = time.monotonic() + limit_s
    with _PROBES_LOCK:
        _EXITING = True
        probes = list(_PROBES)
    for t in probes:
        if t.ident is not None:  # joining a thread not started raises (it never ran a probe)
            t.join(max(0.0, t_end - time.monotonic()))


_SESSION = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+:\d{1,5}$")
# a worker waiting for its write: yield for the first 100 us, then sleep 50 us doubling to 1 ms
_SPIN_S, _SLEEP_MIN_S, _SLEEP_MAX_S = 100e-6, 50e-6, 1e-3


def coalesce_runs(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, group: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbouring runs that continue each other on both sides into one descriptor.

    A plan never lets a run cross a destination page (:mod:`pdplug_dcp.direct`), so a chunk
    of SGLang's 1-token pages is one run per token and entry (10,900 descriptors of 128 bytes
    for 2,725 tokens on a PP stage of the test model). Mooncake's TCP transport pays for each
    descriptor (tens of microseconds idle, far more on a loaded host: such writes passed 30 s
    at PP 2 in tests/sglang_backend); SGLang's own Mooncake backend merges contiguous blocks
    first (``group_concurrent_contiguous``). A write copies bytes from addresses to
    addresses, so merging runs adjacent on both sides moves the same bytes.

    :param src: int ``[R]`` source addresses, in posting order.
    :param dst: int ``[R]`` destination addresses.
    :param length: int ``[R]`` run lengths (bytes).
    :param group: int ``[R]`` (optional): runs of different groups never merge (the engine
        passes each run's registered source region, so a descriptor never spans two buffers
        that happen to be adjacent in memory; SGLang merges per buffer too).
    :returns: int64 ``[R']`` ``(src, dst, length)``, ``R' <= R`` (the inputs when none merge).
    """
    m = int(length.shape[0])
    if m <= 1:
        return src, dst, length
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    cont = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    if group is not None:
        cont &= group[1:] == group[:-1]
    if not cont.any():
        return src, dst, length
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    csum = np.concatenate(([0], np.cumsum(length)))
    ends = np.concatenate((starts[1:], [m]))
    return src[starts], dst[starts], csum[ends] - csum[starts]


#: writes of at most this many runs are merged over Python lists (:func:`coalesce_short`):
#: the dozen numpy calls of :func:`coalesce_runs` cost more than comparing a few runs
SHORT_RUNS = 16


def coalesce_short(
    src: list[int], dst: list[int], length: list[int], starts: list[int] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """:func:`coalesce_runs` of a short write (at most :data:`SHORT_RUNS` runs; a 64 KiB send
    is a few) over Python lists, with the same result: runs that continue each other on both
    sides merge unless they lie in different registered regions (``starts``: the sorted region
    starts, ``None`` with one region).

    :param src/dst/length: ``[R]`` addresses and byte lengths, ``R >= 1``.
    """
    out_s, out_d, out_n = [src[0]], [dst[0]], [length[0]]
    region = bisect.bisect_right(starts, src[0]) if starts else 0
    for a, b, n in zip(src[1:], dst[1:], length[1:]):
        here = bisect.bisect_right(starts, a) if starts else 0
        if here == region and a == out_s[-1] + out_n[-1] and b == out_d[-1] + out_n[-1]:
            out_n[-1] += n
        else:
            out_s.append(a)
            out_d.append(b)
            out_n.append(n)
        region = here
    return out_s, out_d, out_n


class _Worker:
    """One daemon thread running one peer's writes in order (a write stuck on a peer that
    stopped answering must neither delay other peers nor keep the process from exiting)."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], int], Future[int]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.running = False
        # one writer each (the posting thread, this thread): their difference is safe to read
        self._submitted = self._ended = 0

    def submit(self, fn: Callable[[], int], key: list[int] | None = None) -> Future[int]:
        """Queue ``fn``; ``key`` (if given) receives ``id`` of the returned future first."""
        fut: Future[int] = Future()
        if key is not None:
            key.append(id(fut))
        self._submitted += 1
        self._q.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                self._ended += 1
                continue  # cancelled while queued: it never touched memory
            self.running = True
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)
            finally:
                self.running = False
                self._ended += 1

    @property
    def queued(self) -> int:
        """Writes submitted and not yet ended (running or waiting)."""
        return self._submitted - self._ended


class _Peer(msgspec.Struct, kw_only=True):
    """A peer session (``host:port``) and its worker; ``refs``: connects not yet undone.

    ``verified``: the binding holds an open segment for ``session`` (a probe answered and no
    write failed since); ``probe``: the last probe's thread while it has not returned;
    ``asyncs``: its asynchronous writes (:class:`~pdplug_mooncake.runs.AsyncRuns`; a new one
    after each failure, the older ones until their writes ended).
    """

    session: str
    worker: _Worker
    refs: int = 0
    verified: bool = False
    probe: threading.Thread | None = None
    asyncs: list[AsyncRuns] = []
    window: int = _WINDOW_MIN  # runs a worker write may keep with the engine (_write_runs)

    def async_live(self) -> int:
        """Asynchronous writes not yet ended."""
        return sum(len(r.live) for r in self.asyncs)


class MooncakeEngine:
    """One Mooncake TransferEngine for one pdplug rank.

    :param config: the rank's KVConfig. ``extra`` keys: ``protocol`` (``"tcp"`` default,
        ``"rdma"`` in production), ``device_name`` (NIC filter, default ``""`` = auto),
        ``host`` (advertised host, default ``config.wire.bind_host``), ``max_batch``
        (descriptors per write call, default 1024), ``probe_timeout_s`` (seconds a peer has
        to answer the handshake probe before its writes fail, default
        ``min(2, transfer_timeout_s / 2)``), ``async_max_runs`` (a write of at most this many
        runs to a verified session is submitted from the posting thread and advanced by
        :meth:`check`, :mod:`pdplug_mooncake.runs`; default: any size; ``"0"`` puts every
        write on the peer's worker thread, two thread hand-offs per write).
    :raises ImportError: mooncake is not installed.
    :raises TransferError: ``initialize`` failed (names host and protocol).
    """

    name = "mooncake"
    notifications = False
    #: :meth:`post_pages` takes page ids as lists of Python ints too (the session's short sends)
    page_id_lists = True

    def __init__(self, config: KVConfig) -> None:
        from mooncake.engine import TransferEngine

        extra = config.extra
        self._host = extra.get("host", config.wire.bind_host)
        self._protocol = extra.get("protocol", "tcp")
        self._engine = TransferEngine()
        rc = self._engine.initialize(
            self._host, "P2PHANDSHAKE", self._protocol, extra.get("device_name", "")
        )
        if rc != 0:
            raise TransferError(
                f"mooncake: initialize(host={self._host!r}, P2PHANDSHAKE, "
                f"protocol={self._protocol!r}) returned {rc}"
            )
        self._session = f"{self._host}:{self._engine.get_rpc_port()}"
        self._max_batch = int(extra.get("max_batch", "1024"))
        if self._max_batch <= 0:
            raise ValueError(f"KVConfig.extra['max_batch'] must be > 0, got {self._max_batch}")
        self._async_runs = int(extra.get("async_max_runs", str(1 << 62)))
        if self._async_runs < 0:
            raise ValueError(
                f"KVConfig.extra['async_max_runs'] must be >= 0, got {self._async_runs}"
            )
        probe = extra.get("probe_timeout_s", str(min(2.0, config.transfer_timeout_s / 2)))
        try:
            self._probe_s = float(probe)
        except ValueError:
            self._probe_s = -1.0
        if not 0 < self._probe_s < float("inf"):
            raise ValueError(
                f"KVConfig.extra['probe_timeout_s'] must be a number of seconds > 0, got {probe!r}"
            )
        self._peers: dict[str, _Peer] = {}
        self._failures: dict[int, str] = {}  # id(write future) -> why it failed
        self._regions: list[tuple[int, int]] = []
        self._starts = np.zeros(0, dtype=np.int64)  # sorted region starts (coalesce_runs)
        self._starts_l: list[int] = []  # the same as a list (coalesce_short)
        self._waker: Callable[[], None] | None = None
        self._closed = False
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ TransferEngine
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """``batch_register_memory`` over the (already de-duplicated) regions."""
        if not regions:
            return
        addrs = [int(a) for a, _ in regions]
        lens = [int(n) for _, n in regions]
        rc = self._engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransferError(f"mooncake: batch_register_memory of {len(addrs)} regions -> {rc}")
        self._regions.extend(regions)
        self._starts = np.array(sorted(a for a, _ in self._regions), dtype=np.int64)
        self._starts_l = self._starts.tolist()

    def agent(self) -> bytes:
        """This engine's session id ``host:rpc_port``."""
        return self._session.encode()

    def agent_name(self) -> str:
        """The session id (Mooncake has no notifications; kept for diagnostics)."""
        return self._session

    def connect(self, peer: PeerInfo) -> _Peer:
        """The peer's session id and its write worker (shared by every connect of the same
        session, one reference each).

        :raises TransferError: ``peer.agent`` is not a ``host:port`` session id.
        """
        try:
            session = peer.agent.decode()
        except UnicodeDecodeError as e:
            raise TransferError("mooncake: peer agent is not a session id") from e
        if not _SESSION.match(session):
            raise TransferError(f"mooncake: peer agent {session[:64]!r} is not 'host:port'")
        p = self._peers.get(session)
        if p is None:
            worker = _Worker(f"pdplug-mooncake-write-{session}")
            p = self._peers[session] = _Peer(session=session, worker=worker)
            # verify the session now, off the write path: the first write need not wait
            peer_ref = p
            worker.submit(lambda: self._verify(peer_ref))
        p.refs += 1
        return p

    def disconnect(self, peer: Any) -> None:
        """Drop one reference; the last one stops the peer's worker (P2P sessions themselves
        are managed by the engine)."""
        if not isinstance(peer, _Peer) or self._peers.get(peer.session) is not peer:
            return
        peer.refs -= 1
        if peer.refs <= 0:
            del self._peers[peer.session]
            peer.worker.stop()

    def set_waker(self, waker: Callable[[], None]) -> None:
        """Call ``waker`` (from the worker thread) whenever a write finishes."""
        self._waker = waker

    def post(
        self, peer: Any, src: np.ndarray, dst: np.ndarray, length: np.ndarray, tag: bytes
    ) -> Future[int] | AsyncWrite:
        """Start the write: to a verified session whose worker has nothing queued, as
        asynchronous single-run batches submitted from the calling thread within the peer's
        window and advanced by :meth:`check` (:mod:`pdplug_mooncake.runs`: the engine's own
        threads move the bytes, so completion needs no Python thread); otherwise queued on the
        peer's worker thread (which probes an unverified session first), whose completion
        fires the waker. Runs contiguous on both sides go as one descriptor
        (:func:`coalesce_runs`)."""
        if self._closed:
            raise TransferError(f"mooncake: engine {self._session} is closed; write not posted")
        nruns = length.shape[0]
        if nruns <= SHORT_RUNS:
            s, d, n = src.tolist(), dst.tolist(), length.tolist()
            if nruns > 1:
                s, d, n = coalesce_short(
                    s, d, n, self._starts_l if len(self._starts_l) > 1 else None
                )
        else:
            if self._starts.shape[0] > 1:
                where = np.searchsorted(self._starts, src, side="right")
                src, dst, length = coalesce_runs(src, dst, length, where)
            else:
                src, dst, length = coalesce_runs(src, dst, length)
            s, d, n = src.tolist(), dst.tolist(), length.tolist()
        return self._submit(peer, s, d, n)

    def prepare_pages(self, peer: _Peer, grid: PageGrid) -> PageGrid:
        """A direct template's pages toward ``peer``: kept as they are (Mooncake has no
        descriptor lists to prepare; :meth:`post_pages` computes a small send's addresses as
        Python ints from them)."""
        return grid

    def post_pages(
        self, peer: _Peer, lists: PageGrid, src_pages: np.ndarray | list[int],
        dst_pages: np.ndarray | list[int], last_bytes: int, tag: bytes,
    ) -> Future[int] | AsyncWrite | None:  # fmt: skip
        """:meth:`post` of pages ``src_pages`` -> ``dst_pages`` (int64 ``[P]`` arrays or lists of
        Python ints: :attr:`page_id_lists`) of ``lists``,
        entry-major, each entry's last page moving ``last_bytes``, with addresses computed as
        Python ints (the first numpy operation after a pause costs more than a short list);
        ``None`` past :data:`SHORT_RUNS` runs (the session posts the addresses it computes).

        :raises ValueError: ``last_bytes`` is not in ``(0, run_bytes]``.
        :raises TransferError: as :meth:`post`.
        """
        run = lists.run_bytes
        if not 0 < last_bytes <= run:
            raise ValueError(f"post_pages: last_bytes={last_bytes} outside (0, {run}]")
        p = len(src_pages)
        if p * len(lists.src_first) > SHORT_RUNS:
            return None
        if self._closed:
            raise TransferError(f"mooncake: engine {self._session} is closed; write not posted")
        sl = src_pages if isinstance(src_pages, list) else src_pages.tolist()
        dl = dst_pages if isinstance(dst_pages, list) else dst_pages.tolist()
        ss, ds = lists.src_stride, lists.dst_stride
        s = [f + q * ss for f in lists.src_first for q in sl]
        d = [f + q * ds for f in lists.dst_first for q in dl]
        n = ([run] * (p - 1) + [last_bytes]) * len(lists.src_first)
        if len(n) > 1:
            s, d, n = coalesce_short(s, d, n, self._starts_l if len(self._starts_l) > 1 else None)
        self.counts["page_posts"] += 1
        return self._submit(peer, s, d, n)

    def _submit(
        self, peer: _Peer, s: list[int], d: list[int], n: list[int]
    ) -> Future[int] | AsyncWrite:
        self.counts["descriptors"] += len(n)
        # a write behind the worker's stays behind it: the peer's writes land in post order
        if peer.verified and len(n) <= self._async_runs and not peer.worker.queued:
            runs = peer.asyncs[-1] if peer.asyncs else None
            if runs is None or runs.dropped:
                runs = AsyncRuns(
                    self._engine, self._max_batch, lambda _why: self._dropped(peer), self.counts
                )
                peer.asyncs = [r for r in peer.asyncs if r.live] + [runs]
            self.counts["async_writes"] += 1
            return runs.post(peer.session, s, d, n)
        key: list[int] = []  # the future's id, known before the worker can run the write
        fut: Future[int] = peer.worker.submit(lambda: self._write(peer, key, s, d, n), key)
        if self._waker is not None:
            waker = self._waker
            fut.add_done_callback(lambda _f: waker())
        return fut

    @staticmethod
    def _dropped(peer: _Peer) -> None:
        peer.verified = False  # the binding forgot the session: probe it before its next write

    def _verify(self, peer: _Peer) -> int:
        """Probe ``peer``'s session (on its worker thread) unless it is verified; 0 when the
        binding may open it, else -1 with the reason kept in ``peer``'s last failure."""
        if peer.verified:
            return 0
        if peer.probe is not None and peer.probe.is_alive():
            return -1  # an earlier probe never returned: do not stack threads on a dead peer
        answer: list[int] = []

        def probe() -> None:
            try:
                answer.append(int(self._engine.send_probe(peer.session)))
            finally:
                _PROBES.discard(threading.current_thread())

        t = threading.Thread(
            target=probe,
            name=f"pdplug-mooncake-probe-{peer.session}",
            daemon=True,
        )
        # the exit's snapshot never holds a probe between add and start ("cannot join thread
        # before it is started", then an abort: CI, stop 51), nor misses one started after it
        with _PROBES_LOCK:
            if _EXITING:
                self.counts["probe_failed"] += 1
                return -1
            peer.probe = t
            _PROBES.add(t)
            t.start()
        t.join(self._probe_s)
        if t.is_alive() or not answer or answer[0] != 0:
            self.counts["probe_failed"] += 1
            return -1
        peer.probe = None
        # open the segment now, while the peer is known to answer: an empty batch makes the
        # binding run its handshake (under its lock), so no later write opens it on a peer that
        # stopped answering since (a peer that dies within this window still costs that lock)
        if self._engine.batch_transfer_sync_write(peer.session, [], [], []) != 0:
            self.counts["open_failed"] += 1
            return -1
        peer.verified = True
        return 0

    def _write(
        self, peer: _Peer, key: list[int], src: list[int], dst: list[int], ln: list[int]
    ) -> int:
        fid = key[0]
        if self._verify(peer) != 0:
            self._failures[fid] = (
                f"mooncake session {peer.session} did not answer a handshake probe within "
                f"{self._probe_s:g} s (KVConfig.extra['probe_timeout_s']); its writes fail "
                "until it answers again"
            )
            return -1
        step = self._max_batch
        for i in range(0, len(ln), step):
            error = self._write_runs(
                fid, peer, src[i : i + step], dst[i : i + step], ln[i : i + step]
            )
            self.counts["batch_calls"] += 1
            if error:
                peer.verified = False  # the binding dropped the segment: re-probe next time
                self._failures[fid] = error
                return -1
        return 0

    def _submit_runs(
        self, session: str, src: list[int], dst: list[int], ln: list[int]
    ) -> tuple[list[int], str]:
        """Submit each run as its own asynchronous batch; returns the batch ids and ``""``, or
        why the engine refused one (the runs before it are submitted and must still end)."""
        ids: list[int] = []
        for a, b, c in zip(src, dst, ln):
            bid = self._engine.batch_transfer_async_write(session, [a], [b], [c])
            if not bid:
                return ids, f"mooncake write to {session} was refused"
            ids.append(bid)
        return ids, ""

    def _write_runs(
        self,
        fid: int,
        peer: _Peer,
        src: list[int],
        dst: list[int],
        ln: list[int],
    ) -> str:
        """Write the runs as single-run asynchronous batches and wait (on this worker thread)
        until none can land any more; ``""`` when every run landed, else why not. The first
        failed run is reported at once (:meth:`check` says ``"FAILING"`` for write ``fid``).

        At most ``peer.window`` runs are with the engine at once: the window starts at
        :data:`_WINDOW_MIN` and grows by one per run that lands (up to ``max_batch``), and a
        failed run stops further submission and resets it. After a rejected run the engine
        ends a session's other queued runs three or four a second, so a write of 64 runs
        to addresses the peer refuses drained in 15 s when all were submitted at once and
        stays undrained, its room's pages held, all that time (mooncake 0.3.13); windowed,
        it drains in about ``window / 4`` s. The window is the peer's, so a session that
        keeps landing writes keeps a wide one.

        Not ``batch_transfer_sync_write``: it busy-polls the batch's status, so a write stuck
        on a peer that vanished (TCP retransmitting) spins a core until it ends, and on a
        small host slows every other peer's rooms (bench cluster scenario 4). Single-run
        batches because ``transfer_check_status`` of a multi-run batch reports done before
        all of its runs landed (mooncake 0.3.13)."""
        session, n, error = peer.session, len(ln), ""
        ids: list[int] = []
        spin_until, delay, k = time.monotonic() + _SPIN_S, _SLEEP_MIN_S, 0
        while k < n:
            if not error and len(ids) < n and len(ids) - k < peer.window:
                top = min(n, k + peer.window)
                more, error = self._submit_runs(
                    session, src[len(ids) : top], dst[len(ids) : top], ln[len(ids) : top]
                )
                ids.extend(more)
            if k >= len(ids):
                break  # refused, or a failure stopped submission: nothing else with the engine
            rc = int(self._engine.transfer_check_status(ids[k]))
            if rc not in _IN_FLIGHT:
                if rc == _DONE:
                    peer.window = min(peer.window + 1, self._max_batch)
                elif not error:
                    error = f"mooncake write to {session} failed ({rc})"
                if error:
                    peer.window = _WINDOW_MIN
                    if fid not in self._failures:
                        self._failures[fid] = error
                        if self._waker is not None:
                            self._waker()
                k += 1
                spin_until, delay = time.monotonic() + _SPIN_S, _SLEEP_MIN_S
                continue
            if time.monotonic() < spin_until:
                # a small write ends within microseconds: only yield the GIL (time.sleep(0)
                # is a timed sleep, tens of microseconds on a virtual machine)
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(2 * delay, _SLEEP_MAX_S)
        if error and len(ids) < n:
            self.counts["runs_not_submitted"] += n - len(ids)
        return error

    def wakes(self, xfer: Any) -> bool:
        """Whether ``xfer``'s end calls the waker: a worker write does; an asynchronous one is
        found by polling :meth:`check`."""
        return not isinstance(xfer, AsyncWrite) and self._waker is not None

    def failure(self, xfer: Any) -> str | None:
        """Why a write whose :meth:`check` said ``"ERR"`` failed, when the engine knows."""
        if isinstance(xfer, AsyncWrite):
            return xfer.error or None
        return self._failures.get(id(xfer))

    def check(self, xfer: Any) -> str:
        """``"PROC"`` while the write runs, then ``"DONE"`` (rc 0) or ``"ERR"``; a write with
        a failed run reports ``"FAILING"`` while others are still with the engine, and
        ``"ERR"`` once none can land any more. Checking an asynchronous write also submits
        the peer's next runs."""
        if isinstance(xfer, AsyncWrite):
            return str(xfer.owner.check(xfer))
        if not xfer.done():
            return "FAILING" if id(xfer) in self._failures else "PROC"
        if xfer.cancelled() or xfer.exception() is not None or xfer.result() != 0:
            return "ERR"
        return "DONE"

    def cancel(self, xfer: Any) -> bool:
        """Withdraw a write still queued behind the running one (``Future.cancel``); an
        asynchronous write is with the engine already (False)."""
        return False if isinstance(xfer, AsyncWrite) else bool(xfer.cancel())

    def release(self, xfer: Any) -> None:
        """Forget the write's failure reason (nothing else to release: the engine frees an
        asynchronous write's batches when :meth:`check` sees them end)."""
        self._failures.pop(id(xfer), None)

    def notify(self, peer: Any, tag: bytes) -> None:
        """Unsupported: completion goes over the control channel.

        :raises NotImplementedError: always.
        """
        raise NotImplementedError("mooncake has no notifications; use the control channel")

    def progress(self) -> None:
        """Nothing to drive: the engine runs its own threads."""

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Always ``[]`` (no notifications)."""
        return []

    def close(self) -> None:
        """Stop the workers, unregister memory and destroy the engine now, on this thread (see
        the module docstring: its teardown holds the GIL); idempotent. A worker still inside a
        write (a peer that stopped answering) is left to finish on its daemon thread, and the
        memory it reads stays registered; such an engine, or one a probe thread still calls,
        goes to :data:`RETIRED` instead of being destroyed."""
        if self._closed:
            return
        self._closed = True
        peers = list(self._peers.values())
        stuck = any(p.worker.running for p in peers)
        for p in peers:
            p.worker.stop()
        self._peers.clear()
        if self._regions and not stuck:
            try:
                self._engine.batch_unregister_memory([a for a, _ in self._regions])
            except Exception:
                pass
            self._regions.clear()
        if stuck or any(
            p.worker.queued or p.async_live() or (p.probe is not None and p.probe.is_alive())
            for p in peers
        ):
            RETIRED.append(self._engine)  # a thread still calls it: kept until the process exits
        else:
            self._engine = None  # the last reference: destroyed here (about 0.6 s, GIL held)
