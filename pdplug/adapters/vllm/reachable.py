"""Is the prefill instance a decode request names resolvable at the rendezvous it names?
Asked by :class:`~pdplug.adapters.vllm.guard.KVParamsGuard` before vLLM sees the request, so
a decode request naming a prefill nobody runs, or a ``bootstrap`` that answers nothing, ends
within the decode's ``bootstrap_timeout_s`` with the reason in the error body, not as vLLM's
bare ``500`` (issue 22).

The lookup is pdplug's own (:func:`pdplug.bootstrap.resolve`) with the engine's settings, on a
daemon thread per lookup: the server's event loop never blocks, and a lookup still under way
at shutdown (it ends within ``timeout_s`` and closes its socket) never delays the process's
exit. Concurrent requests naming the same ``(bootstrap, instance)`` share one lookup; a
positive answer is kept :data:`CACHE_S` seconds, so a healthy decode's requests pay no
lookup each (the worker does its own; a prefill dying after the check is the worker's to
report, as before).

Answers (vLLM's error document, ``param`` the field at fault):

* **504** ``GatewayTimeoutError``, ``param`` ``kv_transfer_params.pdplug.bootstrap``: the
  rendezvous answered nothing within the timeout (a closed port, a silent host): the upstream
  the request depends on did not answer in time.
* **404** ``NotFoundError``, ``param`` ``kv_transfer_params.pdplug.prefill_instance``: the
  rendezvous answers but no rank of that instance registered there within the timeout (a
  prefill starting up registers within it, so it is waited out): like vLLM's own 404 for a
  ``model`` it does not serve, the request names something that is not there.
* **503** ``ServiceUnavailableError``, same ``param``: some but not all of the instance's
  ranks registered (a prefill engine part-way up or part-way dead): retrying later may work.
* **400** ``BadRequestError``, ``param`` ``kv_transfer_params.pdplug.bootstrap``: the endpoint
  cannot be used from this engine (off loopback while the engine has no ``hmac_key_file``, or
  one ZMQ refuses).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import msgspec
import zmq

from pdplug.adapters.placement import RankPlacement
from pdplug.adapters.vllm.extra import parse_extra
from pdplug.adapters.vllm.params import PARAMS_KEY, ParamsError
from pdplug.bootstrap import ResolveTimeout, resolve
from pdplug.config import WireConfig

__all__ = ["CACHE_S", "PrefillCheck", "PrefillUnreachable", "engine_settings"]

log = logging.getLogger(__name__)

#: how long a positive lookup is trusted (seconds)
CACHE_S = 5.0
#: most ``(bootstrap, instance)`` pairs kept (each at most 2 x 256 characters)
MAX_CACHED = 1024
#: most lookups under way at once (one thread each): beyond it a request passes to vLLM
#: unchecked (the worker's lookup answers it as before), so clients naming many dead
#: endpoints cannot make the guard hold threads, nor refuse healthy requests
MAX_LOOKUPS = 16

_BOOT = f"kv_transfer_params.{PARAMS_KEY}.bootstrap"
_INST = f"kv_transfer_params.{PARAMS_KEY}.prefill_instance"
_PASS = object()  # a lookup that failed in a way the guard does not judge: vLLM decides


class PrefillUnreachable(ParamsError):
    """The prefill instance a decode request names cannot be resolved at its rendezvous.

    :ivar status: HTTP status (504, 404, 503 or 400, see the module docstring).
    :ivar err_type: vLLM's error ``type`` for it (``"GatewayTimeoutError"``, …).
    """

    def __init__(self, field: str, message: str, *, status: int, err_type: str) -> None:
        super().__init__(field, message)
        self.status, self.err_type = status, err_type


def engine_settings(app: Any) -> tuple[float, WireConfig, str]:
    """The decode's bootstrap timeout (seconds), the wire rules of its pdplug sockets (key,
    read from ``hmac_key_file`` like the worker does) and where they came from.

    Read from vLLM's app state (``app.state.vllm_config``, set by vLLM 0.32/0.33's
    ``init_app_state``) → ``kv_transfer_config.kv_connector_extra_config``, parsed with
    :func:`pdplug.adapters.vllm.extra.parse_extra`. Without one (no app, no vLLM config, no
    KV transfer config) or with one pdplug's parse refuses (another connector's keys), the
    worker's defaults: :class:`pdplug.adapters.placement.RankPlacement`'s
    ``bootstrap_timeout_s`` and a loopback :class:`~pdplug.config.WireConfig` without a key.

    :param app: ``scope["app"]`` of the request (Starlette sets it), or None.
    """
    default = next(
        f.default for f in msgspec.structs.fields(RankPlacement) if f.name == "bootstrap_timeout_s"
    )
    vcfg = getattr(getattr(app, "state", None), "vllm_config", None)
    kv = getattr(vcfg, "kv_transfer_config", None)
    if kv is None:
        return float(default), WireConfig(), "defaults (no vLLM kv_transfer_config found)"
    try:
        extra = parse_extra(kv.kv_connector_extra_config)
        wire = extra.adapter_wire().wire
    except ValueError as e:
        log.warning("pdplug guard: kv_connector_extra_config not pdplug's (%s): defaults", e)
        return float(default), WireConfig(), "defaults (kv_connector_extra_config refused)"
    timeout = extra.bootstrap_timeout_s
    return float(default if timeout is None else timeout), wire, "kv_connector_extra_config"


class PrefillCheck:
    """Resolvability checks of ``(bootstrap, instance)`` pairs for one engine's server.

    :param timeout_s: how long one lookup waits (seconds; the decode's bootstrap timeout).
    :param wire: socket rules of the lookups (the engine's key).
    :param cache_s: how long a positive answer is kept (seconds).
    :param max_lookups: most lookups under way at once.
    """

    def __init__(
        self,
        timeout_s: float,
        wire: WireConfig | None = None,
        *,
        cache_s: float = CACHE_S,
        max_lookups: int = MAX_LOOKUPS,
    ) -> None:
        self.timeout_s, self.wire = timeout_s, wire or WireConfig()
        self.cache_s, self.max_lookups = cache_s, max_lookups
        self._ok: dict[tuple[str, str], float] = {}  # -> monotonic expiry
        self._inflight: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self.counts = {"looked_up": 0, "cached": 0, "refused": 0, "unchecked": 0}

    @classmethod
    def from_app(cls, app: Any) -> PrefillCheck:
        """A check with the engine's settings (:func:`engine_settings`)."""
        timeout, wire, source = engine_settings(app)
        log.info("pdplug guard: prefill lookups wait %g s (from %s)", timeout, source)
        return cls(timeout, wire)

    def in_flight(self) -> int:
        """Lookups under way."""
        return len(self._inflight)

    async def check(self, instance: str, bootstrap: str) -> None:
        """Return once ``instance`` is resolvable at ``bootstrap`` (or cannot be judged here).

        Waits at most ``timeout_s`` (plus 2 s of grace for the lookup's own bound);
        cancelling the caller (a client gone) leaves the shared lookup to finish alone.

        :raises PrefillUnreachable: it is not (see the module docstring for the statuses).
        """
        key = (bootstrap, instance)
        now = time.monotonic()
        if self._ok.get(key, 0.0) > now:
            self.counts["cached"] += 1
            return
        fut = self._inflight.get(key)
        if fut is None:
            if len(self._inflight) >= self.max_lookups:
                self.counts["unchecked"] += 1
                return
            fut = self._start(key)
        try:
            got = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s + 2.0)
        except asyncio.TimeoutError:
            got = self._unreachable(ResolveTimeout("", answered=False), key)
        if isinstance(got, PrefillUnreachable):
            self.counts["refused"] += 1
            raise got

    def _start(self, key: tuple[str, str]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._inflight[key] = fut
        self.counts["looked_up"] += 1

        def settle(got: Any) -> None:
            self._inflight.pop(key, None)
            if got is None:
                self._remember(key)
            if not fut.done():
                fut.set_result(got)

        def run() -> None:
            got = self._lookup(key)
            try:
                loop.call_soon_threadsafe(settle, got)
            except RuntimeError:  # the loop closed meanwhile (server shut down)
                pass

        threading.Thread(target=run, name="pdplug-guard-lookup", daemon=True).start()
        return fut

    def _remember(self, key: tuple[str, str]) -> None:
        now = time.monotonic()
        if len(self._ok) >= MAX_CACHED:
            for k in [k for k, t in self._ok.items() if t <= now]:
                del self._ok[k]
            while len(self._ok) >= MAX_CACHED:
                del self._ok[next(iter(self._ok))]  # the oldest entry
        self._ok.pop(key, None)
        self._ok[key] = now + self.cache_s

    def _lookup(self, key: tuple[str, str]) -> Any:
        """On its own thread: None (resolvable), a :class:`PrefillUnreachable`, or _PASS."""
        bootstrap, instance = key
        try:
            resolve(bootstrap, instance, timeout_s=self.timeout_s, wire=self.wire)
        except (ResolveTimeout, ValueError, zmq.ZMQError) as e:
            return self._unreachable(e, key)
        except Exception as e:  # not the guard's to judge: the worker answers as before
            log.warning("pdplug guard: lookup of %r at %s failed: %s", instance, bootstrap, e)
            return _PASS
        return None

    def _unreachable(self, e: Exception, key: tuple[str, str]) -> PrefillUnreachable:
        bootstrap, instance = key
        t = f"{self.timeout_s:g} s"
        if not isinstance(e, ResolveTimeout):
            return PrefillUnreachable(
                _BOOT, f"{_BOOT}={bootstrap!r} cannot be used by this engine: {e}",
                status=400, err_type="BadRequestError",
            )  # fmt: skip
        if not e.answered:
            return PrefillUnreachable(
                _BOOT, f"{_BOOT}={bootstrap!r}: the rendezvous answered nothing in {t} "
                f"(asked for prefill instance {instance!r})",
                status=504, err_type="GatewayTimeoutError",
            )  # fmt: skip
        if e.registered == 0:
            return PrefillUnreachable(
                _INST, f"{_INST}={instance!r} is not registered at the rendezvous {bootstrap} "
                f"(waited {t}): no prefill engine of that instance runs there",
                status=404, err_type="NotFoundError",
            )  # fmt: skip
        return PrefillUnreachable(
            _INST, f"{_INST}={instance!r}: only {e.registered} of {e.world} ranks registered "
            f"at the rendezvous {bootstrap} after {t}",
            status=503, err_type="ServiceUnavailableError",
        )  # fmt: skip
