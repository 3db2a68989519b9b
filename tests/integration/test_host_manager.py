"""The host's manager is the one used (issue 10 item 7): sessions built by a PluginManager
consult THAT manager's ``pdplug_check_compat`` vetoes and report to THAT manager's observers,
never a hidden process-wide manager (field case D4_host_manager_veto.py); the reference host's
option check reads the environment it runs in, whatever ran before it."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from pdplug import CompatError, KVConfig, KVLayout, KVPoll, PluginManager, hookimpl
from pdplug.bootstrap import RendezvousServer, resolve
from pdplug.testing import EventLog, require
from pdplug.types import Segment

LAYOUT = KVLayout(page_size=16, entry_bytes_per_token=(64,))


class Veto:
    """A host-side plugin that refuses every peer."""

    @hookimpl
    def pdplug_check_compat(self, local: Any, remote: Any) -> list[str]:
        return ["veto: this host refuses every peer"]


def _kv() -> list[torch.Tensor]:
    return [torch.arange(16 * 4 * 64, dtype=torch.int64).to(torch.uint8).reshape(16 * 4, 64)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_the_host_managers_veto_refuses_the_peer(backend: str) -> None:
    """D4: a veto registered on the host's own manager (not the process-wide one) is obeyed."""
    require(backend)
    pm = PluginManager(env={}, plugins=[("veto", Veto())])
    with RendezvousServer() as server:
        cfg = KVConfig(
            instance=f"p-veto-{backend}",
            role="prefill",
            layout=LAYOUT,
            bootstrap_endpoint=server.endpoint,
        )
        s = pm.make_kv_sender(cfg, name=backend)
        r = pm.make_kv_receiver(KVConfig(instance="d", role="decode", layout=LAYOUT), name=backend)
        try:
            kept = [_kv(), _kv()]  # registered memory must outlive the sessions
            s.register_kv(kept[0])
            r.register_kv(kept[1])
            assert pm.check_compat(s.peer_info(), r.peer_info()) == [
                "veto: this host refuses every peer"
            ]
            peers = resolve(server.endpoint, cfg.instance, timeout_s=10)
            with pytest.raises(CompatError, match="veto: this host refuses every peer"):
                r.connect(peers, timeout_s=10)
        finally:
            r.close()
            s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_room_outcomes_reach_the_host_managers_observers(backend: str) -> None:
    require(backend)
    seen = EventLog()
    pm = PluginManager(env={}, plugins=[("observer", seen)])
    with RendezvousServer() as server:
        cfg = KVConfig(
            instance=f"p-obs-{backend}",
            role="prefill",
            layout=LAYOUT,
            bootstrap_endpoint=server.endpoint,
        )
        s = pm.make_kv_sender(cfg, name=backend)
        r = pm.make_kv_receiver(KVConfig(instance="d", role="decode", layout=LAYOUT), name=backend)
        dst = [torch.zeros(16 * 4, 64, dtype=torch.uint8)]
        try:
            src = _kv()  # registered memory must outlive the session
            s.register_kv(src)
            r.register_kv(dst)
            r.connect(resolve(server.endpoint, cfg.instance, timeout_s=10), timeout_s=10)
            s.start(5)
            r.expect(5, np.array([2, 3], dtype=np.int64), num_tokens=32)
            assert s.wait(5, (KVPoll.WaitingForInput,), timeout_s=20) == KVPoll.WaitingForInput
            seg = Segment(
                token_start=0, token_end=32, page_start=0, num_tokens=32, chunk_id=0, is_last=True
            )
            s.send(5, seg, np.array([0, 1], dtype=np.int64))
            assert s.wait(5, timeout_s=20) == KVPoll.Success, s.failure_reason(5)
            assert r.wait(5, timeout_s=20) == KVPoll.Success, r.failure_reason(5)
            assert torch.equal(dst[0][32:64], src[0][0:32])
            # a room the prefill aborts once both sides hold it: a failure on each side
            s.start(6)
            r.expect(6, np.array([0, 1], dtype=np.int64), num_tokens=32)
            assert s.wait(6, (KVPoll.WaitingForInput,), timeout_s=20) == KVPoll.WaitingForInput
            s.abort(6)
            assert r.wait(6, timeout_s=20) == KVPoll.Failed
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(seen.events) < 4:
                time.sleep(0.01)
            done = sorted((e.kind, e.room) for e in seen.events)
            assert done == [("transfer_done", 5), ("transfer_done", 5), ("transfer_failed", 6),
                            ("transfer_failed", 6)], seen.events  # fmt: skip
            # the prefill's outcomes (built off the send path since issue 24) carry its rank,
            # the lease generation, its destination count and, on a failure, the reason
            mine = {e.kind: e.fields for e in seen.events if "dests" in e.fields}
            assert set(mine) == {"transfer_done", "transfer_failed"}, seen.events
            assert set(mine["transfer_done"]) == {"rank", "generation", "dests"}, mine
            assert mine["transfer_done"]["dests"] == 1 and mine["transfer_done"]["rank"] == 0
            assert mine["transfer_failed"]["reason"] == "aborted on prefill rank 0: aborted", mine
            assert mine["transfer_failed"]["generation"] != mine["transfer_done"]["generation"]
        finally:
            r.close()
            s.close()


def test_demo_option_check_reads_the_environment_it_runs_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order-dependent demo CLI failure: a first check built a process-wide manager, and
    a later PDPLUG_DISABLE_PLUGINS was never seen (the demo then started and timed out)."""
    from pdplug_host.driver import DemoError, DemoOptions, check_options

    for key in [k for k in os.environ if k.startswith("PDPLUG_")]:
        monkeypatch.delenv(key)
    with pytest.raises(DemoError, match="no kv_sender named 'nope'"):
        check_options(DemoOptions(kv_sender="nope"))
    monkeypatch.setenv("PDPLUG_DISABLE_PLUGINS", "pdplug-nixl")
    with pytest.raises(DemoError, match=r"Blocked plugins .*pdplug-nixl"):
        check_options(DemoOptions())
