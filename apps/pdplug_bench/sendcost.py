"""``pdplug bench transfer``'s small-send table: the fixed cost of one send, and of a step's K.

**Fixed cost per send** (K = 1): from the host's ``sender.send(room, segment, pages)`` until the
host's ordinary ``sender.poll(room)``, called in a loop, first answers ``Success``, minus the
raw engine's post-to-completion time on the same prepared descriptors and size (NIXL: one
transfer handle made once and re-posted, polled with ``check_xfer_state``; Mooncake:
``batch_transfer_sync_write`` in the caller's thread), paired (every mode once per round) and
reported as the median of the paired differences in microseconds. The rooms' bootstrap (the
decode's DestInfo, ``WaitingForInput``) happens before the clock starts, as in a real step, once
per round before its first run: the host thread sleeps while it waits for the decode, and the
first work after a sleep runs slower than the same work hot (caches, a descheduled virtual CPU),
so the run that opens the round pays for it, and each later run inherits what the run before it
left (caches a copy evicted, a decode still busy). Over the timed rounds (a whole number of the
order's cycles) every mode opens a round, and runs right after each other mode, equally often (a
Williams design, :mod:`pdplug_bench.orders`; before 2026-12-03 only pdplug's run followed the
bootstrap, and paid for it every time; until 2026-12-07 one order rotated by a mode each round,
under which pdplug ran right after the python floor in every round it did not open). Each run
ends once its bytes have landed at the decode, untimed: pdplug's with the decode's verdict on
the room, the raw one when the decode took the raw write's notification (NIXL; a Mooncake call
returns only then). Before 2026-12-04 a raw run did not wait for that, and a pdplug run right
after it paid for the decode still taking in the raw write's bytes (a NIXL "DONE" on UCX over
TCP is the sender's; README, "Fixed cost per send", has the measurement). Before 2026-12-07 the
window also held the bench's own check: one more ``poll`` per room after the one that saw
``Success``, and an import; and, at K = 1, until later that day, a helper's frame with an import
of its own around the ``send`` and a list comprehension around each ``poll`` (now the two calls
alone, bound before the clock starts, as the raw side times only its engine calls).

**K sends per step**: a step posts K rooms of the same size at once (``send_many`` when the
sender has it, else K ``send`` calls) and polls them all to ``Success``; the raw baseline posts
K prepared transfers back to back and waits for all (NIXL: K handles, then ``check_xfer_state``
on each; Mooncake: K ``batch_transfer_async_write`` and ``get_batch_transfer_status``). The row
gives ``(t_pdplug - t_raw) / K``: what one send costs when a step posts K.

Bytes: the first and last round of each size are checked (destination poisoned first, digest of
the rows that landed against the source's) for every mode; a mismatch fails the run.

**vs fresh** (NIXL, K = 1): pdplug's time minus the raw engine's with a request made for each
send on descriptor lists prepared once (``make_prepped_xfer`` + ``transfer``, polled, released
after the timing): the part of the fixed cost that is pdplug's own, beside the engine's
per-request cost that a re-posted handle skips.

**Python floor** (NIXL, K = 1): the least any Python send does on the same prepared lists, with
nothing of a session: its page ids copied and bounds-checked, the request's indices computed,
``make_prepped_xfer`` + ``transfer`` polled, the status published under a lock with waiters
notified; ``floor us`` is its paired difference to raw, in the same rounds. ``fixed us`` minus
``floor us`` is what pdplug's session adds (room and lease state, checks, tags, bookkeeping);
where the floor itself is above the 100 us goal in a run, the verdict line says so (one run's
median: read it over several).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

__all__ = ["fixed_cost"]

MIB = 1 << 20


def _spin(sender: Any, rooms: list[int], backend: str, ends: tuple[Any, ...], t_end: float) -> None:
    """Poll every room until it is terminal, ``ends`` (no sleep: the host's own loop), failing
    after ``t_end`` (monotonic seconds, taken before the clock started). The timed window ends
    here, at the poll that first sees it: :func:`_succeeded` checks after."""
    todo = rooms
    while todo:
        todo = [r for r in todo if sender.poll(r) not in ends]
        if todo and time.monotonic() > t_end:
            raise click.ClickException(f"{backend}: rooms {todo} not done after 60 s")


def _succeeded(sender: Any, rooms: list[int], backend: str) -> None:
    from pdplug import KVPoll

    for r in rooms:
        if sender.poll(r) != KVPoll.Success:
            raise click.ClickException(f"{backend}: {sender.failure_reason(r)}")


#: the NIXL raw engine's other modes, by the name a byte-check failure gives them
_EXTRA = {"raw fresh-request": "fresh", "python floor": "floor"}


def _median_us(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e6 if xs else None


def _one_send(
    sender: Any, item: tuple[int, Any, Any], backend: str, ends: tuple[Any, ...]
) -> float:
    """Seconds from one plain ``send()`` until the first ``poll()`` that sees the room end,
    timed as tightly as the raw engine's post-to-completion: the calls bound and the deadline
    taken before the clock starts, no frame of the harness inside the window (a call through
    a helper with its own import and a list comprehension per poll was counted as pdplug's
    before 2026-12-07)."""
    send, poll = sender.send, sender.poll
    room = item[0]
    t_end = time.monotonic() + 60.0
    t0 = time.perf_counter()
    send(*item)
    while poll(room) not in ends:
        if time.monotonic() > t_end:
            raise click.ClickException(f"{backend}: room {room} not done after 60 s")
    return time.perf_counter() - t0


def fixed_cost(
    rig: Any, sizes: list[int], steps: list[int], repeats: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows ``{backend, bytes, k, pairs, pdplug_us, raw_us, fixed_us, q1_us, q3_us,
    fixed_vs_fresh_us, floor_us}`` (per send; the last two ``None`` but for NIXL at K = 1)
    for every size at K = 1 and, at the smallest size, for every K in ``steps``; and the
    byte-check failures.

    :param rig: a :class:`pdplug_bench.transfer.Rig` (entered).
    :param sizes: send sizes in bytes; ``steps``: the K values of the per-step rows.
    :param repeats: timed pairs per row (each row runs at least 20).
    """
    from pdplug import KVPoll
    from pdplug.protocols import send_step
    from pdplug_bench.bytecheck import POISON
    from pdplug_bench.orders import mode_order, timed_rounds

    ends = (KVPoll.Success, KVPoll.Failed)

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
            if len(items) == 1:
                dt = _one_send(rig.sender, items[0], rig.backend, ends)
            else:
                t_end = time.monotonic() + 60.0
                t0 = time.perf_counter()
                send_step(rig.sender, items)
                _spin(rig.sender, rooms, rig.backend, ends, t_end)
                dt = time.perf_counter() - t0
            _succeeded(rig.sender, rooms, rig.backend)

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
                dt = float(getattr(cases[0]["raw"], _EXTRA[mode])())
            elif len(cases) == 1:
                dt = float(cases[0]["raw"]())
            else:
                t_end = time.monotonic() + 60.0
                t0 = time.perf_counter()
                waits = [c["raw"].post(t_end) for c in cases]
                while not all(w() for w in waits):
                    pass
                dt = time.perf_counter() - t0
            rig.raw_landed()  # untimed, as pdplug's run ends with the decode's verdict
            if checked:
                for i, c in enumerate(cases):
                    rig.check(c, f"{tag} {mode} round {rep} send {i}", failures)
            return dt

        # NIXL, one send: also the raw engine making a request per send, and the Python floor
        modes = ["pdplug", "raw"]
        if k == 1:
            modes += [m for m, attr in _EXTRA.items() if hasattr(cases[0]["raw"], attr)]

        reps = timed_rounds(len(modes), max(20, repeats))  # whole cycles of the order
        pd: list[float] = []
        raw: list[float] = []
        diff: list[float] = []
        diff_fresh: list[float] = []
        diff_floor: list[float] = []
        for rep in range(reps + 2):
            checked = rep in (0, reps + 1)  # warm-up and last round: checked, untimed
            # every run of a round follows the same bootstrap round trip with the decode (its
            # rooms' DestInfos, WaitingForInput): the first one starts cold after it, the
            # others right after another mode's run; over the timed rounds each mode comes
            # first, and right after each other one, equally often (pdplug_bench.orders)
            rooms = bootstrap(checked)
            t: dict[str, float] = {}
            for i, m in enumerate(mode_order(modes, rep - 1)):  # timed rounds 1.. take rows 0..
                if m != "pdplug":
                    t[m] = run_raw(checked, rep, mode=m)
                    continue
                if checked and i:  # another mode's bytes must not pass for pdplug's
                    for c in cases:
                        rig.peer.fill("bench-decode", [c["dp"].tolist()], POISON)
                t[m] = run_pdplug(checked, rep, rooms)
            if not checked:
                pd.append(t["pdplug"])
                raw.append(t["raw"])
                diff.append((t["pdplug"] - t["raw"]) / k)
                if "raw fresh-request" in t:
                    diff_fresh.append(t["pdplug"] - t["raw fresh-request"])
                if "python floor" in t:
                    diff_floor.append(t["python floor"] - t["raw"])
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
                "fixed_vs_fresh_us": _median_us(diff_fresh),
                "floor_us": _median_us(diff_floor),
            }
        )
    return rows, failures
