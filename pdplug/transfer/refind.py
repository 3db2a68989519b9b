"""The decode side finding a prefill instance again after its ranks died or restarted.

A decode rank remembers where it resolved each prefill instance (its rendezvous). When a room
is expected from an instance whose sources are dead — a partition, a host that vanished, a
rolling restart whose new processes registered again — or when a failed room can only drain
once its source answers again, the :class:`Finder` looks the instance up and reconnects it on
a thread of its own (both block: ``pdplug.bootstrap.resolve`` and the handshake, each bounded
by ``bootstrap_timeout_s``), so no other room waits for it, and hands the outcome back to the
engine thread. At most one search per instance runs at a time; the rooms that wait for it are
kept by :class:`~pdplug.transfer.arrivals.RecvLeases` (``parked``) and sent or failed when it
ends. Field reports: SGLang and vLLM decodes stay disconnected from a prefill that restarted
until they are restarted themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pdplug import bootstrap
from pdplug.config import WireConfig
from pdplug.errors import TransferError

__all__ = ["Finder"]

log = logging.getLogger(__name__)


class Finder:
    """Where each prefill instance was resolved, and the searches for instances under way.

    :param name: log and thread label.
    :param connect: ``(peers, rendezvous, timeout_s)``: the session's blocking handshake
        (:meth:`pdplug.transfer.receiver.KVReceiverSession.connect`).
    :param submit: runs a closure on the session's engine thread.
    :param on_found: ``(instance, error, since)`` on the engine thread when a search ended
        (``error``: why it failed, ``None`` when the instance is connected again; ``since``:
        monotonic seconds when it started).
    :param timeout_s: bound of the lookup (``KVConfig.bootstrap_timeout_s``).
    :param retry_s: least seconds between two searches started for a drain.
    :param wire: socket rules of the lookup (key, size limit).
    :param counts: the session's counters (``refind_started``, ``refound``, ``refind_failed``).
    """

    def __init__(
        self,
        *,
        name: str,
        connect: Callable[[list[Any], str, float], None],
        submit: Callable[[Callable[[], None]], Any],
        on_found: Callable[[str, str | None, float], None],
        timeout_s: float,
        retry_s: float,
        wire: WireConfig,
        counts: Counter[str],
    ) -> None:
        self._name = name
        self._connect = connect
        self._submit = submit
        self._on_found = on_found
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._wire = wire
        self._counts = counts
        self.rendezvous: dict[str, str] = {}  # instance -> where it was resolved
        self._connected: set[str] = set()  # instances connected once (found *again*, or not)
        self._finding: dict[str, float] = {}  # engine thread: instance -> search start
        self._next: dict[str, float] = {}  # instance -> earliest next search for a drain
        self.closed = False

    def remember(self, instance: str, rendezvous: str) -> None:
        """``instance`` was connected after resolving it at ``rendezvous`` (``""``: forget)."""
        if rendezvous:
            self.rendezvous[instance] = rendezvous
            self._connected.add(instance)
        else:
            self.rendezvous.pop(instance, None)

    def busy(self, instance: str) -> bool:
        """Whether a search for ``instance`` is under way (engine thread)."""
        return instance in self._finding

    def start(self, instance: str) -> bool:
        """Look ``instance`` up again (engine thread); True when a search is under way."""
        if instance in self._finding:
            return True
        where = self.rendezvous.get(instance)
        if not where or self.closed:
            return False
        self._finding[instance] = time.monotonic()
        self._counts["refind_started"] += 1
        threading.Thread(
            target=self._run, args=(instance, where), name=f"{self._name}-find-{instance}",
            daemon=True,
        ).start()  # fmt: skip
        return True

    def for_drain(self, instances: set[str], now: float) -> None:
        """Search for each instance that strands a failed room (at most every ``retry_s``)."""
        for inst in instances:
            if now >= self._next.get(inst, 0.0):
                self._next[inst] = now + self._retry_s
                self.start(inst)

    def _run(self, instance: str, where: str) -> None:
        error: str | None = None
        try:
            self._search(instance, where)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            again = " again" if instance in self._connected else ""
            log.warning("%s: prefill %s not found%s: %s", self._name, instance, again, error)
        try:
            self._submit(lambda: self._done(instance, error))
        except TransferError:
            pass  # the session closed meanwhile

    def _search(self, instance: str, where: str) -> None:
        """Resolve and connect until one handshake is answered or ``timeout_s`` ran out. Each
        handshake waits at most ``retry_s``: right after a rank died the rendezvous still
        holds its old registration, and its restarted process registers again meanwhile."""
        t_end = time.monotonic() + self._timeout_s
        while True:
            left = t_end - time.monotonic()
            peers = bootstrap.resolve(where, instance, timeout_s=max(left, 0.1), wire=self._wire)
            try:
                self._connect(peers, where, max(0.1, min(self._retry_s, left)))
                return
            except TransferError:  # not answered: maybe a stale registration; look again
                if time.monotonic() >= t_end:
                    raise
                self._counts["refind_retried"] += 1

    def _done(self, instance: str, error: str | None) -> None:
        since = self._finding.pop(instance, 0.0)
        self._counts["refind_failed" if error else "refound"] += 1
        self._on_found(instance, error, since)
