"""pdplug.ports: ports picked before the ranks bind them stay clear of the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from pdplug import ports


def test_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    lo, hi = ports.ephemeral_port_range()
    got = ports.free_ports(16)
    assert len(set(got)) == 16
    for p in got:
        assert ports._LOWEST <= p < 65_536
        assert not lo <= p <= hi, (p, lo, hi)
        with socket.socket() as s:  # released: a rank can bind it now
            s.bind(("127.0.0.1", p))


def test_outgoing_connections_never_take_a_picked_port() -> None:
    # the CI failure: ephemeral ports of many connects landed on a port picked for a rank
    picked = set(ports.free_ports(8))
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        conns = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            conns.append(c)
        local = {c.getsockname()[1] for c in conns}
        assert not local & picked
        for c in conns:
            c.close()
        server.close(0)
    finally:
        ctx.term()


def test_endpoints_and_zero() -> None:
    eps = ports.free_endpoints(3, "127.0.0.1")
    assert len(eps) == 3 and all(e.startswith("tcp://127.0.0.1:") for e in eps)
    assert ports.free_ports(0) == []


def test_negative_count_names_the_value() -> None:
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        ports.free_ports(-1)


def test_unreadable_range_falls_back_to_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_port_range() == (32_768, 60_999)
    bad = tmp_path / "bad"
    bad.write_text("not ports\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", bad)
    assert ports.ephemeral_port_range() == (32_768, 60_999)


def test_range_covering_everything_falls_back_to_kernel_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wide = tmp_path / "range"
    wide.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", wide)
    got = ports.free_ports(4)
    assert len(set(got)) == 4 and all(0 < p < 65_536 for p in got)


def test_separate_calls_never_hand_out_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # one call per consensus implementation, bound later: a repeat would fail the second bind
    # no pool outside the ephemeral range: the kernel's choice, still never repeated
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (1_024, 65_535))
    seen: set[int] = set()
    for _ in range(50):
        got = ports.free_ports(8)
        assert not seen & set(got)
        seen |= set(got)


def test_a_small_pool_is_never_repeated_within_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "_LOWEST", 20_000)
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: (21_100, 65_535))
    seen: set[int] = set()
    for _ in range(60):  # 480 of the 1,100 ports of the pool
        got = ports.free_ports(8)
        assert all(20_000 <= p < 21_100 for p in got)
        assert not seen & set(got)
        seen |= set(got)
