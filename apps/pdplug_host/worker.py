"""What every reference-host worker process shares: its spec, the driver link, gloo set-up."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from pdplug import Consensus, PluginManager
from pdplug.config import ConsensusConfig, KVConfig, WireConfig
from pdplug.kvtypes import KVLayout
from pdplug.manager import EXTENSION_POINTS
from pdplug_host.config import ModelConfig
from pdplug_host.messages import Fatal, WorkerStats, to_driver_codec, to_worker_codec

__all__ = [
    "POINTS",
    "WorkerSpec",
    "DriverLink",
    "init_gloo",
    "close_quietly",
    "run_worker",
    "setup_logging",
]

#: the extension points every worker reports (which plugin served each)
POINTS = tuple(EXTENSION_POINTS)


def setup_logging(log_path: str = "") -> None:
    """Worker log level from ``PDPLUG_LOG_LEVEL`` (default WARNING).

    With ``log_path``, the process's stdout and stderr (file descriptors 1 and 2, so native
    transfer-engine logs too) go to that file; without, both go to the driver's stderr, so the
    report on the driver's stdout stays clean. Mooncake's transfer engine logs at ``ERROR``
    only (``MC_LOG_LEVEL``, read when its engine starts) unless ``PDPLUG_LOG_LEVEL=DEBUG`` or
    ``MC_LOG_LEVEL`` is set.
    """
    import logging
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    else:
        os.dup2(2, 1)

    level = os.environ.get("PDPLUG_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    # Transfer engines are chatty at INFO; keep the demo's terminal readable unless asked.
    if level != "DEBUG":
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake
        logging.getLogger("NIXL").setLevel(logging.WARNING)


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a prefill or decode worker process needs (sent at spawn).

    :ivar role: ``"prefill"`` or ``"decode"``; ``rank``/``size``: PP rank (prefill) or DCP rank
        (decode) and the instance's size.
    :ivar model: model config; ``page_size`` tokens per page; ``num_pages`` KV pages per rank.
    :ivar block_tokens: tokens per trace hash block (prefix-cache granularity).
    :ivar names: selected component names per extension point.
    :ivar consensus_endpoints: one ``tcp://`` endpoint per rank of this instance.
    :ivar gloo_port: rendezvous port of this instance's gloo group (unused when ``size == 1``).
    :ivar to_worker/to_driver: the driver's PUSH endpoint for this worker and its PULL endpoint.
    :ivar bootstrap: rendezvous endpoint; ``prefill_instance``: id of the prefill instance.
    :ivar chunk_size: base chunked-prefill size (tokens); ``pack_region_tokens``: pack capacity.
    :ivar timeout_s: bound on every wait (KV room timeouts, gloo, consensus peers).
    :ivar device: where the model, its KV cache and the pack buffer live (``"cpu"``,
        ``"cuda"``); tensors cross gloo on the CPU.
    :ivar max_dst_dcp: a prefill's ``KVConfig.max_dst_dcp``: the largest decode DCP size its
        pack buffer is sized for (at least the demo's ``--decode-dcp``).
    """

    role: str
    rank: int
    size: int
    model: ModelConfig
    page_size: int
    num_pages: int
    block_tokens: int
    names: dict[str, str]
    consensus_endpoints: tuple[str, ...]
    gloo_port: int
    to_worker: str
    to_driver: str
    bootstrap: str
    prefill_instance: str = "prefill-0"
    decode_instance: str = "decode-0"
    chunk_size: int = 128
    pack_region_tokens: int = 256
    timeout_s: float = 30.0
    profile: bool = True
    log_path: str = ""
    wire: WireConfig = WireConfig()
    device: str = "cpu"
    max_dst_dcp: int = 8


def init_gloo(rank: int, size: int, port: int, timeout_s: float) -> Any:
    """Join this instance's gloo group (``None`` when ``size == 1``).

    Collectives time out after ``timeout_s`` seconds, so a dead peer ends in an error.
    """
    if size == 1:
        return None
    import torch.distributed as dist

    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


class DriverLink:
    """The worker's two sockets to the driver: PULL (requests in) and PUSH (results out)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(spec.to_worker)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.connect(spec.to_driver)
        self.rx = to_worker_codec(spec.wire)
        self.tx = to_driver_codec(spec.wire)

    def recv_all(self) -> list[Any]:
        """Every message waiting now (non-blocking); malformed frames are dropped and counted."""
        out: list[Any] = []
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self.rx.decode(frame)
            if msg is not None:
                out.append(msg)

    def send(self, msg: Any) -> None:
        """Push one message to the driver."""
        self.outbox.send(self.tx.encode(msg))

    def fatal(self, message: str) -> None:
        """Report a fatal error to the driver (best effort) before the worker exits."""
        try:
            self.send(Fatal(role=self.spec.role, rank=self.spec.rank, message=message))
            time.sleep(0.2)
        except Exception:
            pass

    def close(self) -> None:
        """Close both sockets."""
        self.inbox.close(linger=0)
        self.outbox.close(linger=1000)


def kv_config(spec: WorkerSpec, layout: KVLayout, **extra: Any) -> KVConfig:
    """This rank's KV sender/receiver config: its role's instance, the rendezvous, and
    ``spec.timeout_s`` for every room deadline.

    :param spec: the worker's spec (role, instances, rendezvous, timeout, wire rules).
    :param layout: this rank's KV layout.
    :param extra: further :class:`~pdplug.config.KVConfig` fields (e.g. ``pack_region_tokens``).
    :raises ValueError: a field out of range (from :class:`~pdplug.config.KVConfig`).
    """
    return KVConfig(
        instance=spec.prefill_instance if spec.role == "prefill" else spec.decode_instance,
        role=spec.role,
        layout=layout,
        bootstrap_endpoint=spec.bootstrap,
        bootstrap_timeout_s=spec.timeout_s,
        waiting_timeout_s=spec.timeout_s,
        transfer_timeout_s=spec.timeout_s,
        wire=spec.wire,
        device=spec.device,
        **extra,
    )


def make_consensus(pm: PluginManager, spec: WorkerSpec) -> Consensus:
    """The consensus of this rank's instance (its ranks: ``spec.rank`` of ``spec.size``):
    peers silent for ``timeout_s`` are dead, votes not matched within ``2 * timeout_s`` fail.

    :param pm: the worker's plugin manager.
    :param spec: the worker's spec (``names["consensus"]`` selects the implementation).
    """
    cfg = ConsensusConfig(
        pp_rank=spec.rank,
        pp_size=spec.size,
        endpoints=spec.consensus_endpoints,
        peer_timeout_s=spec.timeout_s,
        vote_deadline_s=spec.timeout_s * 2,
        wire=spec.wire,
    )
    return pm.make_consensus(cfg, name=spec.names.get("consensus"))


def send_stats(link: DriverLink, own: dict[str, Any], **parts: Any) -> None:
    """Report a rank's counters to the driver as one ``WorkerStats``.

    :param link: the rank's driver link (its spec names the role and rank).
    :param own: the rank's own counters.
    :param parts: components with ``stats()``; their counters are prefixed ``<name>_``
        (``sender=...`` gives ``sender_bytes``, ...), after ``own``.
    """
    stats = dict(own)
    for prefix, part in parts.items():
        stats.update({f"{prefix}_{k}": v for k, v in part.stats().items()})
    link.send(WorkerStats(role=link.spec.role, rank=link.spec.rank, stats=stats))


def close_quietly(link: DriverLink, *objs: Any) -> None:
    """Close a rank's components (consensus, KV sender/receiver), then its driver link;
    teardown errors are swallowed so one failing close does not leak the others."""
    for obj in objs:
        try:
            obj.close()
        except Exception:
            pass
    link.close()


class _Rank(Protocol):
    link: DriverLink

    def run(self) -> None: ...

    def close(self) -> None: ...


def run_worker(spec_bytes: bytes, make: Callable[[WorkerSpec], _Rank]) -> None:
    """Body of a worker process: decode the spec, build the rank, serve, report, exit.

    A failure is printed to the worker log and reported to the driver as ``Fatal``; the
    process exits with code 0 or 1 after the rank closed its engines.
    """
    import traceback

    import torch

    torch.set_num_threads(1)
    spec = msgspec.msgpack.decode(spec_bytes, type=WorkerSpec)
    setup_logging(spec.log_path)
    rank: _Rank | None = None
    code = 0
    try:
        rank = make(spec)
        rank.run()
    except BaseException as e:
        code = 1
        traceback.print_exc()
        link = rank.link if rank else DriverLink(spec)
        link.fatal(f"{type(e).__name__}: {e}")
    finally:
        if rank is not None:
            rank.close()
    sys.exit(code)
