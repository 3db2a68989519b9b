"""Config checks and constants shared by ``pp0`` and ``ring`` (no sockets, no threads)."""

from __future__ import annotations

import re

from pdplug import ConsensusConfig

__all__ = ["check_config", "horizon_s", "parse_port"]

_ENDPOINT = re.compile(r"^tcp://(?P<host>[^:/\s]+|\[[0-9a-fA-F:]+\]):(?P<port>\d+)$")


def parse_port(endpoint: str, field: str) -> int:
    """TCP port of ``tcp://host:port``.

    :raises ValueError: naming ``field`` and the value when it is not ``tcp://host:port`` with
        a port in 1..65535.
    """
    m = _ENDPOINT.match(endpoint)
    port = int(m.group("port")) if m else 0
    if not m or not 0 < port < 65536:
        raise ValueError(f"{field}={endpoint!r} is not 'tcp://host:port' with port in 1..65535")
    return port


def check_config(config: ConsensusConfig) -> None:
    """Validate the fields both implementations rely on.

    :raises ValueError: naming the field and the value at fault.
    """
    if not config.streams:
        raise ValueError("ConsensusConfig.streams is empty; name at least one stream")
    if len(set(config.streams)) != len(config.streams):
        raise ValueError(f"ConsensusConfig.streams={config.streams!r} has duplicates")
    if not config.vote_deadline_s > 0:
        raise ValueError(f"ConsensusConfig.vote_deadline_s={config.vote_deadline_s} must be > 0")
    if not config.heartbeat_s > 0:
        raise ValueError(f"ConsensusConfig.heartbeat_s={config.heartbeat_s} must be > 0")
    if not config.peer_timeout_s > config.heartbeat_s:
        raise ValueError(
            f"ConsensusConfig.peer_timeout_s={config.peer_timeout_s} must exceed "
            f"heartbeat_s={config.heartbeat_s}"
        )
    for i, ep in enumerate(config.endpoints):
        parse_port(ep, f"ConsensusConfig.endpoints[{i}]")


def horizon_s(config: ConsensusConfig) -> float:
    """How long decided / aborted request ids are remembered (seconds).

    Late votes for a decided id are ignored for this long; after it an id may be reused.
    """
    return max(60.0, 4.0 * config.vote_deadline_s)
