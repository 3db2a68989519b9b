"""Consensus across 2 PP prefill ranks, each in its own process: a complete, runnable host loop.

Run it from a checkout with pdplug installed (``pip install -e .``)::

    python examples/consensus_pp.py              # the selected consensus (pp0 by default)
    python examples/consensus_pp.py ring         # or name one (sets PDPLUG_CONSENSUS)

Each rank builds its own :class:`pdplug.PluginManager`, asks it for the selected consensus for
its PP rank, and votes every loop iteration: rank 0 is ready for rooms 1, 2 and 3; rank 1 is
ready for 1 and 2 but room 3 failed there. Every rank applies the same gap-free, numbered
decisions in the same order: rooms 1 and 2 good (ready on every rank), room 3 bad (failed on
one). The script exits 0 when both ranks applied identical decisions, 1 otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

from pdplug import ConsensusConfig, PluginManager
from pdplug.ports import free_endpoints

ROOMS = (1, 2, 3)
FAILED = {1: (3,)}  # PP rank -> rooms that failed on that rank


def rank_main(rank: int, pp: int, endpoints: tuple[str, ...], out: Any, stop: Any) -> None:
    """One PP rank's process: build the consensus, then vote and apply decisions every loop
    iteration until the parent says stop (a ring needs every rank's loop to forward)."""
    pm = PluginManager()  # every plugin, via entry points; pass env=/select=/block= to override
    cons = pm.make_consensus(ConsensusConfig(pp_rank=rank, pp_size=pp, endpoints=endpoints))
    failed = [r for r in ROOMS if r in FAILED.get(rank, ())]
    ready = [r for r in ROOMS if r not in failed]
    applied: list[tuple[str, int, list[int], list[int]]] = []
    try:
        while not stop.is_set():  # the host's scheduler loop, on every PP rank
            cons.offer("bootstrap", good=ready, bad=failed)
            for d in cons.poll():  # same decisions, same order, on every PP rank
                applied.append((d.stream, d.seq, sorted(d.good), sorted(d.bad)))
                if {r for _, _, g, b in applied for r in (*g, *b)} == set(ROOMS):
                    out.put((rank, applied))  # every room decided here
            time.sleep(0.005)  # stands in for one forward step
    finally:
        cons.close()


def main(name: str | None = None, pp: int = 2) -> int:
    """Spawn ``pp`` rank processes, collect what each applied, and compare.

    :param name: a consensus name; it reaches the ranks as ``PDPLUG_CONSENSUS``.
    :returns: the exit status (0: identical, expected decisions on every rank).
    """
    if name:
        os.environ["PDPLUG_CONSENSUS"] = name  # the ranks' managers read it
    ctx = mp.get_context("spawn")
    endpoints = free_endpoints(pp)  # one tcp://127.0.0.1:port per rank, shared by all
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(r, pp, endpoints, out, stop)) for r in range(pp)]
    for p in procs:
        p.start()
    got: dict[int, list[Any]] = {}
    deadline = time.monotonic() + 90
    try:
        while len(got) < pp and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank died: its traceback is on stderr
            try:
                rank, applied = out.get(timeout=0.2)
                got[rank] = applied
            except queue.Empty:
                pass
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
    if len(got) < pp:
        print(f"only ranks {sorted(got)} decided every room within 90 s")
        return 1
    for rank in sorted(got):
        print(f"PP rank {rank} applied: {got[rank]}")
    good = {r for _, _, g, _ in got[0] for r in g}
    bad = {r for _, _, _, b in got[0] for r in b}
    same = all(got[r] == got[0] for r in got)
    ok = same and good == {1, 2} and bad == {3} and all(p.exitcode == 0 for p in procs)
    print("identical decisions on every rank: good [1, 2], bad [3]" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
