"""A decode worker asks a dead prefill instance once per ``bootstrap_timeout_s``: the next
requests naming it fail at once, naming the first failure, instead of each stalling the
engine's step for the whole timeout (found by a new user: two stalls per bad request)."""

from __future__ import annotations

import socket
import time

import pytest

from pdplug.adapters.resolve import Resolver
from pdplug.errors import TransferError


def _dead_endpoint() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_dead_prefill_instance_stalls_once_per_timeout() -> None:
    ep = _dead_endpoint()
    r = Resolver(timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(Exception) as first:
        r.resolve("gone", ep)
    assert time.monotonic() - t0 >= 0.4  # the one real wait
    t1 = time.monotonic()
    with pytest.raises(TransferError, match=r"prefill instance 'gone' at .* did not resolve") as e:
        r.resolve("gone", ep)
    assert time.monotonic() - t1 < 0.2  # at once
    assert type(first.value).__name__ in str(e.value)
    assert "bootstrap_timeout_s=0.5" in str(e.value)
    time.sleep(0.55)  # the failure is forgotten after the timeout: asked again
    t2 = time.monotonic()
    with pytest.raises(Exception) as again:
        r.resolve("gone", ep)
    assert not isinstance(again.value, TransferError) or "did not resolve" not in str(again.value)
    assert time.monotonic() - t2 >= 0.4
    # another instance is not affected by this one's failure
    with pytest.raises(Exception) as other:
        r.resolve("other", ep)
    assert "did not resolve" not in str(other.value)
