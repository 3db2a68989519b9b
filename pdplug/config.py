"""Configuration Structs handed to component factories by the manager's facade.

Hosts build these once at start-up; factories receive them unchanged. All times are seconds,
all sizes tokens or bytes as named.
"""

from __future__ import annotations

import msgspec

from pdplug.types import STREAMS, KVLayout

__all__ = ["ConsensusConfig", "KVConfig", "PlannerConfig", "SchedulerConfig", "WireConfig"]


class WireConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Rules every socket applies (:mod:`pdplug.wire`).

    :ivar max_message_bytes: largest frame (bytes): sockets set ``ZMQ_MAXMSGSIZE`` to it (a
        peer announcing a larger frame is disconnected before it is buffered) and codecs drop
        larger frames (counted ``oversize``).
    :ivar hmac_key: shared secret (the same bytes on every process of the deployment, e.g.
        ``secrets.token_bytes(32)``); when set every frame carries an HMAC-SHA256 over its
        sender envelope and payload, and frames that fail it are dropped (counted ``hmac``).
        Required for any socket that binds or connects off loopback.
    :ivar bind_host: interface sockets bind to; loopback by default.
    :ivar replay_window_s: a peer's new epoch (first contact or restart) is adopted only from
        a frame sent within this many seconds of the receiver's wall clock (hosts' clocks must
        agree within it); older frames are dropped as ``replay``.
    :raises ValueError: a field out of range (named with its value).
    """

    max_message_bytes: int = 16 << 20
    hmac_key: bytes | None = None
    bind_host: str = "127.0.0.1"
    replay_window_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise ValueError(
                f"WireConfig.max_message_bytes must be > 0, got {self.max_message_bytes}"
            )
        if self.hmac_key is not None and not self.hmac_key:
            raise ValueError("WireConfig.hmac_key is empty; use None (no key) or a secret")
        if not self.bind_host:
            raise ValueError("WireConfig.bind_host is empty; e.g. '127.0.0.1'")
        if not self.replay_window_s > 0:
            raise ValueError(f"WireConfig.replay_window_s must be > 0, got {self.replay_window_s}")


class ConsensusConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Config of one PP rank's consensus object.

    :ivar pp_rank/pp_size: this rank and the PP world size.
    :ivar endpoints: one ``tcp://host:port`` per PP rank (``endpoints[0]`` is PP0, the leader
        for ``pp0``; ``ring`` uses every rank's endpoint as the address of its inbox).
    :ivar streams: stream names; each has its own gap-free decision sequence.
    :ivar vote_deadline_s: a request id some rank never votes for is decided ``bad`` everywhere
        this long after the first vote for it.
    :ivar peer_timeout_s: a rank silent this long (no vote, no heartbeat) is reported dead.
    :ivar heartbeat_s: heartbeat period of every rank.
    :ivar wire: socket rules (size limit, HMAC, bind interface).
    """

    pp_rank: int
    pp_size: int
    endpoints: tuple[str, ...]
    streams: tuple[str, ...] = STREAMS
    vote_deadline_s: float = 30.0
    peer_timeout_s: float = 10.0
    heartbeat_s: float = 0.5
    wire: WireConfig = WireConfig()

    def __post_init__(self) -> None:
        if self.pp_size <= 0 or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(
                f"ConsensusConfig.pp_rank={self.pp_rank} not in [0, pp_size={self.pp_size})"
            )
        if len(self.endpoints) != self.pp_size:
            raise ValueError(
                f"ConsensusConfig.endpoints has {len(self.endpoints)} entries, "
                f"expected pp_size={self.pp_size}"
            )


class PlannerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Config of a pack planner.

    :ivar packer: ``"auto"`` (Triton on CUDA, torch on CPU), ``"torch"`` or ``"triton"``.
    :ivar pack_threads: CPU threads one torch-packer call gathers with (entries split among
        them); 0 = ``torch.get_num_threads() - 1``, at least 1 (one core is left to the
        transfer engine, whose copy of segment ``k`` overlaps the gather of ``k + 1``). Ignored
        on CUDA.
    """

    packer: str = "auto"
    pack_threads: int = 0

    def __post_init__(self) -> None:
        if self.pack_threads < 0:
            raise ValueError(f"PlannerConfig.pack_threads must be >= 0, got {self.pack_threads}")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Config of the scheduler (send splitting and dynamic chunked prefill).

    :ivar page_size: prefill page size in tokens.
    :ivar chunk_size: base chunked-prefill size in tokens (the "grid"; SGLang
        ``chunked_prefill_size``).
    :ivar smooth_factor: dynamic chunk smoothing in [0, 1] (0 keeps ``chunk_size``).
    :ivar max_prefill_tokens: upper bound of one chunk.
    :ivar context_len: model context length in tokens.
    """

    page_size: int
    chunk_size: int = 8192
    smooth_factor: float = 0.75
    max_prefill_tokens: int = 16384
    context_len: int = 1 << 20


class KVConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Config of one rank's KV sender (prefill) or receiver (decode).

    :ivar instance: instance id shared by all ranks of one prefill or decode instance.
    :ivar role: ``"prefill"`` or ``"decode"``.
    :ivar layout: this rank's KV layout.
    :ivar bootstrap_endpoint: rendezvous endpoint (``tcp://host:port``).
    :ivar bootstrap_timeout_s: a room stuck in Bootstrapping this long fails.
    :ivar rendezvous_timeout_s: how long ``register_kv`` waits for the rendezvous to confirm
        this rank's registration (separate from the room deadlines, so a short
        ``bootstrap_timeout_s`` for fast room failure does not make start-up fragile).
    :ivar rendezvous_refresh_s: a prefill rank registers again at the rendezvous this often
        (seconds; 0: never), so a rendezvous that restarted (its table is in memory) knows
        every live rank again within this time.
    :ivar waiting_timeout_s: a room stuck in WaitingForInput this long fails.
    :ivar transfer_timeout_s: a room stuck in Transferring this long fails.
    :ivar pack_region_tokens: capacity of one pack region in tokens (rounded down to pages).
    :ivar pack_depth: pack regions per destination DCP rank (2 = double buffering).
    :ivar max_dst_dcp: largest decode DCP size the pack buffer is sized for (it holds
        ``(max_dst_dcp + 1) * pack_depth`` regions, one rank's worth kept for another decode
        instance: :func:`pdplug.transfer.regions.make_pack_buffer`).
    :ivar device: ``"cpu"`` or ``"cuda[:n]"`` where KV lives.
    :ivar wire: socket rules.
    :ivar extra: backend-specific options (e.g. ``{"protocol": "tcp"}`` for Mooncake).
    """

    instance: str
    role: str
    layout: KVLayout
    bootstrap_endpoint: str = ""
    bootstrap_timeout_s: float = 30.0
    rendezvous_timeout_s: float = 30.0
    rendezvous_refresh_s: float = 5.0
    waiting_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    pack_region_tokens: int = 8192
    pack_depth: int = 2
    max_dst_dcp: int = 8
    device: str = "cpu"
    wire: WireConfig = WireConfig()
    extra: dict[str, str] = {}

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"KVConfig.role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.rendezvous_timeout_s > 0:
            got = self.rendezvous_timeout_s
            raise ValueError(f"KVConfig.rendezvous_timeout_s must be > 0 seconds, got {got!r}")
        if not 0 <= self.rendezvous_refresh_s < float("inf"):
            got = self.rendezvous_refresh_s
            raise ValueError(f"KVConfig.rendezvous_refresh_s must be >= 0 seconds, got {got!r}")
