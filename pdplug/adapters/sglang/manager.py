"""SGLang's ``BaseKVManager`` for the pdplug backend: one per scheduler process.

A manager owns one pdplug KV sender (prefill) or receiver (decode) session per plane
(:mod:`pdplug.adapters.sglang.planes`: KV, aux, each state type), built through the ``pdplug``
plugin manager (``make_kv_sender`` / ``make_kv_receiver``, ``make_pack_planner``,
``make_scheduler``, ``make_consensus``: whatever the ``PDPLUG_*`` selections name, so a
third-party pdplug plugin serves SGLang unchanged), and the rank's rooms: leasing, status,
abort and release on the prefill, the connection to each prefill engine on the decode.

Naming at the rendezvous: every prefill rank of an engine publishes each plane as the pdplug
instance ``<engine>/<plane>``; ``<engine>`` names the engine uniquely (host, ports) and PP0 TP0
also publishes a one-rank directory entry, instance :data:`DIRECTORY`, whose ``extra`` carries
it, so a decode that knows only SGLang's ``bootstrap_addr`` finds the planes. Nothing here
blocks an engine's start-up on another engine: publishing and connecting run in background
threads; a request whose peer is not reachable fails with the reason.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from pdplug import bootstrap
from pdplug.adapters.push import PushCursor
from pdplug.adapters.resolve import Resolver
from pdplug.adapters.room_ids import check_room
from pdplug.adapters.sglang.common import (
    CONNECT_WAIT_S,
    DIRECTORY,
    PrefillInfo,
    SendRoom,
    drained,
    env_flag,
    par,
)
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
from pdplug.transfer.faults import inject_from_env
from pdplug.types import KVPoll, PeerInfo

__all__ = ["PdplugKVManager"]

log = logging.getLogger(__name__)


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
        self.enable_deferred_decode_kv_release = env_flag(
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
        self._rooms: dict[int, SendRoom] = {}
        self._lock = threading.Lock()
        self.counts = {"rooms": 0, "ok": 0, "failed": 0, "bytes": 0}
        self.publish_error: str | None = None
        self.votes: Any = None
        if self.role == "prefill":
            self.scheduler = self.pm.make_scheduler(
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
            self.prefill_info_table: dict[str, PrefillInfo] = {}
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
            got = par(name, want)
            if got != want:
                raise ValueError(
                    f"pdplug transfer backend: {what} is not supported yet ({name}={got})"
                )
        if env_flag("SGLANG_DISAGG_STAGING_BUFFER", False):
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
            attn_tp_size=int(par("attn_tp_size", 1)),
            attn_tp_rank=int(par("attn_tp_rank", getattr(args, "engine_rank", 0))),
            dcp_size=int(par("attn_dcp_size", 1)),
            dcp_rank=int(par("attn_dcp_rank", 0)),
            pp_size=int(par("pp_size", 1)) if self.role == "prefill" else 1,
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
        if self.role == "prefill":
            inject_from_env(session)  # test-only, off unless PDPLUG_TEST_FAIL_WRITES
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
        rs = SendRoom(
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

    def room(self, room: int) -> SendRoom | None:
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
            done = all(drained(s, room) for s in self.sessions.values())
            return merge_polls(polls, done)
        return merge_polls(polls)

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
            if all(drained(s, r) for s in self.sessions.values()):
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
            self.prefill_info_table[addr] = PrefillInfo(
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
        return all(drained(s, room) for s in self.sessions.values())

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
