"""``pdplug bench transfer``'s small-send table: the fixed cost of one send, and of a step's K.

**Fixed cost per send** (K = 1): from the host's ``sender.send(room, segment, pages)`` until the
host's ordinary ``sender.poll(room)``, called in a loop, first answers ``Success``, minus the raw
engine's post-to-completion time on the same prepared descriptors and size (NIXL: one
transfer handle made once and re-posted, polled with ``check_xfer_state``; Mooncake:
``batch_transfer_sync_write`` in the caller's thread), paired (ABBA order) and reported as the
median of the paired differences in microseconds. The room's bootstrap (the decode's DestInfo,
``WaitingForInput``) happens before the clock starts, as in a real step, and before *both*
runs of the pair: the host thread sleeps while it waits for the decode, and the first work
after a sleep runs slower than the same work hot (caches, a descheduled virtual CPU), so the
run that comes first after the bootstrap pays for it; the order alternates, so both do equally
(before 2026-12-03 only pdplug's run followed the bootstrap, and paid for it every time). Each
run ends once its bytes have landed at the decode, untimed: pdplug's with the decode's verdict
on the room, the raw one when the decode took the raw write's notification (NIXL; a Mooncake
call returns only then). Before 2026-12-04 a raw run did not wait for that, and a pdplug run
right after it paid for the decode still taking in the raw write's bytes (a NIXL "DONE" on UCX
over TCP is the sender's; README, "Fixed cost per send", has the measurement).

**K sends per step**: a step posts K rooms of the same size at once (``send_many`` when the
sender has it, else K ``send`` calls) and polls them all to ``Success``; the raw baseline posts
K prepared transfers back to back and waits for all (NIXL: K handles, then ``check_xfer_state``
on each; Mooncake: K ``batch_transfer_async_write`` and ``get_batch_transfer_status``). The row
gives ``(t_pdplug - t_raw) / K``: what one send costs when a step posts K.

Bytes: the first and last round of each size are checked (destination poisoned first, digest of
the rows that landed against the source's) for pdplug and raw; a mismatch fails the run.

**vs fresh** (NIXL, K = 1): pdplug's time minus the raw engine's with a request made for each
send on descriptor lists prepared once (``make_prepped_xfer`` + ``transfer``, polled, released
after the timing; run between the two others of each round): the part of the fixed cost that is
pdplug's own, beside the engine's per-request cost that a re-posted handle skips.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

__all__ = ["fixed_cost"]

MIB = 1 << 20


def _spin(sender: Any, rooms: list[int], backend: str) -> None:
    """Poll every room until it is terminal (no sleep: the host's own loop), then check."""
    from pdplug import KVPoll

    todo = list(rooms)
    t_end = time.monotonic() + 60.0
    while todo:
        todo = [r for r in todo if sender.poll(r) not in (KVPoll.Success, KVPoll.Failed)]
        if time.monotonic() > t_end:
            raise click.ClickException(f"{backend}: rooms {todo} not done after 60 s")
    for r in rooms:
        if sender.poll(r) != KVPoll.Success:
            raise click.ClickException(f"{backend}: {sender.failure_reason(r)}")


def _post_step(sender: Any, items: list[tuple[int, Any, Any]]) -> None:
    from pdplug.protocols import send_step

    if len(items) == 1:
        sender.send(*items[0])  # one send alone: the host's plain call
    else:
        send_step(sender, items)


def fixed_cost(
    rig: Any, sizes: list[int], steps: list[int], repeats: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows ``{backend, bytes, k, pairs, pdplug_us, raw_us, fixed_us, q1_us, q3_us,
    fixed_vs_fresh_us}`` (per send; the last ``None`` but for NIXL at K = 1)
    for every size at K = 1 and, at the smallest size, for every K in ``steps``; and the
    byte-check failures.

    :param rig: a :class:`pdplug_bench.transfer.Rig` (entered).
    :param sizes: send sizes in bytes; ``steps``: the K values of the per-step rows.
    :param repeats: timed pairs per row (each row runs at least 20).
    """
    from pdplug_bench.bytecheck import POISON

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    shapes = [(size, 1) for size in sizes] + [(min(sizes), k) for k in steps if k > 1]
    for size, k in shapes:
        cases = rig.cases(size, k)
        tag = f"{rig.backend} {size / MIB:g} MiB x {k}"

        def bootstrap(checked: bool, cases: list[Any] = cases) -> list[int]:
            rooms = [rig.room() for _ in cases]
            for room, c in zip(rooms, cases):
                rig.expect([room], c, POISON if checked else None)
            return rooms

        def run_pdplug(
            checked: bool, rep: int, rooms: list[int], cases: list[Any] = cases, tag: str = tag
        ) -> float:
            items = [(room, c["seg"], c["sp"]) for room, c in zip(rooms, cases)]
            t0 = time.perf_counter()
            _post_step(rig.sender, items)
            _spin(rig.sender, rooms, rig.backend)
            dt = time.perf_counter() - t0

            def bytes_ok() -> None:
                if checked:
                    for i, c in enumerate(cases):
                        rig.check(c, f"{tag} pdplug round {rep} send {i}", failures)

            rig.finish(rooms, bytes_ok)
            return dt

        def run_raw(checked: bool, rep: int, cases: list[Any] = cases, tag: str = tag,
                    mode: str = "raw") -> float:  # fmt: skip
            if checked:
                for c in cases:
                    rig.peer.fill("bench-decode", [c["dp"].tolist()], POISON)
            if mode != "raw":
                dt = float(cases[0]["raw"].fresh())
            elif len(cases) == 1:
                dt = float(cases[0]["raw"]())
            else:
                t0 = time.perf_counter()
                waits = [c["raw"].post() for c in cases]
                while not all(w() for w in waits):
                    pass
                dt = time.perf_counter() - t0
            rig.raw_landed()  # untimed, as pdplug's run ends with the decode's verdict
            if checked:
                for i, c in enumerate(cases):
                    rig.check(c, f"{tag} {mode} round {rep} send {i}", failures)
            return dt

        # NIXL, one send: also the raw engine making a request per send (between the others)
        fresh = k == 1 and hasattr(cases[0]["raw"], "fresh")

        reps = max(20, repeats)
        pd: list[float] = []
        raw: list[float] = []
        diff: list[float] = []
        diff_fresh: list[float] = []
        for rep in range(reps + 2):
            checked = rep in (0, reps + 1)  # warm-up and last round: checked, untimed
            # both runs of a pair follow the same bootstrap round trip with the decode (its
            # rooms' DestInfos, WaitingForInput): the first of the two starts cold after it,
            # the second warm after the first, and the order alternates
            rooms = bootstrap(checked)
            t_f = 0.0
            if rep % 2:
                t_p = run_pdplug(checked, rep, rooms)
                if fresh:
                    t_f = run_raw(checked, rep, mode="raw fresh-request")
                t_r = run_raw(checked, rep)
            else:
                t_r = run_raw(checked, rep)
                if fresh:
                    t_f = run_raw(checked, rep, mode="raw fresh-request")
                if checked:  # the raw writes' bytes must not pass for pdplug's
                    for c in cases:
                        rig.peer.fill("bench-decode", [c["dp"].tolist()], POISON)
                t_p = run_pdplug(checked, rep, rooms)
            if not checked:
                pd.append(t_p)
                raw.append(t_r)
                diff.append((t_p - t_r) / k)
                if fresh:
                    diff_fresh.append(t_p - t_f)
        q = statistics.quantiles(diff, n=4, method="inclusive")
        rows.append(
            {
                "backend": rig.backend,
                "bytes": size,
                "k": k,
                "pairs": reps,
                "pdplug_us": statistics.median(pd) / k * 1e6,
                "raw_us": statistics.median(raw) / k * 1e6,
                "fixed_us": statistics.median(diff) * 1e6,
                "q1_us": q[0] * 1e6,
                "q3_us": q[2] * 1e6,
                "fixed_vs_fresh_us": statistics.median(diff_fresh) * 1e6 if fresh else None,
            }
        )
    return rows, failures
