"""A cluster on one machine for tests and benchmarks: hosts as Linux network namespaces
joined by veth pairs on a bridge, with addresses that exist only inside them, and the
network faults of a data centre (issue 23). Needs root; :func:`netns_available` says
whether this machine can, and why not.

::

    from pdplug.testing.netns import Cluster

    with Cluster(["prefill", "decode"]) as c:          # 10.213.0.1, 10.213.0.2
        p, d = c["prefill"], c["decode"]
        server = d.popen([sys.executable, "server.py", d.addr])  # runs inside d's namespace
        d.limit(200, latency_ms=20)    # 200 Mbit/s token bucket both ways, <= 20 ms queueing
        d.loss(1)                      # 1 % of frames dropped at the switch, both ways
        p.partition(); p.heal()        # link dropped at the switch, then restored
        with d.starve(): ...           # one busy loop per core of d, pinned
        d.kill(); d.revive()           # host death (link cut, SIGKILL all, no FIN), reboot
        moved = d.counters()           # rx/tx bytes and packets of d's veth

In a test suite: ``pytest_plugins = ["pdplug.testing"]`` gives the :func:`netns_cluster`
fixture (a factory; skips where namespaces cannot be made, fails instead when
``PDPLUG_REQUIRE`` lists ``netns``); :func:`require_netns` applies the rule by hand.

What each fault does, precisely, and the limits (no netem: no fixed latency) are in
``docs/cluster-testing.md`` and :mod:`pdplug.testing.netns.faults`; the clean-up guarantees
in :mod:`pdplug.testing.netns.cleanup`.

Modules: ``cluster`` (hosts, links, faults applied), ``faults`` (argument checks and the
``tc``/nftables text, pure), ``cleanup`` (run ids, :func:`sweep`, signal and exit
handlers), ``cmd`` (the ``ip``/``tc``/``nft`` runner), ``probe`` (availability, the pytest
rule and fixture). Imports nothing from the reference host, the benchmarks or a plugin.
"""

from __future__ import annotations

from pdplug.testing.netns.cleanup import RunId, interrupted, sweep
from pdplug.testing.netns.cluster import (
    BRIDGE,
    DEFAULT_LATENCY_MS,
    DEV,
    Cluster,
    Host,
    LinkCounters,
    Starvation,
    Undo,
)
from pdplug.testing.netns.cmd import NetnsError, list_namespaces
from pdplug.testing.netns.faults import DIRECTIONS
from pdplug.testing.netns.probe import NETNS, netns_available, netns_cluster, require_netns

__all__ = [
    "Cluster",
    "Host",
    "LinkCounters",
    "Starvation",
    "Undo",
    "RunId",
    "NetnsError",
    "netns_available",
    "require_netns",
    "netns_cluster",
    "sweep",
    "interrupted",
    "list_namespaces",
    "DEV",
    "BRIDGE",
    "DEFAULT_LATENCY_MS",
    "DIRECTIONS",
    "NETNS",
]
