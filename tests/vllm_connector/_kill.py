"""What a decode engine killed mid-run must leave behind, for every engine shape's test."""

from __future__ import annotations

from pdplug_vllm.phases import KillResult


def check_decode_kill(k: KillResult | None, requests: int = 16) -> None:
    """The decode died while the prefill engine held rooms of its requests: every prefill
    worker (each PP stage and TP rank) held its writes from before the requests until the
    kill, so none of them was answered and all ended within their bound with a reason, the
    prefill kept serving, and it released every block it held for them (delay_free) and ended
    every room its ranks started."""
    assert k is not None and k.completed + k.failed == k.requests == requests, k
    # the hold reached every worker's KV sender (a prefill started without the switch once
    # let a fast machine end every room between two polls: 16 answered, none held at the kill)
    assert k.hold_ranks == k.prefill_workers >= 1, k
    assert k.completed == 0 and k.reasons, k
    assert k.ended_s < 60.0 + 10.0 and k.prefill_healthy, k
    assert k.held_at_kill > 0, k
    assert k.prefill_idle is not None and k.prefill_idle.idle, k.prefill_idle
