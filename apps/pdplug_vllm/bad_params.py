"""Malformed ``kv_transfer_params`` sent straight to a prefill and a decode engine's port.

Anyone who can reach an engine can bypass the proxy (issue 22). Each case of :data:`CASES`
is one completions request with a ``kv_transfer_params`` a client can get wrong (wrong types,
missing or unknown fields, absurd sizes, contradictory flags); with
:class:`pdplug.adapters.vllm.guard.KVParamsGuard` in front of the engine each must end fast
with HTTP 400 naming the field. :data:`UNKNOWN_REMOTE` cases are well formed but name a
prefill nobody runs: the guard looks the instance up at the rendezvous the request names
and, once the decode's ``bootstrap_timeout_s`` passed without it, answers 504 (the
rendezvous answered nothing) or 404 (it does not know the instance), naming the field, the
instance, the endpoint and the seconds (:data:`UNKNOWN_REMOTE_WANT`). Afterwards both
engines must still serve.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from pdplug.adapters.room_ids import MAX_ALLOCATOR_ID, ROOM_BITS
from pdplug.ports import free_ports

__all__ = [
    "CASES",
    "BadParamsResult",
    "Probe",
    "UNKNOWN_REMOTE",
    "UNKNOWN_REMOTE_WANT",
    "probe_bad_params",
]

#: rooms of the probes: the last allocator id's, never a proxy's (ids from 0 up)
_ROOM = MAX_ALLOCATOR_ID << ROOM_BITS
_DEC = {"room": _ROOM + 11, "prefill_instance": "prefill-0", "bootstrap": "tcp://127.0.0.1:1"}

#: (name, side, kv_transfer_params, field the 400 must name)
CASES: tuple[tuple[str, str, Any, str], ...] = (
    ("params not an object", "decode", [1, 2], "kv_transfer_params"),
    ("room -1", "decode", {"do_remote_prefill": True, "pdplug": {**_DEC, "room": -1}},
     "kv_transfer_params.pdplug.room"),
    ("room a string", "decode", {"do_remote_prefill": True, "pdplug": {**_DEC, "room": "11"}},
     "kv_transfer_params.pdplug.room"),
    ("room 2**80", "decode", {"do_remote_prefill": True, "pdplug": {**_DEC, "room": 1 << 80}},
     "kv_transfer_params.pdplug.room"),
    ("pdplug a list", "decode", {"do_remote_prefill": True, "pdplug": [11]},
     "kv_transfer_params.pdplug"),
    ("no pdplug document", "decode", {"do_remote_prefill": True}, "kv_transfer_params.pdplug"),
    ("missing bootstrap", "decode",
     {"do_remote_prefill": True, "pdplug": {"room": 11, "prefill_instance": "prefill-0"}},
     "kv_transfer_params.pdplug"),
    ("bootstrap port 99999", "decode",
     {"do_remote_prefill": True, "pdplug": {**_DEC, "bootstrap": "tcp://127.0.0.1:99999"}},
     "kv_transfer_params.pdplug.bootstrap"),
    ("instance of 100k chars", "decode",
     {"do_remote_prefill": True, "pdplug": {**_DEC, "prefill_instance": "p" * 100_000}},
     "kv_transfer_params.pdplug.prefill_instance"),
    ("flag a string", "decode", {"do_remote_prefill": "yes", "pdplug": _DEC},
     "kv_transfer_params.do_remote_prefill"),
    ("both flags", "decode", {"do_remote_prefill": True, "do_remote_decode": True, "pdplug": _DEC},
     "kv_transfer_params"),
    ("pdplug without a flag", "decode", {"pdplug": _DEC}, "kv_transfer_params.pdplug"),
    ("prefill room -5", "prefill", {"do_remote_decode": True, "pdplug": {"room": -5}},
     "kv_transfer_params.pdplug.room"),
    ("prefill unknown field", "prefill",
     {"do_remote_decode": True, "pdplug": {"room": 5, "rank": 3}}, "kv_transfer_params.pdplug"),
)  # fmt: skip

#: well formed, naming a prefill instance that is not there: at a port nobody listens on, and
#: at the real prefill's rendezvous (a known instance with a room its prefill never serves
#: instead waits ``KVConfig.waiting_timeout_s``, 120 s by default)
UNKNOWN_REMOTE = ("unknown instance, dead bootstrap", "unknown instance, live bootstrap")

#: what each :data:`UNKNOWN_REMOTE` case must get: (HTTP status, ``param``, the instance the
#: message names) (:mod:`pdplug.adapters.vllm.reachable`)
UNKNOWN_REMOTE_WANT: dict[str, tuple[int, str, str]] = {
    UNKNOWN_REMOTE[0]: (504, "kv_transfer_params.pdplug.bootstrap", "nobody-dead"),
    UNKNOWN_REMOTE[1]: (404, "kv_transfer_params.pdplug.prefill_instance", "nobody"),
}


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """One request's answer.

    :ivar name/side: the case and the engine it went to.
    :ivar status: HTTP status; ``seconds``: until the answer.
    :ivar param/message: the error document's ``param`` and ``message`` (truncated to 300).
    :ivar want_field: the field the case must name ("" for :data:`UNKNOWN_REMOTE`, whose
        wants are :data:`UNKNOWN_REMOTE_WANT`).
    """

    name: str
    side: str
    status: int
    seconds: float
    param: str
    message: str
    want_field: str = ""

    @property
    def ok(self) -> bool:
        """A 400 naming the wanted field (a malformed case)."""
        return self.status == 400 and self.param == self.want_field


class BadParamsResult(msgspec.Struct, frozen=True, kw_only=True):
    """:ivar probes: one per case; ``serving_after``: both engines answered a plain request
    afterwards (tokens, HTTP 200)."""

    probes: list[Probe]
    serving_after: bool


def _post(client: Any, url: str, params: Any, timeout_s: float) -> tuple[int, float, str, str]:
    import httpx

    body = {"model": "tiny", "prompt": [5, 6, 7, 8] * 8, "max_tokens": 2, "temperature": 0.0,
            "kv_transfer_params": params}  # fmt: skip
    t0 = time.monotonic()
    try:
        r = client.post(url + "/v1/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as e:
        return 0, time.monotonic() - t0, "", f"{type(e).__name__}: {e}"[:300]
    dt = time.monotonic() - t0
    try:
        err = r.json().get("error") or {}
    except ValueError:
        err = {"message": r.text}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    return r.status_code, dt, str(err.get("param") or ""), str(err.get("message") or "")[:300]


def probe_bad_params(
    prefill_url: str,
    decode_url: str,
    *,
    prefill_instance: str,
    bootstrap: str,
    timeout_s: float = 60.0,
    cases: Sequence[tuple[str, str, Any, str]] = CASES,
) -> BadParamsResult:
    """Send every case to its engine, then the :data:`UNKNOWN_REMOTE` ones to the decode, then
    one plain request to each engine.

    :param prefill_instance/bootstrap: the real prefill's (``bootstrap``: the second
        unknown-remote case asks it for another instance).
    :param timeout_s: bound of one request (seconds), above the decode's bootstrap timeout.
    """
    import httpx

    probes: list[Probe] = []
    urls = {"prefill": prefill_url, "decode": decode_url}
    (dead,) = free_ports(1)
    unknown = {
        UNKNOWN_REMOTE[0]: {**_DEC, "room": _ROOM + 12, "prefill_instance": "nobody-dead",
                            "bootstrap": f"tcp://127.0.0.1:{dead}"},
        UNKNOWN_REMOTE[1]: {**_DEC, "room": _ROOM + 13, "prefill_instance": "nobody",
                            "bootstrap": bootstrap},
    }  # fmt: skip
    with httpx.Client() as client:
        for name, side, params, field in cases:
            st, dt, param, msg = _post(client, urls[side], params, timeout_s)
            probes.append(Probe(name=name, side=side, status=st, seconds=dt, param=param,
                                message=msg, want_field=field))  # fmt: skip
        # at once: each waits out the decode's bootstrap timeout
        with ThreadPoolExecutor(len(unknown)) as pool:
            futs = {
                name: pool.submit(_post, client, decode_url, {"do_remote_prefill": True,
                                  "do_remote_decode": False, "pdplug": doc}, timeout_s)
                for name, doc in unknown.items()
            }  # fmt: skip
            for name, fut in futs.items():
                st, dt, param, msg = fut.result()
                probes.append(Probe(name=name, side="decode", status=st, seconds=dt,
                                    param=param, message=msg))  # fmt: skip
        serving = all(_post(client, u, None, timeout_s)[0] == 200 for u in urls.values())
    return BadParamsResult(probes=probes, serving_after=serving)
