"""A decode rank's lookup of a prefill instance, remembering the ones that did not answer.

``pdplug.bootstrap.resolve`` blocks the calling engine worker's step (a vLLM worker, an SGLang
decode scheduler) for up to
``bootstrap_timeout_s`` when a request names a prefill instance that is dead, restarting or
unknown. :class:`Resolver` remembers such a failure for that long, so the next requests naming
it fail at once (their rooms fail; vLLM then applies ``kv_load_failure_policy``, SGLang
reports ``KVPoll.Failed``) instead of each stalling the engine again.
"""

from __future__ import annotations

import time
from typing import Any

from pdplug import bootstrap
from pdplug.config import WireConfig
from pdplug.errors import TransferError

__all__ = ["Resolver"]


class Resolver:
    """Resolve prefill instances, failing fast on one that recently did not resolve.

    :param timeout_s: how long one resolve may wait, and how long a failure is remembered
        (seconds; ``KVConfig.bootstrap_timeout_s``).
    :param wire: socket rules of the lookups (the HMAC key the prefill's rendezvous checks;
        default ``WireConfig()``, loopback without a key).
    """

    def __init__(self, timeout_s: float, wire: WireConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self.wire = wire
        #: (instance, endpoint) -> (monotonic time, reason) of a resolve that failed
        self.unreachable: dict[tuple[str, str], tuple[float, str]] = {}

    def resolve(self, instance: str, endpoint: str) -> Any:
        """The instance's peers (``pdplug.bootstrap.resolve``).

        :raises TransferError: it failed less than ``timeout_s`` ago (names when and why).
        :raises Exception: whatever ``pdplug.bootstrap.resolve`` raises (then remembered).
        """
        key = (instance, endpoint)
        seen = self.unreachable.get(key)
        now = time.monotonic()
        if seen is not None and now - seen[0] < self.timeout_s:
            raise TransferError(
                f"prefill instance {instance!r} at {endpoint} did not resolve {now - seen[0]:.1f}"
                f" s ago ({seen[1]}); not retried before bootstrap_timeout_s={self.timeout_s:g} s"
            )
        try:
            peers = bootstrap.resolve(endpoint, instance, timeout_s=self.timeout_s, wire=self.wire)
        except Exception as e:
            self.forget_after_failure(key, f"{type(e).__name__}: {e}")
            raise
        self.unreachable.pop(key, None)
        return peers

    def forget_after_failure(self, key: tuple[str, str], reason: str) -> None:
        """Remember that ``key`` failed now (also when connecting to its peers failed)."""
        if len(self.unreachable) >= 256:
            self.unreachable.clear()
        self.unreachable[key] = (time.monotonic(), reason)
