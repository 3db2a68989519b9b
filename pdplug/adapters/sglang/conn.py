"""SGLang's transfer-backend classes on pdplug's parts: what ``get_kv_class(PDPLUG, ...)``
returns.

* :class:`PdplugKVBootstrapServer` (prefill server process): pdplug's rendezvous
  (:class:`pdplug.bootstrap.RendezvousServer`) on ``--disaggregation-bootstrap-port``.
* :class:`PdplugKVManager` (one per scheduler process): one pdplug KV sender (prefill) or
  receiver (decode) per plane (:mod:`pdplug.adapters.sglang.planes`: KV, aux, each state
  type), built through the ``pdplug`` plugin manager (``make_kv_sender`` /
  ``make_kv_receiver``, ``make_pack_planner``, ``make_scheduler``, ``make_consensus``: whatever
  the ``PDPLUG_*`` selections name, so a third-party pdplug plugin serves SGLang unchanged).
* :class:`PdplugKVSender` / :class:`PdplugKVReceiver` (one per request): SGLang's
  ``BaseKVSender`` / ``BaseKVReceiver`` calls (``docs/sglang-backend.md`` section 2) mapped
  onto the planes' rooms.

Naming at the rendezvous: every prefill rank of an engine publishes each plane as the pdplug
instance ``<engine>/<plane>``; ``<engine>`` names the engine uniquely (host, ports) and PP0 TP0
also publishes a one-rank directory entry, instance :data:`DIRECTORY`, whose ``extra`` carries
it, so a decode that knows only SGLang's ``bootstrap_addr`` finds the planes. Nothing here
blocks an engine's start-up on another engine: publishing and connecting run in background
threads; a request whose peer is not reachable fails with the reason.

Not done: speculative draft KV, decode host destinations, staging buffers, prefill CP, state
planes with PP > 1, heterogeneous KV-TP (the KV plane moves token rows between equal KV-TP
sizes); each is refused with a message naming it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import sglang  # noqa: F401  (absent: ModuleNotFoundError naming sglang)

from pdplug import bootstrap
from pdplug.adapters.push import PushCursor, SendJob, segments_for_job, step_ready
from pdplug.adapters.resolve import Resolver
from pdplug.adapters.room_ids import check_room
from pdplug.adapters.sglang import GATE
from pdplug.adapters.sglang.planes import (
    PLANE_AUX,
    PLANE_KV,
    Plane,
    RankShape,
    kv_plane,
    row_plane,
    state_planes,
)
from pdplug.adapters.sglang.rooms import first_failure, merge_polls
from pdplug.adapters.sglang.settings import BackendSettings, settings_from
from pdplug.config import KVConfig, SchedulerConfig
from pdplug.kvtypes import KVLayout
from pdplug.types import KVPoll, PeerInfo, Segment

GATE.require(GATE.installed())  # an unsupported release: ImportError with the reason

from sglang.srt.disaggregation.base.conn import (  # noqa: E402
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402

__all__ = [
    "DIRECTORY",
    "PdplugKVBootstrapServer",
    "PdplugKVManager",
    "PdplugKVReceiver",
    "PdplugKVSender",
]

log = logging.getLogger(__name__)

#: the rendezvous instance naming a prefill engine's pdplug instances
DIRECTORY = "sglang-prefill"

_TERMINAL = (KVPoll.Success, KVPoll.Failed)
#: how long a decode scheduler waits, once per prefill address, for its first connect (seconds)
CONNECT_WAIT_S = 2.0


def _par(name: str, default: Any) -> Any:
    """A value of SGLang's ``get_parallel()``, or ``default`` where it is not set."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return getattr(get_parallel(), name)
    except (AttributeError, RuntimeError, ValueError):
        return default


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


class _SendRoom(msgspec.Struct, kw_only=True):
    """Prefill-side state of one request (engine thread of SGLang's scheduler only)."""

    cursor: PushCursor
    planes: tuple[str, ...]
    num_pages: int = -1
    aux_index: int | None = None
    pos: int = -1  # next token to send; -1 until the decode prefix is known
    sent_pages: int = 0
    decode_prefix_len: int = -1  # from the decode's DestInfo, read once
    capacity: int | None = -1  # KVSender.capacity_tokens, read once (-1: not yet)
    sent_bytes: int = 0
    started: float = 0.0
    finished: float = 0.0
    failure: str | None = None
    aborted: bool = False
    orphan: bool = False  # aborted before SGLang saw it end: it may never poll it again


class _PrefillInfo(msgspec.Struct, kw_only=True):
    """What SGLang's decode queue reads of ``prefill_info_table[addr]``."""

    instance: str
    planes: dict[str, str]
    attn_tp_size: int = 1
    attn_cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True
    decode_allocation_policy: str = "early"


class PdplugKVBootstrapServer(BaseKVBootstrapServer):
    """pdplug's rendezvous on SGLang's bootstrap port (prefill server process).

    :param host: SGLang's ``--host`` (the bind host unless ``PDPLUG_SGLANG_BIND_HOST``).
    :param port: ``--disaggregation-bootstrap-port``.
    :raises ValueError: socket settings that are inconsistent (no key off loopback ...).
    :raises zmq.ZMQError: the port is taken.
    """

    def __init__(self, host: str, port: int) -> None:
        self.settings = settings_from(os.environ, host=host, chunked_prefill_size=None)
        self.server = bootstrap.RendezvousServer(self.settings.net.wire, port=port).start()
        self.endpoint = self.server.endpoint
        log.info("pdplug: rendezvous for SGLang prefill ranks at %s", self.endpoint)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self.server.stop()


class PdplugKVManager(BaseKVManager):
    """One SGLang scheduler process's pdplug sessions (one per plane) and its rooms.

    :param args: SGLang's ``KVArgs`` of this rank.
    :param disaggregation_mode: ``DisaggregationMode.PREFILL`` or ``DECODE``.
    :param server_args: SGLang's ``ServerArgs``.
    :param is_mla_backend: MLA latent KV.
    :raises ValueError: an unsupported configuration (named) or bad ``PDPLUG_SGLANG_*``.
    :raises pdplug.errors.PluginError: a selected pdplug component cannot be built.
    """

    supports_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        from pdplug import get_plugin_manager

        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.is_dummy_cp_rank = False
        self.enable_all_cp_ranks_for_transfer = False
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.role = "prefill"
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self.role = "decode"
        else:
            raise ValueError(f"PdplugKVManager: disaggregation_mode={disaggregation_mode!r}")
        self.settings: BackendSettings = settings_from(
            os.environ,
            host=getattr(server_args, "host", "127.0.0.1") or "127.0.0.1",
            chunked_prefill_size=getattr(server_args, "chunked_prefill_size", None),
        )
        self.enable_deferred_decode_kv_release = _env_flag(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", True
        )
        self._refuse_unsupported(server_args)
        self.shape = self._shape(args, server_args)
        self.page_size = int(args.page_size)
        self.engine = self._engine_name(server_args)
        self.planes = self._planes(args)
        self.plane_by_name = {p.name: p for p in self.planes}
        self.pm = get_plugin_manager()
        self.sessions: dict[str, Any] = {}
        device = "cpu" if str(getattr(server_args, "device", "cpu")) == "cpu" else "cuda"
        gpu = getattr(args, "gpu_id", 0) or 0
        self.kv_device = device if device == "cpu" else f"cuda:{gpu}"
        for plane in self.planes:
            self.sessions[plane.name] = self._session(plane)
        self._rooms: dict[int, _SendRoom] = {}
        self._lock = threading.Lock()
        self.counts = {"rooms": 0, "ok": 0, "failed": 0, "bytes": 0}
        self.publish_error: str | None = None
        self.votes: Any = None
        if self.role == "prefill":
            self._sched = self.pm.make_scheduler(
                SchedulerConfig(page_size=self.page_size, chunk_size=self.settings.chunk_tokens)
            )
            self.bootstrap_endpoint = (
                f"tcp://{self.settings.net.advertise_host}:"
                f"{int(getattr(server_args, 'disaggregation_bootstrap_port', 8998))}"
            )
            threading.Thread(target=self._publish, name="pdplug-publish", daemon=True).start()
            if self.shape.pp_size > 1:
                from pdplug.adapters.sglang.consensus import BootstrapVotes

                self.votes = BootstrapVotes.build(self)
        else:
            self.prefill_info_table: dict[str, _PrefillInfo] = {}
            self._connecting: dict[str, threading.Thread] = {}
            self._connect_errors: dict[str, str] = {}
            self._resolver = Resolver(10.0, wire=self.settings.net.wire)
            self.decode_instance = self.engine

    # ------------------------------------------------------------------ set-up
    def _refuse_unsupported(self, server_args: Any) -> None:
        checks = (
            ("attn_cp_size", 1, "prefill context parallelism (--attn-cp-size)"),
            ("attn_dp_size", 1, "data-parallel attention (--dp-size with DP attention)"),
        )
        for name, want, what in checks:
            got = _par(name, want)
            if got != want:
                raise ValueError(
                    f"pdplug transfer backend: {what} is not supported yet ({name}={got})"
                )
        if _env_flag("SGLANG_DISAGG_STAGING_BUFFER", False):
            raise ValueError(
                "pdplug transfer backend: SGLANG_DISAGG_STAGING_BUFFER is not supported"
            )

    def _shape(self, args: Any, server_args: Any) -> RankShape:
        from pdplug.adapters.version import installed_distribution

        n = len(args.kv_data_ptrs)
        layers = n if self.is_mla_backend else n // 2
        first = int(getattr(args, "prefill_start_layer", 0) or 0) if self.role == "prefill" else 0
        found = installed_distribution("sglang")
        return RankShape(
            attn_tp_size=int(_par("attn_tp_size", 1)),
            attn_tp_rank=int(_par("attn_tp_rank", getattr(args, "engine_rank", 0))),
            dcp_size=int(_par("attn_dcp_size", 1)),
            dcp_rank=int(_par("attn_dcp_rank", 0)),
            pp_size=int(_par("pp_size", 1)) if self.role == "prefill" else 1,
            pp_rank=int(getattr(args, "pp_rank", 0) or 0) if self.role == "prefill" else 0,
            first_layer=first,
            num_layers=layers,
            dtype=str(getattr(args, "kv_cache_dtype_str", "") or ""),
            model=str(getattr(server_args, "served_model_name", "") or ""),
            engine_version=found[1] if found else "",
            is_mla=self.is_mla_backend,
        )

    def _engine_name(self, server_args: Any) -> str:
        # one name per engine, the same in each of its scheduler processes
        where = getattr(server_args, "dist_init_addr", None) or socket.gethostname()
        port = getattr(server_args, "port", 0)
        bport = getattr(server_args, "disaggregation_bootstrap_port", 0)
        return f"sglang-{self.role}@{where}:{port}:{bport}"

    def _planes(self, args: Any) -> list[Plane]:
        s = self.shape
        planes = [
            kv_plane(
                args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                page_size=int(args.page_size), shape=s,
                num_draft_entries=int(getattr(args, "num_draft_entries", 0) or 0),
            )
        ]  # fmt: skip
        self.serves_aux = self.role == "decode" or s.pp_rank == s.pp_size - 1
        if self.serves_aux:
            planes.append(
                row_plane(
                    PLANE_AUX, args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, shape=s
                )
            )
        types = [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]
        states = state_planes(
            types,
            getattr(args, "state_data_ptrs", []) or [],
            getattr(args, "state_data_lens", []) or [],
            getattr(args, "state_item_lens", []) or [],
            getattr(args, "state_dim_per_tensor", None),
            shape=s,
        ) if types else []  # fmt: skip
        if states and s.pp_size > 1:
            raise ValueError(
                f"pdplug transfer backend: state buffers ({types}) with --pp-size {s.pp_size} "
                "are not supported yet"
            )
        self.state_types = types
        return planes + states

    def _session(self, plane: Plane) -> Any:
        st = self.settings
        config = KVConfig(
            instance=f"{self.engine}/{plane.name}",
            role=self.role,
            layout=plane.layout,
            bootstrap_timeout_s=st.bootstrap_timeout_s,
            waiting_timeout_s=st.waiting_timeout_s,
            transfer_timeout_s=st.transfer_timeout_s,
            pack_region_tokens=st.pack_region_tokens if plane.name == PLANE_KV else 64,
            max_dst_dcp=8 if plane.name == PLANE_KV else 1,
            device=self.kv_device if plane.name == PLANE_KV else "cpu",
            wire=st.net.wire,
        )
        session: Any
        if self.role == "prefill":
            session = self.pm.make_kv_sender(config, self.pm.make_pack_planner())
        else:
            session = self.pm.make_kv_receiver(config)
        session.register_kv(list(plane.regions))
        return session

    def _publish(self) -> None:
        # the rendezvous lives in SGLang's server process, which may start after this one
        try:
            for name, session in self.sessions.items():
                bootstrap.register(
                    self.bootstrap_endpoint, session.peer_info(), timeout_s=600.0,
                    wire=self.settings.net.wire,
                )  # fmt: skip
                log.debug("pdplug: published plane %s at %s", name, self.bootstrap_endpoint)
            if self.shape.pp_rank == 0 and self.shape.attn_tp_rank == 0:
                directory = PeerInfo(
                    instance=DIRECTORY,
                    role="prefill",
                    layout=KVLayout(page_size=1, entry_bytes_per_token=(1,)),
                    extra={
                        "engine": self.engine,
                        "pp_size": str(self.shape.pp_size),
                        "attn_tp_size": str(self.shape.attn_tp_size),
                        "page_size": str(self.page_size),
                        "planes": ",".join(self.engine_planes()),
                    },
                )
                bootstrap.register(
                    self.bootstrap_endpoint, directory, timeout_s=600.0,
                    wire=self.settings.net.wire,
                )  # fmt: skip
        except Exception as e:  # every room then fails naming it
            self.publish_error = f"{type(e).__name__}: {e}"
            log.error("pdplug: publishing this prefill rank failed: %s", self.publish_error)

    def engine_planes(self) -> list[str]:
        """The planes of the whole engine (the last PP stage serves the aux plane too)."""
        return [PLANE_KV, PLANE_AUX, *(f"state:{t}" for t in self.state_types)]

    def register_to_bootstrap(self) -> None:
        """SGLang's hook; publishing runs in a background thread from ``__init__``."""

    # ------------------------------------------------------------------ prefill rooms
    def start_room(self, room: int) -> None:
        """Lease ``room`` on every plane of this rank (prefill)."""
        check_room(room, "bootstrap_room")
        rs = _SendRoom(
            cursor=PushCursor(room=room), planes=tuple(self.sessions), started=time.monotonic()
        )
        with self._lock:
            old = self._rooms.pop(room, None)
            self._rooms[room] = rs
        if old is not None:
            for s in self.sessions.values():
                s.clear(room)
        self.counts["rooms"] += 1
        for name, s in self.sessions.items():
            try:
                s.start(room)
            except ValueError as e:
                rs.failure = f"{name}: {e}"
        if self.publish_error and rs.failure is None:
            rs.failure = f"this prefill rank is not published: {self.publish_error}"
        if rs.failure is not None:
            self.abort_room(room, rs.failure)
        if self.votes is not None:
            self.votes.track(room)

    def room(self, room: int) -> _SendRoom | None:
        """The state of ``room`` on this rank (None once cleared)."""
        return self._rooms.get(room)

    def room_status(self, room: int) -> KVPoll:
        """The merged status of ``room`` on this rank's planes (:func:`merge_polls`)."""
        rs = self._rooms.get(room)
        if rs is None:
            return KVPoll.Failed
        polls = []
        for s in self.sessions.values():
            try:
                polls.append(s.poll(room))
            except KeyError:
                polls.append(KVPoll.Failed)
        if KVPoll.Failed in polls:
            drained = all(self._drained(s, room) for s in self.sessions.values())
            return merge_polls(polls, drained)
        return merge_polls(polls)

    @staticmethod
    def _drained(session: Any, room: int) -> bool:
        try:
            return bool(session.drained(room))
        except KeyError:
            return True

    def failure(self, room: int) -> str:
        """Why ``room`` failed here (the first plane that says)."""
        rs = self._rooms.get(room)
        reasons: list[tuple[str, str | None]] = [("adapter", rs.failure if rs else None)]
        for name, s in self.sessions.items():
            try:
                reasons.append((name, s.failure_reason(room)))
            except KeyError:
                continue
        return first_failure(reasons) or "failed (no reason recorded)"

    def decode_prefix_len(self, room: int) -> int:
        """Tokens the decode already holds (its DestInfo; 0 if none arrived). Read from the
        session once per room: every later call is answered from the room's state, so the
        scheduler's loop does not wait on the session's engine thread for it again."""
        rs = self._rooms.get(room)
        if rs is not None and rs.decode_prefix_len >= 0:
            return rs.decode_prefix_len
        try:
            dests = self.sessions[PLANE_KV].dest(room)
        except (KeyError, ValueError):
            return 0
        prefix = int(dests[0].decode_prefix_len) if dests else 0
        if rs is not None and dests:
            rs.decode_prefix_len = prefix
        return prefix

    def post(
        self,
        room: int,
        page_indices: Any,
        state_indices: Sequence[Any] | None,
        num_kv_tokens: int | None,
    ) -> None:
        """One ``send`` of SGLang: split by pdplug's scheduler, posted on every plane."""
        rs = self._rooms.get(room)
        if rs is None or rs.failure is not None:
            return
        pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
        p = self.page_size
        if rs.pos < 0:
            rs.pos = rs.decode_prefix_len = self.decode_prefix_len(room)
        kv = self.sessions[PLANE_KV]
        n_tokens = int(num_kv_tokens) if num_kv_tokens is not None else len(pages) * p
        rs.sent_pages += len(pages)
        is_last = rs.num_pages < 0 or rs.sent_pages >= rs.num_pages
        start, end = rs.pos, rs.pos + n_tokens
        rs.pos = end
        try:
            if rs.capacity == -1:
                rs.capacity = kv.capacity_tokens(room)
            job = SendJob(
                room=room, page_ids=tuple(pages.tolist()), first_page=start // p,
                token_start=start, token_end=end,
                num_prompt_tokens=end if is_last else rs.decode_prefix_len + rs.num_pages * p,
                is_last=is_last,
            )  # fmt: skip
            segs = segments_for_job(
                rs.cursor, job, decode_prefix_len=rs.decode_prefix_len,
                capacity_tokens=rs.capacity, block_size=p, scheduler=self._sched,
            )  # fmt: skip
            ready = step_ready(self.kv_device)
            row = self.planes[0].layout.bytes_per_token
            for seg, src in segs:
                kv.send(room, seg, src, ready=ready)
                rs.sent_bytes += seg.num_tokens * row
            if is_last:
                self._post_side_planes(room, rs, state_indices)
        except (ValueError, TypeError) as e:
            rs.failure = f"send: {e}"
            self.abort_room(room, rs.failure)

    def _post_side_planes(
        self, room: int, rs: _SendRoom, state_indices: Sequence[Any] | None
    ) -> None:
        one = Segment(
            token_start=0, token_end=1, page_start=0, num_tokens=1, chunk_id=0, is_last=True
        )
        if self.serves_aux:
            if rs.aux_index is None:
                raise ValueError("the last send came before init() gave the metadata slot")
            # not counted in sent_bytes: SGLang's own backends report KV and state bytes only
            self.sessions[PLANE_AUX].send(room, one, np.array([rs.aux_index], dtype=np.int64))
        for i, t in enumerate(self.state_types):
            name = f"state:{t}"
            if name not in self.sessions:
                continue
            idx = None if state_indices is None or i >= len(state_indices) else state_indices[i]
            items = np.asarray(idx if idx is not None else [], dtype=np.int64).reshape(-1)
            n = len(items)
            seg = Segment(
                token_start=0, token_end=n, page_start=0, num_tokens=n, chunk_id=0, is_last=True
            )
            self.sessions[name].send(room, seg, items)
            rs.sent_bytes += n * self.plane_by_name[name].layout.bytes_per_token

    def abort_room(self, room: int, reason: str) -> None:
        """Fail ``room`` on every plane (both sides are told)."""
        rs = self._rooms.get(room)
        if rs is not None:
            rs.aborted = True
            rs.failure = rs.failure or reason
        for s in self.sessions.values():
            try:
                s.abort(room, reason)
            except KeyError:
                continue

    def clear_room(self, room: int) -> None:
        """Forget ``room`` on every plane (SGLang released the request)."""
        with self._lock:
            rs = self._rooms.pop(room, None)
        if rs is not None:
            self.counts["ok" if rs.failure is None else "failed"] += 1
            self.counts["bytes"] += rs.sent_bytes
        for s in self.sessions.values():
            try:
                s.clear(room)
            except KeyError:
                continue
        if self.votes is not None:
            self.votes.forget(room)

    def reap(self) -> None:
        """Clear aborted rooms SGLang will not poll again, once they drained."""
        with self._lock:
            gone = [r for r, rs in self._rooms.items() if rs.orphan]
        for r in gone:
            if all(self._drained(s, r) for s in self.sessions.values()):
                self.clear_room(r)

    # ------------------------------------------------------------------ decode
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Whether the prefill at ``bootstrap_addr`` is connected; starts connecting (in a
        background thread) when it is not. Never blocks."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        t = self._connecting.get(bootstrap_addr)
        if t is None or not t.is_alive():
            t = threading.Thread(
                target=self._connect, args=(bootstrap_addr,), name="pdplug-connect", daemon=True
            )
            self._connecting[bootstrap_addr] = t
            t.start()
            # a live prefill answers within a round trip or two: wait that long once, so the
            # first requests do not pay SGLang's one-second retry interval
            t.join(CONNECT_WAIT_S)
        return bootstrap_addr in self.prefill_info_table

    def _connect(self, addr: str) -> None:
        endpoint = f"tcp://{addr}"
        try:
            (entry,) = self._resolver.resolve(DIRECTORY, endpoint)
            engine = entry.extra["engine"]
            planes: dict[str, str] = {}
            for name, session in self.sessions.items():
                inst = f"{engine}/{name}"
                peers = self._resolver.resolve(inst, endpoint)
                session.connect(peers)
                planes[name] = inst
            self.prefill_info_table[addr] = _PrefillInfo(
                instance=engine,
                planes=planes,
                attn_tp_size=int(entry.extra.get("attn_tp_size", "1")),
                pp_size=int(entry.extra.get("pp_size", "1")),
                page_size=int(entry.extra.get("page_size", "0")) or None,
            )
            self._connect_errors.pop(addr, None)
        except Exception as e:
            self._connect_errors[addr] = f"{type(e).__name__}: {e}"
            log.warning("pdplug: connecting to prefill %s failed: %s", addr, e)

    def connect_error(self, addr: str) -> str | None:
        """Why connecting to the prefill at ``addr`` failed last (None if it did not)."""
        return self._connect_errors.get(addr)

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """SGLang's deferred release: nothing can still land in ``room``'s pages."""
        return all(self._drained(s, room) for s in self.sessions.values())

    def clear_deferred_abort_state(self, room: int) -> None:
        """SGLang's deferred release bookkeeping (pdplug's rooms hold it)."""

    def stats(self) -> dict[str, Any]:
        """Rooms started / ended here and bytes posted (prefill), per-plane session stats."""
        out: dict[str, Any] = dict(self.counts)
        out["planes"] = {n: s.stats() for n, s in self.sessions.items()}
        return out

    def close(self) -> None:
        """Close every session (idempotent)."""
        if self.votes is not None:
            self.votes.close()
        for s in self.sessions.values():
            s.close()


class PdplugKVSender(BaseKVSender):
    """One request on a prefill rank (SGLang's ``BaseKVSender``).

    :param mgr: this rank's :class:`PdplugKVManager`.
    :param bootstrap_addr: ``host:bootstrap_port`` (unused: the decode comes to this rank).
    :param bootstrap_room: the request's room (``[0, 2**63)``).
    """

    def __init__(
        self,
        mgr: PdplugKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.bootstrap_server_url = bootstrap_addr
        self.conclude_state: KVPoll | None = None
        self._metric = KVTransferMetric()
        self._failure: str | None = None
        mgr.reap()
        try:
            check_room(int(bootstrap_room), "bootstrap_room")  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:  # a request the router did not route: it fails
            self._failure = f"pdplug transfer backend: {e}"
            self.conclude_state = KVPoll.Failed
            return
        mgr.start_room(int(bootstrap_room))

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The pages to send (from the decode prefix on) and the metadata slot."""
        rs = self.kv_mgr.room(self.bootstrap_room)
        if rs is not None:
            rs.num_pages = int(num_kv_indices)
            rs.aux_index = None if aux_index is None else int(aux_index)
        if self.kv_mgr.votes is not None:  # SGLang admitted the request on this PP rank
            self.kv_mgr.votes.applied(self.bootstrap_room)

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode already holds (its DestInfo's ``decode_prefix_len``)."""
        return self.kv_mgr.decode_prefix_len(self.bootstrap_room)

    def get_max_transfer_tokens(self) -> int | None:
        """None: pdplug's scheduler splits each send at ``min(grid, pack capacity)``."""
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A last chunk goes out even without pages (it carries the metadata)."""
        return num_pages > 0 or last_chunk

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        indices_event: Any = None,
    ) -> None:
        """Post one chunk: int page ids ``[n]`` of ``num_kv_tokens`` tokens, from where the
        previous chunk ended (the decode prefix for the first); the last chunk also moves the
        metadata row and the state items."""
        if self.conclude_state in _TERMINAL:
            return
        self.kv_mgr.post(self.bootstrap_room, kv_indices, state_indices, num_kv_tokens)

    def poll(self) -> KVPoll:
        """The room's merged status on this rank (a failed room only once drained)."""
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.room_status(self.bootstrap_room)
        if status in _TERMINAL:
            self.conclude_state = status
            rs = self.kv_mgr.room(self.bootstrap_room)
            if rs is not None:
                rs.finished = time.monotonic()
                self._metric.transfer_latency_s = rs.finished - rs.started
                self._metric.transfer_total_bytes = rs.sent_bytes
        return status

    def poll_pp_consensus(self) -> KVPoll:
        """PP0 only (SGLang's PP bootstrap): the decision of pdplug's consensus over every PP
        rank (Bootstrapping until decided)."""
        votes = self.kv_mgr.votes
        if votes is None:
            return self.poll()
        return votes.status(self.bootstrap_room)

    def get_transfer_metric(self) -> KVTransferMetric:
        """Seconds from the room's start to its end here, bytes posted."""
        return self._metric

    def failure_exception(self) -> None:
        """Raise SGLang's ``KVTransferError`` with the room's reason (and forget the room).

        :raises KVTransferError: always.
        """
        self.conclude_state = KVPoll.Failed
        if self._failure is not None:
            raise KVTransferError(self.bootstrap_room or 0, self._failure)
        reason = self.kv_mgr.failure(self.bootstrap_room)
        self.kv_mgr.clear_room(self.bootstrap_room)
        raise KVTransferError(self.bootstrap_room, reason)

    def abort(self) -> None:
        """Fail the room here and tell the decode; a room that already succeeded stays a
        success (SGLang's router closes the prefill request once decode answered, which can
        be before this rank polled the room's end)."""
        if self.conclude_state == KVPoll.Success or (
            self.conclude_state is None
            and self.kv_mgr.room_status(self.bootstrap_room) == KVPoll.Success
        ):
            self.conclude_state = KVPoll.Success
            return
        self.kv_mgr.abort_room(self.bootstrap_room, "aborted by SGLang")
        rs = self.kv_mgr.room(self.bootstrap_room)
        if rs is not None and self.conclude_state is None:
            rs.orphan = True
        self.conclude_state = KVPoll.Failed

    def clear(self) -> None:
        """Forget the room (SGLang released the request)."""
        self.kv_mgr.clear_room(self.bootstrap_room)


class PdplugKVReceiver(BaseKVReceiver):
    """One request on a decode rank (SGLang's ``BaseKVReceiver``).

    :param mgr: this rank's :class:`PdplugKVManager`.
    :param bootstrap_addr: the prefill's ``host:bootstrap_port``.
    :param bootstrap_room: the request's room.
    """

    def __init__(
        self, mgr: PdplugKVManager, bootstrap_addr: str, bootstrap_room: int | None = None
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: KVPoll | None = None
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list[str] = []
        self._local = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._expected = False
        if bootstrap_room is None:
            self._fail("a request without bootstrap_room")
        else:
            try:
                check_room(int(bootstrap_room), "bootstrap_room")
            except ValueError as e:
                self._fail(str(e))

    def _fail(self, reason: str) -> None:
        self._failure = self._failure or reason
        self._local = KVPoll.Failed
        self.conclude_state = KVPoll.Failed

    def init(self, prefill_dp_rank: int) -> None:
        """Ready for :meth:`send_metadata` once the prefill is connected."""
        if self._local == KVPoll.Failed:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            why = self.kv_mgr.connect_error(self.bootstrap_addr) or "not connected"
            self._fail(f"prefill {self.bootstrap_addr}: {why}")
            return
        self.bootstrap_infos = list(info.planes.values())
        self._local = KVPoll.WaitingForInput

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = KVTransferDestination.DEVICE,
        **_: Any,
    ) -> None:
        """Send the destination pages (from ``decode_prefix_len`` on), the metadata slot and
        the state items to the prefill, on every plane."""
        if self._local != KVPoll.WaitingForInput:
            return
        if destination != KVTransferDestination.DEVICE:
            self._fail("decode host destinations are not supported by the pdplug backend")
            return
        mgr, room = self.kv_mgr, int(self.bootstrap_room)  # type: ignore[arg-type]
        info = mgr.prefill_info_table[self.bootstrap_addr]
        prefix = int(decode_prefix_len or 0)
        try:
            for name, session in mgr.sessions.items():
                inst = info.planes[name]
                if name == PLANE_KV:
                    pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
                    session.expect(room, pages, decode_prefix_len=prefix, instance=inst)
                elif name == PLANE_AUX:
                    if aux_index is None:
                        raise ValueError("send_metadata without a metadata slot (aux_index)")
                    one = np.array([int(aux_index)], dtype=np.int64)
                    session.expect(room, one, num_tokens=1, instance=inst)
                else:
                    i = mgr.state_types.index(name.split(":", 1)[1])
                    idx = (
                        None
                        if state_indices is None or i >= len(state_indices)
                        else state_indices[i]
                    )
                    items = np.asarray(idx if idx is not None else [], dtype=np.int64).reshape(-1)
                    session.expect(room, items, num_tokens=len(items), instance=inst)
            self._expected = True
        except (ValueError, KeyError) as e:
            self._fail(f"send_metadata: {e}")
            self.abort()

    def poll(self) -> KVPoll:
        """Bootstrapping / WaitingForInput until the metadata went, then the planes' merged
        status (Success once KV, metadata and state all landed)."""
        if self.conclude_state is not None:
            return self.conclude_state
        if not self._expected:
            return self._local
        polls = []
        for s in self.kv_mgr.sessions.values():
            try:
                polls.append(s.poll(self.bootstrap_room))
            except KeyError:
                polls.append(KVPoll.Failed)
        status = merge_polls(polls)
        if status in _TERMINAL:
            self.conclude_state = status
        return status

    def failure_exception(self) -> None:
        """Raise SGLang's ``KVTransferError`` with the room's reason.

        :raises KVTransferError: always.
        """
        self.conclude_state = KVPoll.Failed
        reasons: list[tuple[str, str | None]] = [("adapter", self._failure)]
        for name, s in self.kv_mgr.sessions.items():
            try:
                reasons.append((name, s.failure_reason(self.bootstrap_room)))
            except KeyError:
                continue
        raise KVTransferError(
            int(self.bootstrap_room or 0), first_failure(reasons) or "failed (no reason recorded)"
        )

    def abort(self) -> None:
        """Fail the room and tell the prefill (also before :meth:`send_metadata`: then the
        room is leased without pages and aborted, so the prefill does not wait for its
        bootstrap deadline)."""
        self.abort_notified = True
        self.conclude_state = KVPoll.Failed
        self._failure = self._failure or "aborted by SGLang"
        mgr, room = self.kv_mgr, self.bootstrap_room
        if room is None:
            return
        info = mgr.prefill_info_table.get(self.bootstrap_addr)
        for name, s in mgr.sessions.items():
            try:
                if not self._expected and info is not None:
                    s.expect(room, np.empty(0, dtype=np.int64), instance=info.planes[name])
                s.abort(room, self._failure)
            except (KeyError, ValueError):
                continue
        self._expected = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's deferred release: make sure the prefill was told."""
        if not self.abort_notified:
            self.abort()

    def is_abort_release_safe(self) -> bool:
        """Nothing can still land in this request's pages."""
        return self.bootstrap_room is None or self.kv_mgr.is_abort_release_safe(self.bootstrap_room)

    def clear(self) -> None:
        """Forget the room on every plane."""
        if self.bootstrap_room is None:
            return
        for s in self.kv_mgr.sessions.values():
            try:
                s.clear(self.bootstrap_room)
            except KeyError:
                continue
