"""``pdplug bench transfer``: pdplug's KV sender vs the tightest raw engine call on the same
memory and descriptors, and both vs a plain memcpy on this machine.

Prefill side = this process: a real KV sender from the plugin manager (``--backend``), and the
raw engine (a second NIXL agent / Mooncake TransferEngine registering the same source
memory). Decode side = a spawned process with a real KV receiver. KV: 2 entries x 2,048 B per
token, page 64 tokens (128 KiB per page and entry), pages shuffled on both sides, so a send of
S bytes is S / 128 KiB descriptors (merged where pages happen to be adjacent).

Per size, interleaved, each timed over ``repeats`` runs after one warm-up:

* ``pdplug``: ``sender.send(room, one segment)`` until the sender reports ``Success`` (plan,
  descriptor build, post, completion through the session's engine thread);
* ``raw``: the engine on the *same* descriptors (``pdplug.packing.run_addresses`` of the same
  plan), prepared once before timing and reused, so a run is only the engine's own work: NIXL
  one transfer handle made once (``initialize_xfer``) and re-posted (``transfer`` + a tight
  ``check_xfer_state`` loop); Mooncake the address lists built once and written with
  ``batch_transfer_sync_write`` (1,024 descriptors a call, as pdplug's engine does);
* ``raw fresh`` (NIXL): the same raw agent with a request made for each run
  (``make_prepped_xfer`` on descriptor lists prepared once from the same descriptors, posted,
  polled, released after the timing): what any connector pays when a send's page ids are new
  (vLLM's NixlConnector posts its block lists this way), so ``vs fresh`` separates pdplug's own
  cost from the engine's per-request cost that the re-posted handle of ``raw`` skips;
* ``py floor`` (NIXL): ``raw fresh`` plus the least any Python send does around it, with
  nothing of a session: the page ids copied and bounds-checked, the request's indices computed
  (int32 arrays, as pdplug's lists take them), the status published under a lock with waiters
  notified. ``floor`` is its overhead over ``raw``; ``overhead`` minus ``floor`` is the share of
  pdplug's session (rooms, leases, plans, tags, bookkeeping), the part a faster send path can
  remove;
* ``memcpy``: ``dst.copy_(src)`` of the same bytes in this process.

Runs are paired (every mode once per round, back to back, in an order balanced for
carry-over, :mod:`pdplug_bench.orders`: over the timed rounds, a whole number of the order's
cycles, each mode runs first after the room's bootstrap, and right after each other mode,
equally often, and drift on a shared machine hits all alike); per size
``overhead = 1 - median(t_raw / t_pdplug)`` over the pairs (goal <= 5% at 16, 64 and 256 MiB),
with the pairs' interquartile range as the spread (``--runs N`` repeats the whole measurement
in the same rig and adds each run's figures, their median and range:
:mod:`pdplug_bench.spread`); the GB/s columns are
size / median time. ``plan ms`` is the pack planner's time for the send's plan (part of
pdplug's time). ``hop ms`` is the floor of pdplug's threading model: the median of empty round
trips to the sender's engine thread (:meth:`pdplug.transfer.session.RoomSession.ping`), each
right after a raw transfer of the size (caches as a finished send leaves them); ``hop/raw`` is
that floor as a share of the raw time, to compare with the overhead.

Bytes: the warm-up round and one extra untimed round at the end are checked for every mode
(pdplug, raw, raw fresh, py floor): the decode side poisons the expected pages, the run
lands, and a digest of the rows that landed (:mod:`pdplug_bench.bytecheck`) must equal the
digest of the source rows; the memcpy is compared too. Any mismatch exits non-zero.
JSON: ``{"rows": [{"backend", "bytes", "mode", "gbps"}], "pairs": [{..., "hop_ms", "raw_ms",
"pdplug_over_fresh", "pdplug_over_floor", "floor_over_raw"}], "overhead": {backend: {MiB: x}},
"overhead_vs_fresh_request": {backend: {MiB: x}} (NIXL), "overhead_python_floor": {backend:
{MiB: x}} (NIXL), "fixed_cost_us": {backend: {MiB: us}}, "fixed_cost_python_floor_us":
{backend: {MiB: us}} (NIXL), "runs": [{"overhead": {backend: {MiB: x}}, "fixed_us": {backend:
{MiB: us}}}] (one per ``--runs``; the top-level figures are the last run's), "run_spread": [{figure,
backend, size, values, median, low, high, goal, met}] (``--runs`` > 1, :mod:`pdplug_bench.spread`),
...}``.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import click

from pdplug_bench.machine import json_option
from pdplug_bench.options import StrictIntRange
from pdplug_bench.orders import mode_order, timed_rounds
from pdplug_bench.spread import RunFigures, spread_rows

MIB = 1 << 20
PAGE = 64
BPT = (2048, 2048)
_NOTIF = b"\x96" + b"\x00" * 24  # a tag-sized notification, like a pdplug completion tag
#: seconds a raw NIXL write may stay in flight before the bench gives up on it (pdplug's runs
#: have the same bound)
_RAW_WAIT_S = 60.0


def _raw_deadline(t_end: float, what: str) -> None:
    """Raise once ``t_end`` (monotonic seconds) passed: a raw write that never ends fails the
    run instead of spinning forever (checked only while the write is in flight)."""
    if time.monotonic() > t_end:
        raise click.ClickException(f"{what} not done after {_RAW_WAIT_S:g} s")


#: prepare(src, dst, lengths) -> run() -> seconds; and close()
RawPrep = Callable[[Any, Any, Any], Callable[[], float]]
#: how many writes the raw engine posted so far that notify the decode (NIXL), or None
RawPosted = Callable[[], "int | None"]


def _raw_nixl(
    src_regions: list[tuple[int, int]], peer_agent: bytes
) -> tuple[RawPrep, Any, RawPosted]:
    import importlib

    import numpy as np

    api = None
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = importlib.import_module(mod)
            break
        except ImportError:
            continue
    if api is None:
        raise click.ClickException("nixl is not installed")
    agent = api.nixl_agent(
        f"bench-raw-{uuid.uuid4().hex[:8]}",
        api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )
    reg = agent.register_memory(
        agent.get_reg_descs([(a, n, 0, "") for a, n in src_regions], "DRAM")
    )
    name = agent.add_remote_agent(peer_agent)
    name = name.decode() if isinstance(name, bytes) else name
    handles: list[Any] = []
    dlists: list[Any] = []
    posted = [0]  # every write notifies the decode, which drops it (an agent it does not know)

    def prepare(src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> Callable[[], float]:
        z = np.zeros(ln.shape[0], dtype=np.uint64)
        l64 = ln.astype(np.uint64)
        local = agent.get_xfer_descs(np.stack([src.astype(np.uint64), l64, z], 1), "DRAM")
        remote = agent.get_xfer_descs(np.stack([dst.astype(np.uint64), l64, z], 1), "DRAM")
        h = agent.initialize_xfer("WRITE", local, remote, name, _NOTIF)  # once, re-posted
        handles.append(h)
        # the same descriptors prepared once as dlists, for a request made per send
        sides = (
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", local),
            agent.prep_xfer_dlist(name, remote),
        )
        dlists.extend(sides)
        idx = np.arange(ln.shape[0], dtype=np.int64)

        def run() -> float:
            t_end = time.monotonic() + _RAW_WAIT_S
            t0 = time.perf_counter()
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
                _raw_deadline(t_end, "raw nixl transfer")
            dt = time.perf_counter() - t0
            posted[0] += 1
            if st != "DONE":
                raise click.ClickException(f"raw nixl transfer ended {st}")
            return dt

        def post(t_end: float) -> Callable[[], bool]:
            # t_end: the caller's deadline (monotonic s), taken before its clock started
            st = agent.transfer(h)
            posted[0] += 1

            def done() -> bool:
                nonlocal st
                if st == "PROC":
                    st = agent.check_xfer_state(h)
                    _raw_deadline(t_end, "raw nixl transfer")
                if st not in ("PROC", "DONE"):
                    raise click.ClickException(f"raw nixl transfer ended {st}")
                return bool(st == "DONE")

            return done

        def request(li: Any, ri: Any, t_end: float) -> tuple[Any, str]:
            # a request made on the prepared dlists, posted and polled to its end
            x = agent.make_prepped_xfer("WRITE", sides[0], li, sides[1], ri, _NOTIF)
            st = agent.transfer(x)
            while st == "PROC":
                st = agent.check_xfer_state(x)
                _raw_deadline(t_end, "raw nixl request")
            return x, st

        def ended(x: Any, st: str, what: str) -> None:
            # released after the timing; every request notifies the decode
            agent.release_xfer_handle(x)
            posted[0] += 1
            if st != "DONE":
                raise click.ClickException(f"raw nixl transfer ({what}) ended {st}")

        def fresh() -> float:
            # a request made for this send on the prepared dlists, posted once, released after
            # the timing: what a connector pays that cannot re-post one handle (new page ids)
            t_end = time.monotonic() + _RAW_WAIT_S
            t0 = time.perf_counter()
            x, st = request(idx, idx, t_end)
            dt = time.perf_counter() - t0
            ended(x, st, "fresh request")
            return dt

        # the least any Python send does on these prepared lists, with nothing of a session:
        # its page ids copied and bounds-checked, the request's indices computed (Python ints
        # up to 64, else one int32 array per side, as pdplug's lists take them), the request
        # made, posted and polled, the status published under a lock with waiters notified
        n = int(ln.shape[0])
        ids = np.arange(n, dtype=np.int64)
        base = np.zeros(1, dtype=np.int32)
        published = threading.Condition()
        status: list[str] = [""]

        def floor() -> float:
            t_end = time.monotonic() + _RAW_WAIT_S
            t0 = time.perf_counter()
            pages = ids.copy()
            if int(np.maximum.reduce(pages)) >= n:
                raise click.ClickException("python floor: a page id beyond the lists")
            if n <= 64:
                li: Any = pages.tolist()
                ri: Any = list(li)
            else:
                li = np.add(base, pages, dtype=np.int32, casting="same_kind")
                ri = np.add(base, pages, dtype=np.int32, casting="same_kind")
            x, st = request(li, ri, t_end)
            with published:
                status[0] = st
                published.notify_all()
            dt = time.perf_counter() - t0
            ended(x, st, "python floor")
            return dt

        run.post = post  # type: ignore[attr-defined]
        run.fresh = fresh  # type: ignore[attr-defined]
        run.floor = floor  # type: ignore[attr-defined]
        return run

    def close() -> None:
        # explicit teardown while the registered tensors are alive (no native destructors
        # racing the interpreter's exit)
        for h in handles:
            agent.release_xfer_handle(h)
        for d in dlists:
            agent.release_dlist_handle(d)
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)

    return prepare, close, lambda: posted[0]


def _raw_mooncake(
    src_regions: list[tuple[int, int]], peer_agent: bytes
) -> tuple[RawPrep, Any, RawPosted]:
    import numpy as np

    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise click.ClickException(f"mooncake is not installed: {e}") from e
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise click.ClickException("raw mooncake: initialize failed")
    eng.batch_register_memory([a for a, _ in src_regions], [n for _, n in src_regions])
    session = peer_agent.decode()
    step = 1024

    def prepare(src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> Callable[[], float]:
        s, d, n = src.tolist(), dst.tolist(), ln.tolist()  # once, reused
        batches = [(s[i : i + step], d[i : i + step], n[i : i + step])
                   for i in range(0, len(n), step)]  # fmt: skip

        def run() -> float:
            t0 = time.perf_counter()
            for bs, bd, bn in batches:
                rc = eng.batch_transfer_sync_write(session, bs, bd, bn)
                if rc != 0:
                    raise click.ClickException(f"raw mooncake write returned {rc}")
            return time.perf_counter() - t0

        def post(t_end: float) -> Callable[[], bool]:
            # the engine's asynchronous batch: submitted now, waited for by done() (which
            # blocks inside Mooncake, bounded by its own transfer timeout, not by t_end)
            ids = [eng.batch_transfer_async_write(session, bs, bd, bn) for bs, bd, bn in batches]
            if not all(ids):
                raise click.ClickException("raw mooncake async write was refused")

            def done() -> bool:
                if eng.get_batch_transfer_status(ids) != 0:
                    raise click.ClickException("raw mooncake async write failed")
                return True

            return done

        run.post = post  # type: ignore[attr-defined]
        return run

    def close() -> None:
        # explicit teardown while the registered tensors are alive (no native destructors
        # racing the interpreter's exit)
        eng.batch_unregister_memory([a for a, _ in src_regions])

    # a synchronous write returns once its batch completed; the asynchronous one once
    # get_batch_transfer_status said so: nothing of it is left for the decode to take
    return prepare, close, lambda: None


_PAIR_KEYS = ("backend", "bytes", "repeats", "pdplug_over_raw", "ratio_q1", "ratio_q3", "plan_ms",
              "hop_ms", "raw_ms", "pdplug_over_fresh", "pdplug_over_floor",
              "floor_over_raw")  # fmt: skip
#: how a mode is named in byte-check failures
_MODE_NAMES = {"raw": "raw", "raw_fresh": "raw fresh-request", "python_floor": "python floor"}


def _median(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


class Rig:
    """One prefill sender (this process), one spawned decode process, a rendezvous and the raw
    engine registered on the same source memory, for sends up to ``max_bytes``.

    Use as a context manager; :meth:`room` gives fresh room ids, :meth:`case` the pages,
    segment, plan and prepared raw run of a send of ``size`` bytes.
    """

    def __init__(self, backend: str, max_bytes: int) -> None:
        import torch

        from pdplug import KVConfig, KVLayout, PluginManager
        from pdplug.bootstrap import RendezvousServer
        from pdplug_bench._kvpeer import DecodeInstance, DecodePeer

        self.backend = backend
        max_tokens = max_bytes // sum(BPT)
        self.pages = -(-max_tokens // PAGE) + 16
        self.src_l = KVLayout(page_size=PAGE, entry_bytes_per_token=BPT, dtype="uint8")
        self.dst_l = KVLayout(page_size=PAGE, entry_bytes_per_token=BPT, dtype="uint8")
        self.server = RendezvousServer().start()
        pm = PluginManager()
        self.planner = pm.make_pack_planner()
        cfg = KVConfig(
            instance="bench-prefill",
            role="prefill",
            layout=self.src_l,
            bootstrap_endpoint=self.server.endpoint,
            bootstrap_timeout_s=60,
            waiting_timeout_s=120,
            transfer_timeout_s=60,
            pack_region_tokens=PAGE,
            max_dst_dcp=1,
        )
        self.sender = pm.make_kv_sender(cfg, self.planner, name=backend)
        self.gen = torch.Generator().manual_seed(0)
        self.kv = [
            torch.randint(1, 256, (self.pages * PAGE, b), dtype=torch.uint8, generator=self.gen)
            for b in BPT
        ]
        self.sender.register_kv(self.kv)
        self.peer = DecodePeer(
            backend,
            self.server.endpoint,
            "bench-prefill",
            [
                DecodeInstance(
                    name="bench-decode",
                    layout=self.dst_l,
                    rows=self.pages * PAGE,
                    # the target's UCX progresses on its own (as an RDMA NIC would): a WRITE
                    # over UCX's shared memory or TCP completes only once the target's worker
                    # progressed, so its polling cadence would be in both modes' times
                    extra={"progress_thread": "1"} if backend == "nixl" else {},
                )
            ],
        )
        self._raw_close: Any = None
        self._room = 0

    def __enter__(self) -> Rig:
        import numpy as np

        from pdplug.layout import entry_map

        self.peer.wait_ready(300)  # a spawned decode process starts slowly on a loaded machine
        dinfo = self.peer.infos["bench-decode"][0]
        regions = [(t.data_ptr(), t.numel()) for t in self.kv]
        self.prepare, self._raw_close, self._raw_posted = (
            _raw_nixl if self.backend == "nixl" else _raw_mooncake
        )(regions, dinfo.agent)
        self.src_base = np.array([t.data_ptr() for t in self.kv], dtype=np.int64)
        self.dst_base = np.asarray(dinfo.entry_base, dtype=np.int64)
        self.emap = entry_map(self.src_l, self.dst_l)
        self.rng = np.random.default_rng(1)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._raw_close is not None:
            self._raw_close()
        self.peer.close()
        self.sender.close()
        self.server.stop()

    def room(self) -> int:
        """A room id not used before in this rig."""
        self._room += 1
        return self._room

    def cases(self, size: int, k: int = 1) -> list[dict[str, Any]]:
        """``k`` sends of ``size`` bytes (``size // 4,096`` tokens each) between shuffled
        pages, no destination page shared by two of them (:meth:`case` each)."""
        n_pages = -(-(size // sum(BPT)) // PAGE)
        if n_pages * k > self.pages:
            raise click.ClickException(
                f"{k} sends of {size} bytes need more than {self.pages} pages"
            )
        dst = self.rng.permutation(self.pages)
        return [self.case(size, dst[i * n_pages : (i + 1) * n_pages]) for i in range(k)]

    def case(self, size: int, dp: Any = None) -> dict[str, Any]:
        """A send of ``size`` bytes (``size // 4,096`` tokens) between shuffled pages (into
        destination pages ``dp`` when given): its source and destination pages, segment, token
        count, plan (with the planner's time) and the raw engine prepared on the plan's
        descriptors."""
        from pdplug.packing import run_addresses, segment_to_chunk
        from pdplug.types import Segment
        from pdplug_bench.bytecheck import rows_digest, src_rows

        n_tok = size // sum(BPT)
        n_pages = -(-n_tok // PAGE)
        sp = self.rng.permutation(self.pages)[:n_pages].astype("int64")
        if dp is None:
            dp = self.rng.permutation(self.pages)[:n_pages]
        dp = dp.astype("int64")
        seg = Segment(
            token_start=0, token_end=n_tok, page_start=0, num_tokens=n_tok, chunk_id=0,
            is_last=True,
        )  # fmt: skip
        chunk = segment_to_chunk(0, seg, sp, dp, 0, PAGE)
        t0 = time.perf_counter()
        plan = self.planner.plan(chunk, self.src_l, self.dst_l, 0, None)
        plan_ms = (time.perf_counter() - t0) * 1e3  # the planner's share of pdplug's time
        raw = self.prepare(*run_addresses(plan, self.src_base, self.dst_base, self.emap))
        want = rows_digest(self.kv, src_rows(sp, PAGE, n_tok))
        return {"sp": sp, "dp": dp, "seg": seg, "n_tok": n_tok, "plan": plan,
                "plan_ms": plan_ms, "raw": raw, "want": want}  # fmt: skip

    def check(
        self, c: dict[str, Any], what: str, failures: list[str], corrupt: bool = False
    ) -> None:
        """Compare the digest of the rows that landed for case ``c`` with its source's."""
        (got,) = self.peer.digest("bench-decode", [c["dp"].tolist()], [c["n_tok"]],
                                  corrupt=corrupt)  # fmt: skip
        if got != c["want"]:
            failures.append(
                f"{what}: the {c['n_tok']:,} tokens that landed differ from the source "
                f"(digest {got} != {c['want']})"
            )

    def expect(self, rooms: list[int], c: dict[str, Any], poison: int | None) -> None:
        """Every room of ``rooms`` expected by the decode and started here, ``WaitingForInput``
        on return (poisoning the pages first when ``poison`` is given)."""
        from pdplug import KVPoll

        for room in rooms:
            self.peer.expect("bench-decode", room, [c["dp"].tolist()], c["n_tok"],
                             poison=poison)  # fmt: skip
            self.sender.start(room)
        for room in rooms:
            if self.sender.wait(room, (KVPoll.WaitingForInput,), 60) != KVPoll.WaitingForInput:
                raise click.ClickException(f"{self.backend}: {self.sender.failure_reason(room)}")

    def raw_landed(self) -> None:
        """Return once every write the raw engine posted so far has landed at the decode
        (NIXL: its notification reached the decode's receivers; Mooncake: its call returned
        only then), so the run after a raw one does not pay for the raw write's last bytes
        still being taken in, as the run after a pdplug one does not (:meth:`finish` waits for
        the decode's verdict)."""
        n = self._raw_posted()
        if n is not None:
            self.peer.landed("bench-decode", n)

    def finish(self, rooms: list[int], check: Callable[[], object] = lambda: None) -> None:
        """Check the decode's verdict on every room, then ``check()`` (a byte check while the
        rooms' pages still hold what landed), and clear the rooms on both sides."""
        for room in rooms:
            verdict = self.peer.done(room)
            if not verdict["ok"]:
                raise click.ClickException(f"{self.backend} decode: {verdict['reasons']}")
        check()
        for room in rooms:
            self.sender.clear(room)
            self.peer.clear("bench-decode", room)


def _bench_backend(
    rig: Rig, sizes: list[int], repeats: int, corrupt: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows per size and mode, and the byte-check failures (empty when all bytes matched)."""
    import torch

    from pdplug import KVPoll
    from pdplug_bench.bytecheck import POISON

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    backend = rig.backend
    sender, peer, g = rig.sender, rig.peer, rig.gen
    for size in sizes:
        c = rig.case(size)
        plan, plan_ms, raw = c["plan"], c["plan_ms"], c["raw"]
        src_t = torch.randint(1, 256, (size,), dtype=torch.uint8, generator=g)
        dst_t = torch.zeros(size, dtype=torch.uint8)
        # a 16 MiB median over 16 pairs moved by +-4 points between runs on a 2-vCPU VM
        reps = min(40, max(repeats, (1024 * MIB) // size))
        tag = f"{backend} {size / MIB:g} MiB"

        def run_pdplug(checked: bool, rep: int, room: int, c: dict[str, Any] = c,
                       tag: str = tag) -> float:  # fmt: skip
            t0 = time.perf_counter()
            sender.send(room, c["seg"], c["sp"])
            st = sender.wait(room, timeout_s=60)  # blocks on a condition: no spinning host
            dt = time.perf_counter() - t0
            if st != KVPoll.Success:
                raise click.ClickException(f"{backend}: {sender.failure_reason(room)}")

            def bytes_ok() -> None:
                if checked:
                    rig.check(c, f"{tag} pdplug round {rep}", failures, corrupt and rep == 0)

            rig.finish([room], bytes_ok)
            return dt

        def run_raw(checked: bool, rep: int, fn: Callable[[], float] = raw, mode: str = "raw",
                    c: dict[str, Any] = c, tag: str = tag) -> float:  # fmt: skip
            if checked:
                peer.fill("bench-decode", [c["dp"].tolist()], POISON)
            dt = float(fn())
            rig.raw_landed()  # untimed, as pdplug's run ends with the decode's verdict
            if checked:
                rig.check(c, f"{tag} {mode} round {rep}", failures)
            return dt

        # NIXL: also the raw engine with a request made per send, and the Python floor
        extra: dict[str, Callable[[], float]] = {
            m: getattr(raw, attr)
            for m, attr in (("raw_fresh", "fresh"), ("python_floor", "floor"))
            if hasattr(raw, attr)
        }
        modes = ["pdplug", "raw", *extra]
        reps = timed_rounds(len(modes), reps)  # whole cycles of the order
        times: dict[str, list[float]] = {m: [] for m in [*modes, "memcpy"]}
        ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}  # t_mode / t_pdplug
        for rep in range(reps + 2):
            # the first round warms connections and pages up, the last is an extra check;
            # both are checked and untimed
            checked = rep in (0, reps + 1)
            # every run of a round follows the room's bootstrap round trip with the decode:
            # the run right after that wait runs cold (sendcost.py), the others right after
            # another mode's run; over the timed rounds every mode comes first, and right after
            # each other one, equally often (pdplug_bench.orders), and drift on a shared machine
            # hits all alike
            room = rig.room()
            rig.expect([room], c, POISON if checked else None)
            got: dict[str, float] = {}
            for i, m in enumerate(mode_order(modes, rep - 1)):  # timed rounds 1.. take rows 0..
                if m != "pdplug":
                    fn = raw if m == "raw" else extra[m]
                    got[m] = run_raw(checked, rep, fn, _MODE_NAMES[m])
                    continue
                if checked and i:  # another mode's bytes must not pass for pdplug's
                    peer.fill("bench-decode", [c["dp"].tolist()], POISON)
                got[m] = run_pdplug(checked, rep, room)
            dst_t.zero_()
            t0 = time.perf_counter()
            dst_t.copy_(src_t)
            t_cpy = time.perf_counter() - t0
            if checked and not torch.equal(dst_t, src_t):
                failures.append(f"{tag} memcpy round {rep}: copy differs from its source")
            if not checked:
                for m in modes:
                    times[m].append(got[m])
                times["memcpy"].append(t_cpy)
                for m in ratios:
                    ratios[m].append(got[m] / got["pdplug"])
        pair_ratio = ratios["raw"]
        # the Python floor against raw, paired the same way (its overhead: what any Python
        # send adds here before a session does anything)
        floor_ratio = [r / f for r, f in zip(times["raw"], times.get("python_floor", []))]
        q1, q3 = _quartiles(pair_ratio)
        # the floor of pdplug's design: an empty round trip to the sender's engine thread
        # right after a transfer of this size (caches as a finished send leaves them)
        hops: list[float] = []
        ping: Callable[[], float] | None = getattr(sender, "ping", None)
        for _ in range(min(reps, 15)):
            if ping is None:
                break
            raw()
            hops.append(ping())
        hop_ms = statistics.median(hops) * 1e3 if hops else None  # a sender without ping
        for mode, ts in times.items():
            if not ts:
                continue
            rows.append(
                {
                    "backend": backend,
                    "bytes": size,
                    "mode": mode,
                    "gbps": size / statistics.median(ts) / 1e9,
                    "runs": plan.num_runs,
                    "repeats": reps,
                    "pdplug_over_raw": statistics.median(pair_ratio),
                    "ratio_q1": q1,
                    "ratio_q3": q3,
                    "plan_ms": plan_ms,
                    "hop_ms": hop_ms,
                    "raw_ms": statistics.median(times["raw"]) * 1e3,
                    "pdplug_over_fresh": _median(ratios.get("raw_fresh")),
                    "pdplug_over_floor": _median(ratios.get("python_floor")),
                    "floor_over_raw": _median(floor_ratio),
                }
            )
    return rows, failures


def _print_spread(console: Any, per_run: list[RunFigures]) -> list[dict[str, Any]]:
    """Print the run-to-run table (:mod:`pdplug_bench.spread`) and return its rows."""
    from rich.table import Table

    rows = spread_rows(per_run)
    t = Table(title=f"run to run: {len(per_run)} runs in one rig (the tables above: the last)")
    for col in ("figure", "backend", "size", "per run", "median", "range", "goal", "met"):
        t.add_column(col, justify="right")
    for r in rows:
        pct = r["figure"] == "overhead"  # one digit more than the goal: "met" reads the value
        fmt = (lambda v: f"{v:+.2%}") if pct else (lambda v: f"{v:.1f}")
        t.add_row(
            "overhead" if pct else "fixed us, K = 1", r["backend"], f"{r['size']} MiB",
            " ".join(fmt(v) for v in r["values"]), fmt(r["median"]),
            f"{fmt(r['low'])} to {fmt(r['high'])}", r["goal"] or "-",
            "-" if r["met"] is None else f"{r['met']} of {len(r['values'])}",
        )  # fmt: skip
    console.print(t)
    if any(v < 0 for r in rows if r["figure"] == "overhead" for v in r["values"]):
        console.print(
            "overhead below 0 in a run: pdplug cannot beat the same engine call made bare; "
            "such a run is the pairs' noise (read the median and the range, not one run)"
        )
    return rows


#: what the rig's pipe to its decode process raises once that process ended (a Ctrl-C of the
#: terminal reaches it too): the run stops there instead of going on to the next backend
_LOST = (BrokenPipeError, EOFError, ConnectionError)


def _why(e: BaseException) -> str:
    """One line for a backend that could not run: the bench's own message, else the error's
    type and text; a lost pipe or connection means the decode process the rig spawned ended
    (a signal, Ctrl-C, reaches it too)."""
    if isinstance(e, click.ClickException):
        return e.format_message()
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if isinstance(e, _LOST):
        why += " (the bench's decode process ended: interrupted, or see its lines above)"
    return why


def _not_run(errors: dict[str, str]) -> str:
    return "; ".join(f"{b} did not run: {why}" for b, why in errors.items())


def _label(mib: str) -> str:
    """A size key in MiB (``"0.0625"``) as people write it (``"64 KiB"``)."""
    nbytes = float(mib) * MIB
    if nbytes < MIB and nbytes % 1024 == 0:
        return f"{nbytes / 1024:g} KiB"
    return f"{float(mib):g} MiB"


def _whole_tokens(mib: list[float], option: str) -> list[int]:
    """Sizes in MiB as bytes of whole tokens (4,096 B each, rounded down): a send moves whole
    tokens, so the size a row names and its GB/s are the bytes it moved (``--sizes 0.3`` is
    311,296 B, shown as 0.296875 MiB).

    :raises click.BadParameter: two sizes that are the same number of tokens.
    """
    tok = sum(BPT)
    out = [int(x * MIB) // tok * tok for x in mib]
    twice = sorted({b for b in out if out.count(b) > 1})
    if twice:
        same = "; ".join(
            " and ".join(f"{x:g}" for x, b in zip(mib, out) if b == t)
            + f" are {t // tok} tokens ({t / MIB:g} MiB)"
            for t in twice
        )
        raise click.BadParameter(
            f"{same} (sizes round down to whole tokens of {tok:,} B): name each size once",
            param_hint=f"'{option}'",
        )
    return out


def _check_memory(need: int, largest: int) -> None:
    """Refuse a run that would not fit in host memory: KV of ``need`` bytes (plus 16 pages) on
    each side (this process and the decode process) and two ``largest``-byte buffers for the
    memcpy baseline, against 80 % of the memory available now.

    :raises click.UsageError: it does not fit (names the options that size it).
    """
    from pdplug_bench.machine import available_bytes

    total = 2 * (need + 16 * PAGE * sum(BPT)) + 2 * largest
    avail = available_bytes()
    if total > 0.8 * avail:
        raise click.UsageError(
            f"--sizes/--small-sizes/--steps need {total / 2**30:.1f} GiB of host memory (KV of "
            f"{need / 2**20:g} MiB on each side: the largest size, or the smallest small size "
            f"times the largest K) but {avail / 2**30:.1f} GiB is available; use smaller sizes "
            "or fewer --steps"
        )


@click.command()
@click.option(
    "--backend", default="nixl,mooncake", show_default=True, help="Comma-separated KV sender names."
)
@click.option("--sizes", default="16,64,256", show_default=True,
              help="Sizes in MiB, comma-separated (each at least one page).")  # fmt: skip
@click.option("--repeats", default=9, show_default=True, type=StrictIntRange(1, 40),
              help="Timed pairs per size: large sends at least 1 GiB / size (at most 40), "
                   "small sends at least 20; rounded up to whole cycles of the round order "
                   "(4 rounds with NIXL's four modes, 2 with two).")  # fmt: skip
@click.option("--small-sizes", default="0.0625,1,16", show_default=True,
              help="Sizes in MiB of the fixed-cost table (one send alone), comma-separated; "
                   "'' skips the table.")  # fmt: skip
@click.option(
    "--steps",
    default="8,32",
    show_default=True,
    help="K sends posted in one step (at the smallest small size), comma-separated.",
)
@click.option("--runs", default=1, show_default=True, type=StrictIntRange(1, 20),
              help="Whole measurements in one rig (fresh rooms each); more than one adds a "
                   "run-to-run table (each run's overhead and fixed costs, median, range, "
                   "goal met in how many runs).")  # fmt: skip
@click.option("--inject-fault", is_flag=True, hidden=True,
              help="Tests only: flip one landed byte before the first check.")  # fmt: skip
@json_option
def cli(
    backend: str,
    sizes: str,
    repeats: int,
    small_sizes: str,
    steps: str,
    runs: int,
    inject_fault: bool,
    json_path: str | None,
) -> None:
    """pdplug's KV sender vs the raw engine on prepared descriptors, and vs memcpy; the fixed
    cost of one send and of K sends per step; bytes checked."""
    from rich.console import Console
    from rich.table import Table

    from pdplug_bench.machine import machine_line, write_json
    from pdplug_bench.options import component_names, number_list
    from pdplug_bench.sendcost import fixed_cost

    page_mib = sum(BPT) * PAGE / MIB
    size_list = _whole_tokens(number_list(sizes, "--sizes", "MiB", page_mib), "--sizes")
    if max(size_list) > 4096 * MIB:
        raise click.BadParameter(f"{sizes!r}: at most 4096 MiB", param_hint="'--sizes'")
    tok_mib = sum(BPT) / MIB
    small = (
        _whole_tokens(number_list(small_sizes, "--small-sizes", "MiB", tok_mib), "--small-sizes")
        if small_sizes.strip()
        else []
    )
    if small and max(small) > 256 * MIB:
        raise click.BadParameter(f"{small_sizes!r}: at most 256 MiB", param_hint="'--small-sizes'")
    ks = number_list(steps, "--steps", "sends", float("-inf"))  # numbers, none twice
    if any(k != int(k) or not 1 <= k <= 64 for k in ks):
        raise click.BadParameter(f"{steps!r}: whole numbers 1-64", param_hint="'--steps'")
    step_list = [int(k) for k in ks] if small else []
    backends = component_names(backend, "kv_sender", "--backend")
    # the K rows post K sends of the smallest small size at once, each on whole pages of its own
    page_bytes = sum(BPT) * PAGE
    k_rows = max(step_list, default=1) * -(-min(small) // page_bytes) * page_bytes if small else 0
    need = max([*size_list, *small, k_rows])
    _check_memory(need, max(size_list))
    console = Console(width=160)  # tables stay whole when piped
    console.print(machine_line())
    console.print(
        f"KV: {len(BPT)} entries x {BPT[0]} B/token, page {PAGE} tokens "
        f"({BPT[0] * PAGE // 1024} KiB per page and entry), shuffled pages; sizes "
        + ", ".join(f"{s / MIB:g} MiB" for s in size_list)
        + ("; small sends " + ", ".join(f"{s / MIB:g} MiB" for s in small) if small else "")
    )
    rows: list[dict[str, Any]] = []
    small_rows: list[dict[str, Any]] = []
    failures: list[str] = []
    errors: dict[str, str] = {}  # a backend that could not run: the others' tables still print
    ran: list[str] = []
    per_run: list[RunFigures] = [{"overhead": {}, "fixed_us": {}} for _ in range(runs)]
    for b in backends:
        try:
            with Rig(b, need) as rig:
                for i in range(runs):  # the tables below show the last run; every one is checked
                    r, f = _bench_backend(rig, size_list, repeats, corrupt=inject_fault and not i)
                    kr, kf = fixed_cost(rig, small, step_list, repeats) if small else ([], [])
                    failures.extend(f + kf)
                    per_run[i]["overhead"][b] = {
                        f"{x['bytes'] / MIB:g}": 1.0 - x["pdplug_over_raw"]
                        for x in r if x["mode"] == "pdplug"
                    }  # fmt: skip
                    per_run[i]["fixed_us"][b] = {
                        f"{x['bytes'] / MIB:g}": x["fixed_us"] for x in kr if x["k"] == 1
                    }
        except Exception as e:
            why = _why(e)
            errors[b] = why
            console.print(f"{b}: did not run: {why}")
            if isinstance(e, _LOST):  # an interrupt reached the decode process: stop here
                raise click.ClickException(_not_run(errors)) from None
            continue
        ran.append(b)
        rows.extend(r)
        small_rows.extend(kr)
    if not ran:
        raise click.ClickException(_not_run(errors))
    # two tables of ~100 columns each: one of 17 columns wraps in a 190-column terminal
    t = Table(title="pdplug bench transfer (GB/s, median; raw = prepared once, reused)")
    for col in ("backend", "size", "descriptors", "pairs", "pdplug", "raw", "raw fresh",
                "py floor", "memcpy"):  # fmt: skip
        t.add_column(col, justify="right")
    t2 = Table(title="pdplug against raw (paired; overhead = 1 - pdplug/raw)")
    for col in ("backend", "size", "pdplug/raw", "IQR", "overhead", "vs fresh", "floor",
                "plan ms", "hop ms", "hop/raw"):  # fmt: skip
        t2.add_column(col, justify="right")
    overhead: dict[str, dict[str, float]] = {}
    over_fresh: dict[str, dict[str, float]] = {}
    floor: dict[str, dict[str, float]] = {}  # the Python floor's own overhead over raw
    over_floor: dict[str, dict[str, float]] = {}  # pdplug's over the floor, paired
    for b in ran:
        for size in size_list:
            g = {r["mode"]: r for r in rows if r["backend"] == b and r["bytes"] == size}
            p = g["pdplug"]
            ratio = p["pdplug_over_raw"]  # median of the rounds' paired run ratios
            overhead.setdefault(b, {})[f"{size / MIB:g}"] = 1.0 - ratio
            fr = p["pdplug_over_fresh"]
            if fr is not None:
                over_fresh.setdefault(b, {})[f"{size / MIB:g}"] = 1.0 - fr
            fl = p["floor_over_raw"]
            if fl is not None:
                floor.setdefault(b, {})[f"{size / MIB:g}"] = 1.0 - fl
            pf = p["pdplug_over_floor"]
            if pf is not None:
                over_floor.setdefault(b, {})[f"{size / MIB:g}"] = 1.0 - pf
            t.add_row(
                b,
                f"{size / MIB:g} MiB",
                str(p["runs"]),
                str(p["repeats"]),
                f"{p['gbps']:.2f}",
                f"{g['raw']['gbps']:.2f}",
                f"{g['raw_fresh']['gbps']:.2f}" if "raw_fresh" in g else "-",
                f"{g['python_floor']['gbps']:.2f}" if "python_floor" in g else "-",
                f"{g['memcpy']['gbps']:.2f}",
            )
            t2.add_row(
                b,
                f"{size / MIB:g} MiB",
                f"{ratio:.3f}",
                f"{p['ratio_q1']:.3f}-{p['ratio_q3']:.3f}",
                f"{1.0 - ratio:+.1%}",
                "-" if fr is None else f"{1.0 - fr:+.1%}",
                "-" if fl is None else f"{1.0 - fl:+.1%}",
                f"{p['plan_ms']:.2f}",
                "-" if p["hop_ms"] is None else f"{p['hop_ms']:.3f}",
                "-" if p["hop_ms"] is None else f"{p['hop_ms'] / p['raw_ms']:.1%}",
            )
    console.print(t)
    console.print(t2)
    # the verdicts read the last run's tables; the run-to-run table below reads every run
    last = f"; the last of {runs} runs, run to run below" if runs > 1 else ""
    for b, per in overhead.items():
        over = [f"{k} MiB" for k, v in per.items() if v > 0.05]
        verdict = f"above it at {', '.join(over)}" if over else "met at every size"
        below = [f"{k} MiB" for k, v in per.items() if v < 0]
        if below:  # pdplug cannot be faster than the same engine call made bare
            verdict += f"; below 0 at {', '.join(below)}: the pairs' noise, not a gain"
        console.print(
            f"{b}: overhead = 1 - median(t_raw / t_pdplug) over paired runs: "
            + ", ".join(f"{k} MiB {v:+.2%}" for k, v in per.items())
            + f" (goal <= 5% at every size: {verdict}{last})"
        )
    for b, per in floor.items():
        own = over_floor.get(b, {})
        console.print(
            f"{b}: floor = 1 - median(t_raw / t_py_floor): the least any Python send adds on "
            "the same prepared lists, with nothing of a session (page ids copied and checked, "
            "the request's indices computed, make_prepped_xfer + transfer polled, the status "
            "published under a lock), run in the same rounds: "
            + ", ".join(f"{k} MiB {v:+.1%}" for k, v in per.items())
            + "; pdplug over the floor, paired (1 - median(t_py_floor / t_pdplug)): "
            + ", ".join(f"{k} MiB {v:+.1%}" for k, v in own.items())
            + " = the session's own work (medians of ratios: they do not subtract exactly; "
            "one run's floor moves by several points, so read it over several runs)"
        )  # fmt: skip
    for b, per in over_fresh.items():
        console.print(
            f"{b}: vs fresh = 1 - median(t_raw_fresh / t_pdplug): the raw engine with a request "
            "made per send on descriptor lists prepared once (make_prepped_xfer + transfer, the "
            "way a connector posts new page ids), not one handle re-posted: "
            + ", ".join(f"{k} MiB {v:+.1%}" for k, v in per.items())
            + "; overhead minus vs fresh is roughly the engine's own per-request cost (medians "
            "of ratios do not subtract exactly)"
        )
    console.print(
        "hop ms: an empty round trip host -> sender's engine thread -> host right after a raw "
        "transfer of the size (median; KVSenderSession.ping): the two thread hand-offs a send "
        "pays when the engine thread must post it (a send the host thread posts itself, the "
        "usual lane, skips them); hop/raw: that cost as a share of the raw time"
    )
    fixed: dict[str, dict[str, float]] = {}
    floor_us: dict[str, dict[str, float]] = {}
    if small_rows:
        ft = Table(title="fixed cost per send (us; median of paired differences send() -> "
                   "poll() Success minus raw post -> completion)")  # fmt: skip
        for col in ("backend", "size", "K per step", "pairs", "pdplug us", "raw us",
                    "fixed us / send", "IQR", "vs fresh us", "floor us"):  # fmt: skip
            ft.add_column(col, justify="right")
        for sr in small_rows:
            if sr["k"] == 1:
                key = f"{sr['bytes'] / MIB:g}"
                fixed.setdefault(sr["backend"], {})[key] = sr["fixed_us"]
                if sr["floor_us"] is not None:
                    floor_us.setdefault(sr["backend"], {})[key] = sr["floor_us"]
            ft.add_row(
                sr["backend"], f"{sr['bytes'] / MIB:g} MiB", str(sr["k"]), str(sr["pairs"]),
                f"{sr['pdplug_us']:.1f}", f"{sr['raw_us']:.1f}", f"{sr['fixed_us']:.1f}",
                f"{sr['q1_us']:.1f} to {sr['q3_us']:.1f}",
                "-" if sr["fixed_vs_fresh_us"] is None else f"{sr['fixed_vs_fresh_us']:.1f}",
                "-" if sr["floor_us"] is None else f"{sr['floor_us']:.1f}",
            )  # fmt: skip
        console.print(ft)
        spread = {(r["backend"], f"{r['bytes'] / MIB:g}"): (r["q1_us"], r["q3_us"])
                  for r in small_rows if r["k"] == 1}  # fmt: skip
        for b, per in fixed.items():
            below = [_label(k) for k, v in per.items() if float(k) <= 1 and v > 100]
            # a median whose pairs spread over more than the goal itself says little alone
            wide = [_label(k) for k in per if float(k) <= 1
                    and spread[b, k][1] - spread[b, k][0] > 100]  # fmt: skip
            verdict = f"above it at {', '.join(below)}" if below else "met"
            if wide:
                verdict += f"; pairs spread over more than 100 us at {', '.join(wide)}: rerun"
            floor_above = [_label(k) for k, v in floor_us.get(b, {}).items()
                           if float(k) <= 1 and v > 100]  # fmt: skip
            if floor_above:
                verdict += (f"; the Python floor itself is above it at {', '.join(floor_above)} "
                            "in this run")  # fmt: skip
            console.print(
                f"{b}: fixed cost per send (K = 1): "
                + ", ".join(
                    f"{_label(k)} {v:.1f} us (IQR {spread[b, k][0]:.0f} to {spread[b, k][1]:.0f})"
                    for k, v in per.items()
                )
                + f" (goal <= 100 us at 64 KiB and 1 MiB: {verdict}{last}); K rows: the cost of "
                "one send when a step posts K (send_many when the sender has it)"
            )
        if any(r["fixed_vs_fresh_us"] is not None for r in small_rows):
            console.print(
                "vs fresh us: pdplug minus the raw engine making a request per send on lists "
                "prepared once (not one handle re-posted): pdplug's own share of the fixed cost; "
                "floor us: the Python floor (as in the floor line above) minus raw"
            )
        if any(r["fixed_vs_fresh_us"] is None and r["k"] == 1 for r in small_rows):
            console.print(
                "vs fresh us, floor us '-': K > 1 rows, and backends whose raw engine has no "
                "request to make per send (Mooncake takes a write's addresses in the call "
                "itself): no fresh-request or Python-floor mode runs there"
            )
    run_spread = _print_spread(console, per_run) if runs > 1 else []
    console.print(
        f"bytes: {'all checked rounds identical' if not failures else 'MISMATCH'} (pdplug, raw, "
        "raw fresh-request and python floor where run, and memcpy; warm-up and final round per "
        "size, destination poisoned first)"
    )
    if json_path:
        write_json(
            json_path,
            {
                "rows": [{k: r[k] for k in ("backend", "bytes", "mode", "gbps")} for r in rows],
                "pairs": [{k: r[k] for k in _PAIR_KEYS} for r in rows if r["mode"] == "pdplug"],
                "overhead": overhead,
                "overhead_vs_fresh_request": over_fresh,
                "overhead_python_floor": floor,
                "overhead_vs_python_floor": over_floor,
                "fixed_cost_us": fixed,
                "fixed_cost_python_floor_us": floor_us,
                "small_sends": small_rows,
                "runs": per_run,
                "run_spread": run_spread,
                "byte_failures": failures,
                "backend_errors": errors,
                "layout": {"entries_bytes_per_token": list(BPT), "page_size": PAGE},
            },
        )
    if failures:
        raise click.ClickException("byte check failed: " + "; ".join(failures[:4]))
    if errors:
        raise click.ClickException(_not_run(errors))
