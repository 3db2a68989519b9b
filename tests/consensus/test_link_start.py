"""The consensus link's I/O thread starts only after its owner holds the link.

Found by CI (py310-core, 2026-12-03): ``examples/consensus_pp.py`` at pp0 failed with
``AttributeError: 'PP0Consensus' object has no attribute '_link'``: the link started its
thread inside its constructor, and PP0's first tick decided a room and called
``self._link.send_now`` before ``_start_link`` had assigned ``self._link``.
"""

from __future__ import annotations

import threading
import time

from pdplug import ConsensusConfig
from pdplug.ports import free_endpoints
from pdplug_consensus.link import Link
from pdplug_consensus.messages import Heartbeat, identities
from pdplug_consensus.pp0 import PP0Consensus, make_pp0


def _config() -> ConsensusConfig:
    return ConsensusConfig(pp_rank=0, pp_size=2, endpoints=free_endpoints(2), heartbeat_s=0.05)


def test_no_callback_runs_before_start_and_an_unstarted_link_closes() -> None:
    cfg = _config()
    ticks: list[float] = []
    started = threading.Event()

    def tick(now: float) -> None:
        ticks.append(now)
        started.set()

    pp0 = make_pp0(_config())  # only for its codec (its own endpoints)
    try:
        link = Link(
            config=cfg, codec=pp0._codec, identities=identities(cfg, "pp0"), out_peers=(1,),
            in_peers=(1,), heartbeat=lambda dead: Heartbeat(rank=0, dead=dead), on_tick=tick,
            tick_s=0.001, name="probe",
        )  # fmt: skip
        time.sleep(0.2)
        assert ticks == []  # the thread has not run
        link.start()
        assert started.wait(5.0)
        link.close()
        cfg = _config()
        unstarted = Link(
            config=cfg, codec=pp0._codec, identities=identities(cfg, "pp0"),
            out_peers=(1,), in_peers=(1,), heartbeat=lambda dead: Heartbeat(rank=0, dead=dead),
            name="probe",
        )  # fmt: skip
        unstarted.close()  # no join of a thread never started
    finally:
        pp0.close()


def test_a_leader_whose_first_tick_sends_finds_its_link(monkeypatch) -> None:
    """The leader's tick sends a decision from its very first call (as when peers' votes
    were queued before it started): it must find ``_link``, whatever the thread timing."""
    sent: list[int] = []
    orig = PP0Consensus._leader_tick

    def first_tick_sends(self: PP0Consensus, now: float) -> None:
        if not sent:
            sent.append(1)
            self._link.send_now(1, b"")  # raised AttributeError before the fix, at times
        orig(self, now)

    monkeypatch.setattr(PP0Consensus, "_leader_tick", first_tick_sends)
    with make_pp0(_config()) as leader:
        t0 = time.monotonic()
        while not sent and time.monotonic() - t0 < 5.0:
            leader.poll()
            time.sleep(0.01)
        leader.poll()  # re-raises an I/O thread failure
    assert sent == [1]
