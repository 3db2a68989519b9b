"""The commands the namespace harness runs (``ip``, ``tc``, ``nft``) and the namespace
book-keeping it reads from ``/proc``: one place that turns a failed command into a
:class:`NetnsError` naming the command, its exit status and its stderr.

Every call is bounded (:data:`TIMEOUT_S`); nothing here touches the root namespace's links.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from pdplug.errors import PdplugError

__all__ = [
    "NETNS_DIR",
    "TIMEOUT_S",
    "NetnsError",
    "run_cmd",
    "ip_batch",
    "nft_apply",
    "list_namespaces",
    "ns_pids",
    "kill_ns_processes",
    "delete_namespaces",
]

#: where ``ip netns add`` bind-mounts a named namespace (iproute2's ``/var/run/netns``)
NETNS_DIR = Path("/var/run/netns")
#: seconds any one harness command may take before it counts as failed
TIMEOUT_S = 20.0


class NetnsError(PdplugError, RuntimeError):
    """A namespace, link, qdisc or nftables command of the harness failed, or the harness was
    used in a state that cannot work (a dead host asked to start a process, a closed cluster)."""


def run_cmd(argv: Sequence[str], *, stdin: str | None = None, timeout: float = TIMEOUT_S) -> str:
    """Run one command and return its stdout.

    :param argv: the command (``["ip", "-n", ns, "link", ...]``).
    :param stdin: text fed to its standard input (``ip -batch -``, ``nft -f -``).
    :param timeout: seconds before the command is killed and counted as failed.
    :returns: its standard output.
    :raises NetnsError: it exited non-zero, timed out, or could not be started; the message
        names the command, the status and its stderr.
    """
    try:
        proc = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {type(e).__name__}: {e}") from e
    if proc.returncode != 0:
        detail = proc.stderr.strip() or proc.stdout.strip()
        where = f"\n--- input ---\n{stdin}" if stdin else ""
        raise NetnsError(f"{' '.join(argv)} exited {proc.returncode}: {detail}{where}")
    return proc.stdout


def ip_batch(lines: Iterable[str], ns: str | None = None, *, force: bool = False) -> None:
    """Run ``ip`` subcommands in one process (``ip [-n NS] -batch -``).

    :param lines: one subcommand each, without the leading ``ip`` (``"link set lo up"``).
    :param ns: the namespace every line runs in (``None``: the caller's namespace, for
        ``netns add``/``netns del`` lines).
    :param force: carry on past a failed line (``-force``), still raising at the end.
    :raises NetnsError: a line failed (the message names it).
    """
    text = "".join(f"{line}\n" for line in lines)
    if not text:
        return
    argv = ["ip", *(["-n", ns] if ns else []), *(["-force"] if force else []), "-batch", "-"]
    run_cmd(argv, stdin=text)


def nft_apply(ns: str, script: str) -> None:
    """Load an nftables script atomically inside namespace ``ns`` (``nft -f -``: every
    statement of the script commits together or not at all).

    :raises NetnsError: nft refused the script (the message quotes it).
    """
    run_cmd(["ip", "netns", "exec", ns, "nft", "-f", "-"], stdin=script)


def list_namespaces() -> list[str]:
    """Names of every named network namespace on the machine (``ip -j netns list``).

    :raises NetnsError: ``ip`` failed.
    """
    out = run_cmd(["ip", "-j", "netns", "list"]).strip()
    return [str(entry["name"]) for entry in json.loads(out or "[]")]


def _ns_key(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # gone, or a process that exited (a zombie has no namespaces left)
        return None
    return st.st_dev, st.st_ino


def ns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (what ``ip netns pids`` prints: it compares
    ``/proc/PID/ns/net`` with the namespace's bind mount; read here without a subprocess).

    :param ns: a namespace name.
    :returns: pids, ascending; empty when the namespace does not exist.
    """
    key = _ns_key(NETNS_DIR / ns)
    if key is None:
        return []
    me = os.getpid()
    pids = []
    for entry in os.scandir("/proc"):
        if (
            entry.name.isdigit()
            and int(entry.name) != me
            and _ns_key(f"/proc/{entry.name}/ns/net") == key
        ):
            pids.append(int(entry.name))
    return sorted(pids)


def kill_ns_processes(ns: str, *, deadline_s: float = 5.0) -> int:
    """SIGKILL every process of namespace ``ns`` until none is left (a process may fork while
    its siblings die, so the list is read again after each round).

    :param ns: a namespace name (a missing one has no processes).
    :param deadline_s: seconds to keep trying.
    :returns: how many processes were signalled.
    :raises NetnsError: some process was still there after ``deadline_s`` (one stuck in the
        kernel, state D); the message lists their pids.
    """
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while pids := ns_pids(ns):
        if time.monotonic() > end:
            raise NetnsError(f"namespace {ns}: processes {pids} survive SIGKILL for {deadline_s} s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return len(killed)


def delete_namespaces(names: Iterable[str]) -> None:
    """Delete named namespaces (``ip netns del``), skipping those already gone.

    A namespace's devices, qdiscs and nftables tables go with it; a veth pair dies with
    either end. Kill its processes first (:func:`kill_ns_processes`): a process left inside
    keeps the namespace alive, unnamed, after the name is removed.

    :raises NetnsError: one that exists could not be deleted.
    """
    present = [n for n in names if (NETNS_DIR / n).exists()]
    try:
        ip_batch((f"netns del {n}" for n in present), force=True)
    except NetnsError:
        if any((NETNS_DIR / n).exists() for n in present):  # not just one deleted meanwhile
            raise
