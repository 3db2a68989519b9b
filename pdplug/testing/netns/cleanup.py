"""Run ids, leftovers and the clean-up guarantees of the namespace harness.

Every namespace a cluster makes is named ``{prefix}-{pid}-{start}-{seq}`` (the switch) or
``{prefix}-{pid}-{start}-{seq}-{host}`` (a host): the creating process's pid, its start time
(clock ticks since boot, ``/proc/PID/stat`` field 22: a pid reused by a later process does
not pass for the creator) and a per-process sequence number. Concurrent runs never collide,
and :func:`sweep` can tell a leftover of a dead run from a live run's namespaces.

While any cluster is open in a process, :func:`track` keeps it in a registry that is closed
on interpreter exit (``atexit``) and on SIGINT/SIGTERM (the handlers that were installed
before are restored, then the signal is passed on to them, or re-raised with its default
action). SIGKILL runs nothing: the next cluster made with the same prefix (or an explicit
:func:`sweep`) removes what the killed run left.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from pdplug.testing.netns.cmd import delete_namespaces, kill_ns_processes, list_namespaces

__all__ = [
    "PREFIX_RE",
    "RunId",
    "check_prefix",
    "process_start",
    "new_run_id",
    "sweep",
    "track",
    "untrack",
    "close_all",
    "interrupted",
]

#: a prefix is lower-case letters and digits, starting with a letter (it must not contain
#: "-", which separates the fields of a run id)
PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,15}")
_NAME_RE = re.compile(r"(?P<prefix>[a-z][a-z0-9]*)-(?P<pid>\d+)-(?P<start>\d+)-(?P<seq>\d+)(-.+)?")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_interrupted: int | None = None


def check_prefix(prefix: str) -> str:
    """``prefix`` if it matches :data:`PREFIX_RE` (1-16 characters).

    :raises ValueError: it does not (the message names it).
    """
    if not isinstance(prefix, str) or not PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"prefix={prefix!r}: expected 1-16 lower-case letters or digits, starting with a letter"
        )
    return prefix


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot, or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class RunId:
    """Identity of one cluster: its prefix, the creating process (pid and start time) and the
    sequence number of the cluster within that process. ``str(run_id)`` is the switch
    namespace's name; a host's namespace appends ``-{host}``."""

    prefix: str
    pid: int
    start: int
    seq: int

    def __str__(self) -> str:
        return f"{self.prefix}-{self.pid}-{self.start}-{self.seq}"

    def host_ns(self, host: str) -> str:
        """The namespace name of host ``host`` in this run."""
        return f"{self}-{host}"

    def owns(self, ns: str) -> bool:
        """Whether namespace ``ns`` belongs to this run (its switch or one of its hosts)."""
        return ns == str(self) or ns.startswith(f"{self}-")

    def creator_alive(self) -> bool:
        """Whether the process that made this run is still running (same pid, same start)."""
        return process_start(self.pid) == self.start

    @classmethod
    def parse(cls, ns: str) -> RunId | None:
        """The run a namespace name belongs to, or ``None`` for a name the harness never makes."""
        m = _NAME_RE.fullmatch(ns)
        if m is None:
            return None
        return cls(m["prefix"], int(m["pid"]), int(m["start"]), int(m["seq"]))


_seq = 0
_seq_lock = threading.Lock()


def new_run_id(prefix: str) -> RunId:
    """A run id no other cluster, in this process or another, has or will have.

    :raises ValueError: a bad ``prefix`` (see :func:`check_prefix`).
    """
    global _seq
    check_prefix(prefix)
    with _seq_lock:
        seq, _seq = _seq, _seq + 1
    pid = os.getpid()
    start = process_start(pid)
    assert start is not None, "/proc/self/stat is readable"
    return RunId(prefix, pid, start, seq)


def sweep(prefix: str = "pdp") -> list[str]:
    """Remove what earlier runs with ``prefix`` left behind: every namespace of a run whose
    creating process is dead (its processes are killed first). Live runs are not touched.

    Called by every :class:`~pdplug.testing.netns.Cluster` as it starts (``sweep=True``), so a
    CI run killed by SIGKILL never breaks the next one.

    :param prefix: the prefix the runs were made with.
    :returns: the namespaces removed.
    :raises ValueError: a bad ``prefix``.
    :raises NetnsError: a leftover could not be removed.
    """
    check_prefix(prefix)
    stale = []
    for ns in list_namespaces():
        rid = RunId.parse(ns)
        if rid is not None and rid.prefix == prefix and not rid.creator_alive():
            stale.append(ns)
    # hosts first (longer names), then the switch
    stale.sort(key=len, reverse=True)
    for ns in stale:
        kill_ns_processes(ns)
    delete_namespaces(stale)
    return stale


# --------------------------------------------------------------------------- the registry

_lock = threading.RLock()
_live: dict[int, Callable[[], None]] = {}
_saved: dict[int, Any] = {}
_atexit_registered = False
_owner = os.getpid()


def track(key: int, close: Callable[[], None]) -> None:
    """Register an open cluster: ``close()`` runs on interpreter exit and on SIGINT/SIGTERM.

    The signal handlers are installed with the first open cluster and only from the main
    thread (Python allows no other); from another thread only ``atexit`` covers it. A signal
    the process ignores (SIG_IGN, as a job started in the background ignores SIGINT) is left
    ignored: it removes nothing and ends nothing.

    :param key: an id unique while registered (``id(cluster)``).
    :param close: an idempotent function removing everything the cluster made.
    """
    global _atexit_registered, _owner
    with _lock:
        if not _live:
            _owner = os.getpid()
        _live[key] = close
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        if not _saved and threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                old = signal.getsignal(sig)
                if old == signal.SIG_IGN:
                    continue  # a process that ignores it (started in the background) goes on
                _saved[sig] = old
                signal.signal(sig, _on_signal)


def untrack(key: int) -> None:
    """Forget a closed cluster; with the last one gone, restore the previous signal handlers."""
    with _lock:
        _live.pop(key, None)
        if not _live:
            _restore_handlers()


def close_all() -> None:
    """Close every registered cluster of this process (a forked child that inherited the
    registry closes nothing: the clusters are its parent's)."""
    with _lock:
        if os.getpid() != _owner:
            return
        closers = list(_live.values())
    for close in reversed(closers):
        try:
            close()
        except Exception as e:  # best effort: one failure must not leave the others behind
            print(f"pdplug.testing.netns: clean-up failed: {e}", file=sys.stderr)


def _restore_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, old in list(_saved.items()):
        if signal.getsignal(sig) is _on_signal:  # leave a handler someone installed since alone
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
    _saved.clear()


def _at_exit() -> None:
    close_all()


def interrupted() -> int | None:
    """The SIGINT or SIGTERM that closed this process's clusters, or None: a caller that
    catches the errors of processes the clean-up killed (a worker that "exited unexpectedly")
    can tell an interrupt from a fault and stop instead of going on."""
    return _interrupted


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _interrupted
    _interrupted = signum
    prev = _saved.get(signum, signal.SIG_DFL)
    close_all()
    with _lock:
        _restore_handlers()
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:  # SIG_DFL (or None: set outside Python): the default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
