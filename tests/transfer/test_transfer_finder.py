"""The decode's search for a prefill instance (:class:`pdplug.transfer.refind.Finder`) against a
real rendezvous server that never hears of it: what the search reports, and how it says it."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest

from pdplug.bootstrap import RendezvousServer, resolve
from pdplug.config import WireConfig
from pdplug.errors import TransferError
from pdplug.transfer.refind import Finder

pytestmark = pytest.mark.timeout(60)


def test_resolving_an_instance_no_rank_registered_says_so() -> None:
    with RendezvousServer() as server, pytest.raises(TransferError) as ei:
        resolve(server.endpoint, "prefill-nobody", timeout_s=0.5)
    msg = str(ei.value)
    assert "'prefill-nobody' not ready after 0.5 s (no rank of it registered)" in msg, msg
    assert "?" not in msg, msg
    with pytest.raises(ValueError, match=r"resolve: instance='' must be a non-empty prefill name"):
        resolve("tcp://127.0.0.1:9", "", timeout_s=0.5)  # refused before any socket


@pytest.mark.parametrize("connected_before", [False, True])
def test_a_search_that_ends_unfound_says_again_only_for_an_instance_once_connected(
    connected_before: bool, caplog: pytest.LogCaptureFixture
) -> None:
    ended: list[tuple[str, str | None]] = []
    done = threading.Event()
    counts: Counter[str] = Counter()

    def on_found(instance: str, error: str | None, since: float) -> None:
        ended.append((instance, error))
        done.set()

    def never_called(*_: object) -> None:  # nothing resolves: no handshake is tried
        raise AssertionError("connect without a resolved instance")

    with RendezvousServer() as server:
        finder = Finder(
            name="decode-0", connect=never_called, submit=lambda fn: fn(), on_found=on_found,
            timeout_s=0.5, retry_s=0.2, wire=WireConfig(), counts=counts,
        )  # fmt: skip
        if connected_before:
            finder.remember("prefill-x", server.endpoint)
        else:
            finder.rendezvous["prefill-x"] = server.endpoint  # KVReceiver.find's entry
        with caplog.at_level(logging.WARNING, logger="pdplug.transfer.refind"):
            assert finder.start("prefill-x")
            assert done.wait(20)
    assert ended and ended[0][0] == "prefill-x" and "no rank of it registered" in str(ended[0][1])
    assert counts["refind_failed"] == 1 and not finder.busy("prefill-x")
    said = [r.getMessage() for r in caplog.records if "prefill-x" in r.getMessage()]
    want = "not found again: " if connected_before else "not found: "
    assert len(said) == 1 and want in said[0], said
