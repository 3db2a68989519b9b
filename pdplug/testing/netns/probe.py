"""Whether network namespaces can be made here, and the pytest rule built on it: a test that
needs them skips naming why, unless ``PDPLUG_REQUIRE`` lists ``netns`` (CI, as root): then a
missing capability is a failure."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from typing import Any

import pytest

from pdplug.testing.netns.cluster import Cluster
from pdplug.testing.netns.cmd import NetnsError, list_namespaces
from pdplug.testing.require import REQUIRE_ENV, required_modules

__all__ = ["NETNS", "TOOLS", "netns_available", "require_netns", "netns_cluster"]

#: the name ``PDPLUG_REQUIRE`` lists to make the harness mandatory
NETNS = "netns"
#: programs the harness runs -> the Debian package that has them
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "nft": "nftables",
    "taskset": "util-linux",
}
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


def _capabilities() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0  # pragma: no cover - every Linux has the line


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """Whether the harness can build a cluster on this machine, and why not.

    Checks, in order: Linux with ``/proc``; CAP_SYS_ADMIN and CAP_NET_ADMIN (root); the
    programs of :data:`TOOLS` on ``PATH``; then builds a real one-host cluster, applies a
    bucket and a loss rule and removes it (kernel support for namespaces, veth, bridges,
    ``tbf`` and nftables' bridge family). The answer is cached for the process
    (``netns_available.cache_clear()`` asks again).

    :returns: ``(True, "")`` or ``(False, reason)``, the reason naming what is missing and
        how to get it.
    """
    if not os.path.exists("/proc/self/ns/net"):
        return False, "no /proc/self/ns/net: network namespaces need Linux"
    caps = _capabilities()
    missing_caps = [
        name
        for bit, name in ((_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (_CAP_NET_ADMIN, "CAP_NET_ADMIN"))
        if not caps >> bit & 1
    ]
    if missing_caps:
        return False, (
            f"needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root): {' and '.join(missing_caps)} "
            f"missing (euid {os.geteuid()})"
        )
    absent = [
        f"{tool} (apt-get install {pkg})" for tool, pkg in TOOLS.items() if not shutil.which(tool)
    ]
    if absent:
        return False, f"not on PATH: {', '.join(absent)}"
    try:
        with Cluster(["probe"], prefix="pdpprobe") as c:
            c["probe"].limit(100)
            c["probe"].loss(1)
    except (NetnsError, OSError) as e:
        return False, f"a probe cluster could not be built: {e}"
    return True, ""


def require_netns(env: Mapping[str, str] | None = None) -> None:
    """Skip the calling test (or module, at module level) when namespaces cannot be made
    here, naming why; fail instead when ``PDPLUG_REQUIRE`` lists ``netns``.

    :param env: environment mapping (default ``os.environ``).
    :raises pytest.skip.Exception: unavailable and not required.
    :raises pytest.fail.Exception: unavailable and required.
    """
    ok, why = netns_available()
    if ok:
        return
    if NETNS in required_modules(env):
        pytest.fail(f"network namespaces are required ({REQUIRE_ENV} lists netns): {why}", False)
    pytest.skip(f"needs network namespaces: {why}", allow_module_level=True)


def _leftovers(clusters: list[Cluster]) -> list[str]:
    names = list_namespaces()
    return [ns for ns in names for c in clusters if c.run_id.owns(ns)]


@pytest.fixture
def netns_cluster() -> Iterator[Callable[..., Cluster]]:
    """Factory of started clusters for one test: ``netns_cluster(["prefill", "decode"],
    **kw)`` takes :class:`~pdplug.testing.netns.Cluster`'s arguments and returns it open.
    Applies :func:`require_netns` first. At teardown every cluster is closed and the test
    fails if any of their namespaces is left."""
    require_netns()
    made: list[Cluster] = []
    with ExitStack() as stack:

        def make(hosts: Any, **kw: Any) -> Cluster:
            c = stack.enter_context(Cluster(hosts, **kw))
            made.append(c)
            return c

        yield make
    left = _leftovers(made)
    assert not left, f"namespaces left after the test: {left}"
