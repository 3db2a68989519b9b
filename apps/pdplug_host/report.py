"""The report of one demo run: parity with the reference, TTFT and its parts, bytes moved.

TTFT of a request = arrival at the driver -> its transfer decision applied on decode DCP rank 0
(the first token is then ready to stream). Its parts (milliseconds) are each reported as their
own p50 / p99 (they do not add up to the TTFT p50):

* ``queue``: arrival -> every prefill rank locally ready (decode ranks found pages, agreed on
  preallocation and sent their destinations; the driver routes a request to the prefill ranks
  only then and when the prefill has a free slot), plus bootstrap decision -> first chunk
  scheduled on PP0 (waiting for prefill pages included);
* ``consensus``: last prefill rank ready -> bootstrap decision applied on PP0, plus last decode
  rank's KV complete -> transfer decision applied on decode rank 0;
* ``prefill``: forward compute of the request's chunks, summed over PP ranks;
* ``send``: the host's time inside the KV sender's ``send`` calls (the hand-off to the sender's
  engine thread), max over PP ranks. Planning, packing and posting run on the sender's threads:
  for segments sent while prefill goes on they overlap it and appear in no part; for the final
  segment they are inside ``transfer``;
* ``transfer``: last prefill rank's final ``send`` -> KV complete on the last decode rank.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pdplug_host.messages import Timing
from pdplug_host.options import DemoOptions
from pdplug_host.trace import TraceRequest

__all__ = ["RunRecord", "build_report"]


class RunRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the driver collected from the workers during one run.

    :ivar finished: generated tokens per request id; ``failed``: the failure reason per id.
    :ivar timings: every rank's timestamps per request id; ``sent_at``: arrival (epoch s).
    :ivar stats: counters per ``(role, rank)`` at shutdown; ``served_by``: the plugin that
        served each extension point; ``log_dir``: where the worker logs are, if anywhere.
    """

    finished: dict[int, list[int]]
    failed: dict[int, str]
    timings: dict[int, list[Timing]]
    sent_at: dict[int, float]
    stats: dict[tuple[str, int], dict[str, Any]]
    served_by: dict[str, dict[str, str]]
    log_dir: str | None


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def build_report(
    opts: DemoOptions,
    requests: list[TraceRequest],
    run: RunRecord,
    reference: dict[int, list[int]] | None,
    serve_s: float,
    wall_s: float,
) -> dict[str, Any]:
    """The report of one run (the dict ``pdplug demo --json`` writes).

    :param reference: the reference run's tokens per request (None: parity not checked).
    :param serve_s, wall_s: replay time and whole-run time, seconds.
    :returns: parity (``parity_ok``, ``mismatches``: first differing position or the error
        per request), TTFT p50/p99 and its parts in milliseconds, bytes/tokens/segments moved,
        chunking, throughput, the plugins that served each point, the options and every
        worker's counters.
    """
    mismatches: list[dict[str, Any]] = []
    ok = 0
    for r in requests:
        got = run.finished.get(r.rid)
        if got is None:
            mismatches.append({"rid": r.rid, "error": run.failed.get(r.rid, "not finished")})
            continue
        if reference is None:
            continue
        want = reference[r.rid]
        if got == want:
            ok += 1
            continue
        pos = next(
            (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
        )
        mismatches.append(
            {
                "rid": r.rid,
                "position": pos,
                "got": got[pos] if pos < len(got) else None,
                "want": want[pos] if pos < len(want) else None,
            }
        )
    ttft: list[float] = []
    parts: dict[str, list[float]] = {
        k: [] for k in ("queue", "consensus", "prefill", "send", "transfer")
    }
    for r in requests:
        ts = run.timings.get(r.rid, [])
        pre = [t.fields for t in ts if t.role == "prefill"]
        dec = [t.fields for t in ts if t.role == "decode"]
        arrival = run.sent_at.get(r.rid)
        d0 = next((t.fields for t in ts if t.role == "decode" and t.rank == 0), None)
        if not pre or not dec or arrival is None or d0 is None or "t_decided" not in d0:
            continue
        ttft.append((d0["t_decided"] - arrival) * 1e3)
        ready = max(f.get("t_ready", arrival) for f in pre)
        p0 = next(t.fields for t in ts if t.role == "prefill" and t.rank == 0)
        admit = p0.get("t_admit", ready)
        first_chunk = p0.get("t_first_chunk", admit)
        success = max(f.get("t_success", d0["t_decided"]) for f in dec)
        last_send = max(f.get("t_last_send", admit) for f in pre)
        parts["queue"].append(((ready - arrival) + max(0.0, first_chunk - admit)) * 1e3)
        parts["consensus"].append(
            (max(0.0, admit - ready) + max(0.0, d0["t_decided"] - success)) * 1e3
        )
        parts["prefill"].append(sum(f.get("compute_s", 0.0) for f in pre) * 1e3)
        parts["send"].append(max(f.get("send_s", 0.0) for f in pre) * 1e3)
        parts["transfer"].append(max(0.0, success - last_send) * 1e3)
    prefill_stats = [s for (role, _), s in run.stats.items() if role == "prefill"]
    bytes_tx = sum(int(s.get("sender_bytes", 0)) for s in prefill_stats)
    # every PP rank ships the same tokens (its own layers): count them once
    tokens_tx = max((int(s.get("tokens_sent", 0)) for s in prefill_stats), default=0)
    segments = max((int(s.get("segments", 0)) for s in prefill_stats), default=0)
    split_sends = max((int(s.get("split_sends", 0)) for s in prefill_stats), default=0)
    p0 = run.stats.get(("prefill", 0), {})
    hit_tokens = max((int(s.get("hit_tokens", 0)) for s in prefill_stats), default=0)
    served = run.served_by
    out_tokens = sum(len(v) for v in run.finished.values())
    return {
        "requests": len(requests),
        "finished": len(run.finished),
        "failed": len(run.failed),
        "parity_ok": ok,
        "mismatches": mismatches,
        "plugins": served,
        "ttft_ms": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "breakdown_ms": {k: {"p50": _pct(v, 50), "p99": _pct(v, 99)} for k, v in parts.items()},
        "prefix_hit_tokens": hit_tokens,
        "tokens_transferred": tokens_tx,
        "bytes_transferred": bytes_tx,
        "segments": segments,
        "split_sends": split_sends,
        "chunks": {k: int(p0.get(f"chunk{k}", 0)) for k in ("s", "_min", "_max")},
        "serve_s": serve_s,
        "wall_s": wall_s,
        "throughput": {
            "requests_per_s": len(run.finished) / serve_s if serve_s > 0 else 0.0,
            "output_tokens_per_s": out_tokens / serve_s if serve_s > 0 else 0.0,
        },
        "config": msgspec.to_builtins(opts),
        "worker_logs": run.log_dir,
        "worker_stats": {f"{k[0]}{k[1]}": v for k, v in run.stats.items()},
    }
