"""Create pdplug's ZMQ sockets under the wire rules and drain them through a codec.

:func:`make_socket` creates every pdplug socket: ``ZMQ_MAXMSGSIZE`` from the wire config
(libzmq drops the connection of a peer announcing a larger frame before buffering it), linger
0, and the security rule: a socket that binds or connects off loopback (not 127.0.0.0/8, ``::1``
or ``localhost``) without ``WireConfig.hmac_key`` is refused. :func:`drain` is the one
non-blocking receive loop (ROUTER or not), yielding authenticated :class:`Inbound` frames.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from pdplug.config import WireConfig
from pdplug.wire.codec import Codec, Inbound

__all__ = ["drain", "endpoint_of", "is_loopback", "make_socket", "require_key"]

_TCP = re.compile(r"^tcp://(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:/\s]+)):(?P<port>\d+|\*)$")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost``, in 127.0.0.0/8 or ``::1`` (names are not resolved)."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def require_key(wire: WireConfig, host: str, *, what: str) -> None:
    """Refuse to use ``host`` off loopback without a shared key.

    :param host: the interface bound to or the peer connected to.
    :param what: who is asking (named in the error).
    :raises ValueError: ``host`` is not loopback and ``wire.hmac_key`` is ``None``.
    """
    if wire.hmac_key is None and not is_loopback(host):
        raise ValueError(
            f"{what}: host {host!r} is off loopback and WireConfig.hmac_key is None; refusing "
            "to start an unauthenticated socket. Set WireConfig.hmac_key to a shared secret "
            "(the same bytes on every process, e.g. secrets.token_bytes(32)) or bind to "
            "127.0.0.1"
        )


def _host_of(endpoint: str) -> str | None:
    """Host of a ``tcp://`` endpoint; ``None`` for local transports (inproc, ipc)."""
    if not endpoint.startswith("tcp://"):
        return None
    m = _TCP.match(endpoint)
    if m is None:
        raise ValueError(f"endpoint {endpoint!r} is not 'tcp://host:port'")
    return m.group("v6") or m.group("host")


def make_socket(
    ctx: zmq.Context,
    kind: int,
    wire: WireConfig,
    *,
    bind: int | str | None = None,
    connect: str | Sequence[str] = (),
    linger_ms: int = 0,
    hwm: int | None = None,
    name: str = "socket",
) -> zmq.Socket:
    """A ZMQ socket configured by the wire rules, bound and/or connected.

    Sets ``ZMQ_MAXMSGSIZE = wire.max_message_bytes`` (a peer announcing a larger frame is
    disconnected before anything is buffered), ``ZMQ_LINGER = linger_ms`` and, when given, both
    high-water marks. Checks :func:`require_key` for the bind interface and every ``tcp://``
    peer before creating anything.

    :param ctx: the ZMQ context.
    :param kind: ``zmq.ROUTER``, ``zmq.DEALER``, …
    :param wire: socket rules (size limit, key, bind interface).
    :param bind: a TCP port on ``wire.bind_host`` (0: a free one; read it with
        :func:`endpoint_of`), or a full endpoint (``inproc://…``, ``tcp://…``).
    :param connect: endpoint(s) to connect to.
    :param linger_ms: ``ZMQ_LINGER`` (ms); 0 drops unsent frames on close.
    :param hwm: ``ZMQ_SNDHWM`` and ``ZMQ_RCVHWM`` (frames; 0 = unbounded).
    :param name: who creates it (named in errors).
    :raises ValueError: off loopback without ``wire.hmac_key``, or a malformed endpoint.
    :raises zmq.ZMQError: the bind or connect failed (address in use, bad interface).
    """
    peers = [connect] if isinstance(connect, str) else list(connect)
    if isinstance(bind, int):
        bind_ep = "" if bind == 0 else f"tcp://{_bracket(wire.bind_host)}:{bind}"
        require_key(wire, wire.bind_host, what=f"{name}: bind")
    else:
        bind_ep = bind or ""
    for ep in ([bind_ep] if bind_ep else []) + peers:
        host = _host_of(ep)
        if host is not None:
            require_key(wire, host, what=f"{name}: {ep}")
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.max_message_bytes)
        if hwm is not None:
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
        if ":" in wire.bind_host or any(":" in (_host_of(p) or "") for p in peers):
            sock.setsockopt(zmq.IPV6, 1)
        if bind == 0:
            sock.bind_to_random_port(f"tcp://{_bracket(wire.bind_host)}")
        elif bind_ep:
            sock.bind(bind_ep)
        for ep in peers:
            sock.connect(ep)
    except BaseException:
        sock.close(0)
        raise
    return sock


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def endpoint_of(sock: zmq.Socket) -> str:
    """The endpoint ``sock`` last bound (``tcp://host:port``)."""
    ep = sock.getsockopt(zmq.LAST_ENDPOINT)
    return ep.decode() if isinstance(ep, bytes) else str(ep)


def drain(sock: zmq.Socket, codec: Codec[Any], *, limit: int = 1 << 16) -> Iterator[Inbound]:
    """Receive, without blocking, every frame waiting on ``sock``; yield the accepted ones.

    A ROUTER frame must be exactly ``[routing id, frame]``, any other socket's exactly
    ``[frame]``; anything else is dropped as ``malformed``. Frames go through
    :meth:`Codec.decode_from`, which drops and counts the rest.

    :param sock: the socket to read (only from the thread that owns it).
    :param codec: the socket's codec.
    :param limit: most frames read in one call (the caller's loop keeps its other work).
    :raises zmq.ZMQError: the socket is closed or broken (not ``EAGAIN``).
    """
    want = 2 if sock.type == zmq.ROUTER else 1
    for _ in range(limit):
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(parts) != want:
            codec.drop("malformed")
            continue
        got = codec.decode_from(parts[-1], parts[0] if want == 2 else b"")
        if got is not None:
            yield got
