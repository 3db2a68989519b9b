"""Prefill -> decode KV transfer, decode DCP 2, through the rendezvous: runnable end to end.

Run it from a checkout with pdplug installed (``pip install -e ".[all]"``)::

    python examples/transfer_dcp.py              # the selected KV sender (nixl by default)
    python examples/transfer_dcp.py mooncake     # or name one (sets PDPLUG_KV_SENDER)

Four parts, three processes: this script starts the rendezvous (a thread) and spawns one
prefill rank (PP 1) and two decode DCP ranks. Each rank builds its own
:class:`pdplug.PluginManager` and its KV sender or receiver; every rank describes its paged KV
with an explicit :class:`pdplug.KVLayout` (2 layers x K 64 B + V 48 B per token, 16-token
pages). The prefill rank registers its KV, which publishes it at the rendezvous; each decode
rank resolves the prefill instance there, connects (the handshake checks both layouts and
every plugin's veto), and asks for room 7 (a 100-token prompt) in its own pages. The prefill
rank splits the send at its pack capacity and ships it; decode DCP rank ``r`` receives logical
tokens ``i`` with ``i % 2 == r`` at local offset ``i // 2``. Each decode rank checks every byte
it got against the prefill KV. The script exits 0 when both decode ranks got exactly the
right bytes, 1 otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

import numpy as np
import torch

from pdplug import KVConfig, KVLayout, KVPoll, PluginManager, SchedulerConfig
from pdplug.bootstrap import RendezvousServer, resolve
from pdplug.transfer import hard_exit

PAGE = 16  # tokens per page
LAYERS = 2
BPT = (64, 48) * LAYERS  # bytes per token of each KV entry: K and V of every layer
DCP = 2  # decode context-parallel ranks
PREFILL, DECODE = "prefill-0", "decode-0"  # instance ids
ROOM, NUM_TOKENS = 7, 100  # one request: its bootstrap room and prompt length in tokens
SRC_PAGES = np.random.default_rng(0).permutation(64)[: -(-NUM_TOKENS // PAGE)]  # int64 page ids


def prefill_kv() -> list[torch.Tensor]:
    """The prefill rank's KV: one uint8 tensor ``[64 pages * 16 tokens, bytes]`` per entry."""
    gens = [torch.Generator().manual_seed(e) for e in range(len(BPT))]
    return [
        torch.randint(1, 256, (64 * PAGE, b), dtype=torch.uint8, generator=g)
        for b, g in zip(BPT, gens)
    ]


def prefill_main(endpoint: str, out: Any) -> None:
    """The prefill rank: publish, wait for both decode ranks' destinations, send, report."""
    layout = KVLayout(page_size=PAGE, entry_bytes_per_token=BPT, num_layers=LAYERS)
    pm = PluginManager()  # every plugin, via entry points; pass env=/select=/block= to override
    scheduler = pm.make_scheduler(SchedulerConfig(page_size=PAGE, chunk_size=64))
    cfg = KVConfig(instance=PREFILL, role="prefill", layout=layout, bootstrap_endpoint=endpoint)
    sender = pm.make_kv_sender(cfg)  # with the selected pack planner (dcp)
    try:
        sender.register_kv(prefill_kv())  # once; also publishes this rank at the rendezvous
        sender.start(ROOM)  # the request arrived: Bootstrapping until both DCP ranks answered
        sender.wait(ROOM, (KVPoll.WaitingForInput,))
        d = sender.dest(ROOM)[0]  # what decode asked for: prefix and token count
        cap = sender.capacity_tokens(ROOM)  # pack capacity: the send is split at it
        for seg in scheduler.split_send(
            token_start=d.decode_prefix_len,
            token_end=d.num_tokens,
            decode_prefix_len=d.decode_prefix_len,
            is_last_send=True,
            capacity_tokens=cap,
        ):
            sender.send(ROOM, seg, SRC_PAGES[seg.token_start // PAGE :])
        status = sender.wait(ROOM)  # Success or Failed, within the configured timeouts
        out.put(("prefill", status.name, sender.failure_reason(ROOM) or ""))
        while not sender.drained(ROOM):  # no write still reads the pages: free them now
            time.sleep(0.01)
        sender.clear(ROOM)
    finally:
        sender.close()
        out.close()
        out.join_thread()
    hard_exit(0)  # see pdplug.transfer.hard_exit: skip native destructors at exit


def decode_main(rank: int, endpoint: str, out: Any) -> None:
    """Decode DCP rank ``rank``: connect, ask for room 7 in its own pages, check every byte."""
    layout = KVLayout(
        page_size=PAGE, entry_bytes_per_token=BPT, num_layers=LAYERS, dcp_size=DCP, dcp_rank=rank
    )
    pm = PluginManager()  # every plugin, via entry points; pass env=/select=/block= to override
    receiver = pm.make_kv_receiver(KVConfig(instance=DECODE, role="decode", layout=layout))
    dst = [torch.zeros(32 * PAGE, b, dtype=torch.uint8) for b in BPT]  # 32 pages, poisoned: 0
    dst_pages = np.arange(4, dtype=np.int64) * 3 + 1  # 4 virtual pages = 128 logical tokens
    try:
        receiver.register_kv(dst)
        receiver.connect(resolve(endpoint, PREFILL, timeout_s=30))  # raises CompatError
        receiver.expect(ROOM, dst_pages, num_tokens=NUM_TOKENS)  # sends its destination
        status = receiver.wait(ROOM)
        # DCP rule: logical token i lives on rank i % DCP at local offset i // DCP.
        i = torch.arange(rank, NUM_TOKENS, DCP)
        src_slot = torch.as_tensor(SRC_PAGES)[i // PAGE] * PAGE + i % PAGE
        j = i // DCP
        dst_slot = torch.as_tensor(dst_pages)[j // PAGE] * PAGE + j % PAGE
        wrong = sum(
            int((d[dst_slot] != s[src_slot]).any(dim=1).sum()) for d, s in zip(dst, prefill_kv())
        )
        out.put((f"decode DCP rank {rank}", status.name, f"{len(i)} tokens, {wrong} wrong rows"))
        receiver.clear(ROOM)
    finally:
        receiver.close()
        out.close()
        out.join_thread()
    hard_exit(0)


def main(backend: str | None = None) -> int:
    """Start the rendezvous, spawn the ranks, print what each reports.

    :param backend: a KV sender name; it reaches the ranks as ``PDPLUG_KV_SENDER``.
    :returns: the exit status (0: every rank succeeded and every byte is right).
    """
    if backend:
        os.environ["PDPLUG_KV_SENDER"] = backend  # the ranks' managers read it
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    server = RendezvousServer().start()  # one per deployment; any process, a thread
    endpoint = server.endpoint  # tcp://127.0.0.1:port: give it to every rank
    procs = [ctx.Process(target=prefill_main, args=(endpoint, out))]
    procs += [ctx.Process(target=decode_main, args=(r, endpoint, out)) for r in range(DCP)]
    reports: list[tuple[str, str, str]] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 120
        while len(reports) < len(procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank died: its traceback is on stderr
            try:
                reports.append(out.get(timeout=0.2))
            except queue.Empty:
                pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
        server.stop()
    for who, status, detail in sorted(reports):
        print(f"{who}: {status} {detail}")
    ok = len(reports) == len(procs) and all(status == "Success" for _, status, _ in reports)
    ok = ok and all(d.endswith(", 0 wrong rows") for w, _, d in reports if w.startswith("decode"))
    print("every byte arrived where DCP 2 puts it" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
