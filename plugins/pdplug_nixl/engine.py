"""NIXL adapter of :class:`pdplug.transfer.TransferEngine` (UCX; DRAM on CPU, VRAM on GPU).

NIXL's Python API: one ``nixl_agent`` per rank, memory
registered once, the peer's agent metadata loaded with ``add_remote_agent`` (exchanged through
pdplug's handshake, never NIXL's pickle-based descriptor serialisation), WRITEs posted with a
notification message that the target reads with ``get_new_notifs`` after the data landed,
``send_notif`` for chunks with nothing to write. A descriptor list of small descriptors posted
again unchanged (per-token sends, a retransmitted prefix, a benchmark loop) is prepared once
with ``prep_xfer_dlist`` and re-posted with ``make_prepped_xfer``, which skips the per-post
descriptor set-up that dominates small descriptors; every other pattern goes through
``initialize_xfer``.

Direct templates (:mod:`pdplug_nixl.grid`; always on). When a KV sender binds a pack planner's
direct template to a decode peer it asks :meth:`NixlEngine.prepare_pages` for compressed
(strided) lists of every page of the template's entries on both sides, one row per entry
(a list pair per last-page size, prepared the first time a send ends with it); each send of the
template is then one ``make_prepped_xfer`` of page indices (:meth:`NixlEngine.post_pages`), as
vLLM's NixlConnector posts blocks, instead of two descriptor lists and ``initialize_xfer``.
The indices come from the page ids the sender holds, not from addresses.

A rank publishes its registered regions in ``PeerInfo.extra["nixl_regions"]``
(:meth:`NixlEngine.info_extra`, :mod:`pdplug_nixl.regions`): the grids of its peers are built
on them. Every other write (packed gathers, DCP relayouts) posts its addresses (above).
(An older option, ``extra["page_lists"]``, mapped any write's addresses to indices into lists
of every page prepared at connect; it cost more than it saved and was removed in favour of the
grids, issue 24.) The agent is used by one thread at a time (the holder of the session's engine
lock).

Clean exits. The NIXL 1.5.1 wheel bundles its own ``libnl-route-3``; UCX's EFA transport, which
it loads when the first agent starts, links the *system* copy (through the system
``libefa``/``libibverbs`` of hosts that have rdma-core installed, as Mooncake needs). With the
bundled copy initialised first, the two copies' destructors crash at interpreter exit
(SIGSEGV in ``rtnl_tc_unregister`` during ``_dl_fini``), whatever Python released before — even
an agent that never registered memory. Loading the system copy before the first agent
(:func:`load_system_libnl`) reverses the order and the process exits normally; a process that
imported Mooncake first (which links the system copy) already had it that way. ``close``
releases what the agent holds in vLLM's NixlConnector order (transfer handles — the session
does that —, prepared descriptor lists, remote agents, registered memory) and then drops the
agent, so its native teardown runs while the interpreter is alive.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pdplug import KVConfig, TransferError
from pdplug.types import PageGrid, PeerInfo
from pdplug_nixl.grid import GridLists
from pdplug_nixl.regions import format_regions, parse_regions

__all__ = ["NixlEngine", "import_nixl", "load_system_libnl", "NIXL_MODULES"]


def _refused(peer: Any, e: Exception) -> TransferError:
    return TransferError(f"nixl: WRITE to {peer.name} refused: {type(e).__name__}: {e}")


#: NIXL's Python API modules: the ``nixl`` meta package, then the CUDA 12 and CUDA 13 wheels
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")

#: a descriptor list is prepared for re-posting only from this many descriptors on: below it
#: the per-post set-up it saves is smaller than the hashing that finds a repeated list
_PREP_MIN_DESCS = 16

#: the ``PeerInfo.extra`` key of a rank's registered regions (:func:`format_regions`)
REGIONS_KEY = "nixl_regions"

_LIBNL: list[Any] = []  # the system libnl-route, once loaded (kept so it stays loaded)


def load_system_libnl() -> bool:
    """Load the system ``libnl-route-3`` (if the host has one) before the first NIXL agent
    starts, so it is initialised before NIXL's bundled copy and torn down after it (see the
    module docstring); idempotent. Returns whether a system copy is loaded."""
    if _LIBNL:
        return True
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("nl-route-3")
    if not name:
        return False
    try:
        _LIBNL.append(ctypes.CDLL(name))
    except OSError:
        return False
    return True


def import_nixl() -> Any:
    """The NIXL Python API module: ``nixl._api`` (meta package), else ``nixl_cu12._api`` or
    ``nixl_cu13._api`` (the ``nixl-cu12`` / ``nixl-cu13`` wheels), the one matching torch's
    CUDA major version first when torch is already imported.

    :raises ImportError: none is installed (``pip install 'pdplug[nixl]'``, or ``nixl-cu13``
        with a CUDA 13 torch); the message lists each module's import error.
    """
    names = list(NIXL_MODULES)
    torch = sys.modules.get("torch")
    cuda = str(getattr(getattr(torch, "version", None), "cuda", None) or "")
    if cuda.startswith("13"):
        names.remove("nixl_cu13._api")
        names.insert(1, "nixl_cu13._api")
    errors = []
    for mod in names:
        try:
            return importlib.import_module(mod)
        except ImportError as e:
            errors.append(f"{mod}: {e}")
    raise ImportError("NIXL is not installed (pip install 'pdplug[nixl]'): " + "; ".join(errors))


class _Peer(msgspec.Struct, kw_only=True):
    """A loaded remote agent; ``refs``: handles :meth:`NixlEngine.connect` gave out for it
    (a re-handshake of the same decode rank loads the same agent again); ``regions``: its
    published regions (text); ``grids``: the direct templates' lists prepared toward it."""

    name: str
    refs: int = 0
    seen: Counter[bytes] = msgspec.field(default_factory=Counter)
    regions: str = ""
    grids: list[GridLists] = msgspec.field(default_factory=list)


class NixlEngine:
    """One NIXL agent for one pdplug rank.

    :param config: the rank's KVConfig. ``extra`` keys: ``backend`` (NIXL backend, default
        ``"UCX"``), ``num_threads`` (backend threads, default 0), ``progress_thread`` (``"1"``
        for NIXL's own progress thread; default off: the session's engine thread drives
        progress through its polls), ``prep_cache`` (prepared descriptor-list pairs kept,
        default 32; 0 disables preparing), ``prep_max_desc_bytes`` (prepare only lists whose
        mean descriptor is at most this many bytes, default 4096), ``max_notifs``
        (notifications buffered between two polls, default 65,536; more are lost and counted).
    :raises ImportError: NIXL missing.
    :raises TransferError: the agent or backend could not be created, or ``extra`` sets the
        removed ``page_lists`` option.
    """

    name = "nixl"
    notifications = True
    #: :meth:`post_pages` takes page ids as lists of Python ints too (the session's short sends)
    page_id_lists = True

    def __init__(self, config: KVConfig) -> None:
        api = import_nixl()
        load_system_libnl()
        lay = config.layout
        role = "p" if config.role == "prefill" else "d"
        self._name = (
            f"{config.instance}-{role}{lay.pp_rank}.{lay.tp_rank}.{lay.dcp_rank}-"
            f"{uuid.uuid4().hex[:8]}"
        )
        extra = config.extra
        if extra.get("page_lists", "0") != "0":
            raise TransferError(
                f"nixl: KVConfig.extra['page_lists']={extra['page_lists']!r}: the option was "
                "removed (it cost more than it saved); direct templates post whole pages from "
                "lists prepared once per peer without it: drop the key"
            )
        try:
            cfg = api.nixl_agent_config(
                # the session's engine thread polls check_xfer_state / get_new_notifs, which
                # progress UCX; a progress thread per agent spins a core (measured ~40% CPU)
                enable_prog_thread=extra.get("progress_thread", "0") == "1",
                backends=[extra.get("backend", "UCX")],
                num_threads=int(extra.get("num_threads", "0")),
            )
            self._agent = api.nixl_agent(self._name, cfg)
        except Exception as e:
            raise TransferError(f"nixl: cannot create agent {self._name}: {e}") from e
        dev = config.device
        self._mem = "VRAM" if dev.startswith("cuda") else "DRAM"
        self._dev = int(dev.split(":")[1]) if ":" in dev else 0
        self._reg: list[Any] = []
        self._peers: dict[str, _Peer] = {}
        self._prep: OrderedDict[bytes, tuple[Any, Any, np.ndarray]] = OrderedDict()
        self._prep_max = int(extra.get("prep_cache", "32"))
        self._prep_bytes = int(extra.get("prep_max_desc_bytes", "4096"))
        self._notifs: list[tuple[str, bytes]] = []
        # handles whose post already completed (UCX copied inside postXferReq): no status call
        self._done_at_post: set[Any] = set()
        # handles of ended writes, released off the send path (progress, 64 of them, close)
        self._ended: list[Any] = []
        # uint64 descriptor rows by run count, reused: a post fills them and NIXL copies them
        self._rows: dict[int, np.ndarray] = {}
        bind = getattr(api, "nixlBind", None)
        self._mem_kind = getattr(self._agent, "nixl_mems", {}).get(self._mem)
        self._xfer_dlist = (
            getattr(bind, "nixlXferDList", None) if self._mem_kind is not None else None
        )
        self._max_notifs = int(extra.get("max_notifs", "65536"))
        self._regions: list[tuple[int, int]] = []
        self._grid_local: dict[tuple[Any, ...], Any] = {}  # direct templates' local lists
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ TransferEngine
    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, nbytes)`` regions (one descriptor each)."""
        if not regions:
            return
        descs = self._agent.get_reg_descs(
            [(int(a), int(n), self._dev, "") for a, n in regions], self._mem
        )
        try:
            self._reg.append(self._agent.register_memory(descs))
        except Exception as e:
            raise TransferError(f"nixl: register_memory({self._mem}) failed: {e}") from e
        self._regions.extend((int(a), int(n)) for a, n in regions)

    def info_extra(self) -> dict[str, str]:
        """What a peer's engine reads from this rank's ``PeerInfo.extra``: its registered
        regions (``{"nixl_regions": "addr:nbytes,…"}``, decimal bytes), for whole-page lists."""
        return {REGIONS_KEY: format_regions(self._regions)}

    def agent(self) -> bytes:
        """This agent's metadata (after :meth:`register`)."""
        return bytes(self._agent.get_agent_metadata())

    def agent_name(self) -> str:
        """The agent name notifications from this rank carry."""
        return self._name

    def connect(self, peer: PeerInfo) -> _Peer:
        """Load the peer's agent metadata; one reference per call (see :meth:`disconnect`).

        :raises TransferError: the metadata is unusable.
        """
        try:
            name = self._agent.add_remote_agent(peer.agent)
        except Exception as e:
            raise TransferError(f"nixl: add_remote_agent failed: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        p = self._peers.get(name)
        if p is None:
            p = self._peers[name] = _Peer(name=name)
        p.refs += 1
        p.regions = peer.extra.get(REGIONS_KEY, "")
        return p

    def disconnect(self, peer: Any) -> None:
        """Drop one reference to a peer; the remote agent (and its prepared lists) is removed
        with the last one, so an older connection of a decode rank that handshook again never
        removes the agent its newer connection uses."""
        if not isinstance(peer, _Peer) or self._peers.get(peer.name) is not peer:
            return
        peer.refs -= 1
        if peer.refs > 0:
            return
        del self._peers[peer.name]
        for g in peer.grids:
            g.release(self._release_dlist)
        peer.grids.clear()
        for key in [k for k in self._prep if k.startswith(peer.name.encode() + b"\0")]:
            _l, r, _i = self._prep.pop(key)
            self._release_dlist(r)
        try:
            self._agent.remove_remote_agent(peer.name)
        except Exception:
            pass

    def post(
        self, peer: Any, src: np.ndarray, dst: np.ndarray, length: np.ndarray, tag: bytes
    ) -> Any:
        """Post one WRITE of ``[R]`` runs with notification ``tag``.

        :raises TransferError: NIXL refused the request (e.g. ``NIXL_ERR_NOT_FOUND``: an
            address outside the peer's registered memory) or the post returned ``ERR``.
        """
        n = int(length.shape[0])
        rows = self._rows.get(n)
        if rows is None:  # local and remote (address, bytes, device); device set once
            if len(self._rows) >= 64:
                self._rows.clear()
            rows = self._rows[n] = np.full((2, n, 3), self._dev, dtype=np.uint64)
        rows[0, :, 0] = src
        rows[1, :, 0] = dst
        rows[:, :, 1] = length
        local, remote = rows
        try:
            # preparing pays off for many small descriptors only (see the module docstring)
            small = n >= _PREP_MIN_DESCS and self._prep_max and length.sum() <= self._prep_bytes * n
            handle = self._prepped(peer, local, remote, tag) if small else None
            if handle is None:
                handle = self._agent.initialize_xfer(
                    "WRITE", self._dlist(local), self._dlist(remote), peer.name, tag
                )
                self.counts["initialize_xfer"] += 1
        except Exception as e:
            raise _refused(peer, e) from e
        return self._start(peer, handle)

    def _dlist(self, rows: np.ndarray) -> Any:
        """NIXL's transfer descriptor list of ``[n, 3]`` uint64 rows (it copies them: the
        caller reuses its array). Built with NIXL's own ``nixlXferDList`` when the API module
        exposes it: ``get_xfer_descs`` accepts many input kinds and tells them apart first."""
        if self._xfer_dlist is not None:
            return self._xfer_dlist(self._mem_kind, rows)
        return self._agent.get_xfer_descs(rows, self._mem)

    def _start(self, peer: _Peer, handle: Any) -> Any:
        """Start a built request; raise when NIXL refuses it, release it when it says ``ERR``."""
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            raise _refused(peer, e) from e
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"nixl: WRITE to {peer.name} failed at post (state ERR)")
        if state == "DONE":
            self._done_at_post.add(handle)
        return handle

    def prepare_pages(self, peer: _Peer, grid: PageGrid) -> GridLists | None:
        """Prepare the descriptors of every page of ``grid`` toward ``peer`` once
        (:mod:`pdplug_nixl.grid`); ``None`` when the peer published no regions, published
        malformed ones (counted as ``grid_regions_malformed``) or a side holds no whole page of
        some entry (``grid_no_whole_page``); the sends then post addresses.

        :raises Exception: NIXL refused the lists.
        """
        if not peer.regions or not self._regions:
            return None
        try:
            remote = parse_regions(peer.regions)
        except ValueError:
            # a peer that is not a pdplug rank of this version: its writes go by addresses
            self.counts["grid_regions_malformed"] += 1
            return None
        try:
            gl = GridLists(self._agent, peer.name, grid, self._regions, remote, self._mem,
                           self._dev, self._grid_local)  # fmt: skip
        except ValueError:
            self.counts["grid_no_whole_page"] += 1
            return None
        gl.lists(grid.run_bytes)  # the whole-page lists now, off the send path
        peer.grids.append(gl)
        self.counts["grid_lists"] += 1
        return gl

    def post_pages(
        self, peer: _Peer, lists: GridLists, src_pages: np.ndarray | list[int],
        dst_pages: np.ndarray | list[int], last_bytes: int, tag: bytes,
    ) -> Any:  # fmt: skip
        """Post one WRITE of pages ``src_pages`` -> ``dst_pages`` (int64 ``[P]`` arrays or lists
        of Python ints: :attr:`page_id_lists`) of a grid
        prepared by :meth:`prepare_pages`, entry-major, each entry's last page moving
        ``last_bytes``; ``None`` when the lists do not hold these pages (the session posts
        addresses).

        :raises TransferError: NIXL refused the request or the post returned ``ERR``.
        :raises ValueError: ``last_bytes`` is not in ``(0, run_bytes]``.
        """
        try:
            req = lists.request(src_pages, dst_pages, last_bytes)
        except ValueError:
            raise
        except Exception:  # a tail list NIXL refused: this write goes the general way
            self.counts["grid_lists_refused"] += 1
            return None
        if req is None:
            return None
        try:
            handle = self._agent.make_prepped_xfer("WRITE", *req, tag)
        except Exception as e:
            raise _refused(peer, e) from e
        self.counts["grid_xfer"] += 1
        return self._start(peer, handle)

    def _prepped(self, peer: _Peer, local: np.ndarray, remote: np.ndarray, tag: bytes) -> Any:
        h = hashlib.blake2b(digest_size=16)
        h.update(local.tobytes())
        h.update(remote.tobytes())
        key = peer.name.encode() + b"\0" + h.digest()
        hit = self._prep.get(key)
        if hit is None:
            peer.seen[key] += 1
            if peer.seen[key] < 2:  # prepare only a pattern that repeats
                if len(peer.seen) > 4096:
                    peer.seen.clear()
                return None
            del peer.seen[key]
            lh = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._dlist(local))
            rh = self._agent.prep_xfer_dlist(peer.name, self._dlist(remote))
            hit = (lh, rh, np.arange(local.shape[0], dtype=np.int64))
            self._prep[key] = hit
            while len(self._prep) > self._prep_max:
                _k, (ol, orr, _i) = self._prep.popitem(last=False)
                self._release_dlist(ol)
                self._release_dlist(orr)
        else:
            self._prep.move_to_end(key)
        lh, rh, idx = hit
        self.counts["make_prepped_xfer"] += 1
        return self._agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, tag)

    def _release_dlist(self, h: Any) -> None:
        try:
            self._agent.release_dlist_handle(h)
        except Exception:
            pass

    def done_at_post(self, xfer: Any) -> bool:
        """Whether ``xfer``'s post returned ``DONE`` (UCX copied inside ``postXferReq``): its
        bytes landed, so the session ends it without a status call."""
        return xfer in self._done_at_post

    def check(self, xfer: Any) -> str:
        """``"PROC"``, ``"DONE"`` or ``"ERR"`` (an exception from NIXL counts as ``"ERR"``)."""
        if xfer in self._done_at_post:
            return "DONE"
        try:
            return str(self._agent.check_xfer_state(xfer))
        except Exception:
            return "ERR"

    def cancel(self, xfer: Any) -> bool:
        """NIXL posts start at once: nothing to withdraw (False)."""
        return False

    def release(self, xfer: Any) -> None:
        """Release a transfer handle whose write ended: at the next progress round (the
        session's engine thread calls it every 10 ms, and while writes are in flight), or once
        64 wait, never on the send path: neither the host reaping it in ``poll()`` nor the next
        ``send`` waits for it; :meth:`close` releases the rest."""
        self._done_at_post.discard(xfer)
        self._ended.append(xfer)
        if len(self._ended) >= 64:
            self._release_ended()

    def _release_ended(self) -> None:
        ended, self._ended = self._ended, []
        for h in ended:
            try:
                self._agent.release_xfer_handle(h)
            except Exception:
                pass

    def notify(self, peer: Any, tag: bytes) -> None:
        """Send ``tag`` without data."""
        self._agent.send_notif(peer.name, tag)

    def progress(self) -> None:
        """Progress UCX (``get_new_notifs`` drives the worker); notifications it returns are
        kept for :meth:`poll_notifications` (at most ``max_notifs``; beyond that they are dropped
        and counted as ``notifs_lost``, reported in the session's ``stats()``); nothing after
        :meth:`close`."""
        if self._agent is not None:
            if self._ended:
                self._release_ended()
            self._take(self._agent.get_new_notifs())

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(agent name, message)``."""
        if self._agent is not None:
            self._take(self._agent.get_new_notifs())
        out, self._notifs = self._notifs, []
        return out

    def _take(self, notifs: dict[Any, list[bytes]]) -> None:
        for name, msgs in notifs.items():
            sender = name.decode() if isinstance(name, bytes) else str(name)
            if len(self._notifs) + len(msgs) > self._max_notifs:
                self.counts["notifs_lost"] += len(msgs)
                continue
            self._notifs.extend((sender, bytes(m)) for m in msgs)

    def close(self) -> None:
        """Release prepared lists, remote agents and registrations, then drop the agent;
        idempotent (the session released its transfer handles before)."""
        if self._agent is None:
            return
        self._release_ended()
        self._done_at_post.clear()
        for _k, (lh, rh, _i) in list(self._prep.items()):
            self._release_dlist(lh)
            self._release_dlist(rh)
        self._prep.clear()
        for p in self._peers.values():
            for g in p.grids:
                g.release(self._release_dlist)
            p.grids.clear()
        for lh in self._grid_local.values():
            self._release_dlist(lh)
        self._grid_local.clear()
        for name in list(self._peers):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
        self._peers.clear()
        for r in self._reg:
            try:
                self._agent.deregister_memory(r)
            except Exception:
                pass
        self._reg.clear()
        self._notifs.clear()
        self._agent = None  # its native teardown runs now, not at interpreter exit
