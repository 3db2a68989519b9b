"""The leader's decision rule and every rank's exactly-once check (pure; no sockets, no threads).

* :class:`Tally` — the leader's decision rule (PP0 in both implementations): ``good`` = voted
  ready by every rank and failed nowhere; ``bad`` = failed or aborted on any rank, or not
  voted by some rank within ``vote_deadline_s`` of the first vote. Each decision is numbered
  gap-free per stream and every request id is decided at most once per stream. This is the
  ``PPBootstrapDecision(sequence, good, bad)`` idea of SGLang PR #34569 (frozen on PP0, relayed
  unchanged, applied exactly once, aborts sequenced against decisions), generalised to every
  stream.
* :class:`Applier` — every rank's check that decisions arrive in ``seq`` order with no gap or
  duplicate and never decide a request id twice (a violation raises
  :class:`pdplug.ConsensusError`; divergence is never silent, cf. SGLang #30476/#31030).

Request ids are Python ints; loops here run over request ids of one decision, never over
tokens or pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdplug import ConsensusError
from pdplug.types import Decision

__all__ = ["Applier", "Recent", "Tally"]


class Recent:
    """Insertion-ordered set of request ids, each forgotten ``horizon_s`` after it was added.

    Callers pass a non-decreasing monotonic ``now`` (seconds).
    """

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._t: dict[int, float] = {}

    def add(self, rid: int, now: float) -> None:
        if rid not in self._t:
            self._t[rid] = now

    def __contains__(self, rid: object) -> bool:
        return rid in self._t

    def __len__(self) -> int:
        return len(self._t)

    def prune(self, now: float) -> None:
        """Forget ids older than the horizon (oldest first: O(number forgotten))."""
        cut = now - self.horizon_s
        t = self._t
        while t:
            rid = next(iter(t))
            if t[rid] >= cut:
                break
            del t[rid]


class _StreamTally:
    __slots__ = ("bad", "decided", "good", "pending", "seq")

    def __init__(self, horizon: float) -> None:
        self.seq = 0
        # rid -> [first heard (s), bitmask of ranks that voted good]; insertion = time order
        self.pending: dict[int, list] = {}
        self.good: dict[int, None] = {}  # ordered: admission order = completion order
        self.bad: dict[int, None] = {}
        self.decided = Recent(horizon)


class Tally:
    """The leader's decision rule over the votes of ``pp_size`` ranks.

    :param pp_size: number of voting ranks (ranks ``0..pp_size-1``).
    :param streams: stream names; each gets its own gap-free ``seq`` starting at 0.
    :param vote_deadline_s: an id pending this long after its first vote is decided ``bad``.
    :param horizon_s: how long decided and aborted ids are remembered.

    Counters: ``deadline_bad``, ``abort_bad``, ``late_votes``, ``decisions``.
    """

    def __init__(
        self,
        pp_size: int,
        streams: Sequence[str],
        vote_deadline_s: float,
        horizon_s: float,
    ) -> None:
        self.full = (1 << pp_size) - 1
        self.vote_deadline_s = vote_deadline_s
        self._s = {name: _StreamTally(horizon_s) for name in streams}
        self.aborted = Recent(horizon_s)
        self.counters = {"deadline_bad": 0, "abort_bad": 0, "late_votes": 0, "decisions": 0}
        self._next_prune = 0.0

    def has_stream(self, stream: str) -> bool:
        return stream in self._s

    def _bad(self, st: _StreamTally, rid: int, now: float) -> None:
        if rid in st.decided:
            self.counters["late_votes"] += 1
            return
        st.bad[rid] = None
        st.good.pop(rid, None)
        st.pending.setdefault(rid, [now, 0])

    def _good(self, st: _StreamTally, rid: int, bits: int, now: float) -> None:
        if rid in st.decided:
            self.counters["late_votes"] += 1
            return
        if rid in st.bad:
            return
        if rid in self.aborted:
            self.counters["abort_bad"] += 1
            self._bad(st, rid, now)
            return
        ent = st.pending.get(rid)
        if ent is None:
            ent = st.pending[rid] = [now, 0]
        ent[1] |= bits
        if ent[1] == self.full:
            st.good[rid] = None

    def vote(
        self, stream: str, rank: int, good: Iterable[int], bad: Iterable[int], now: float
    ) -> None:
        """Record ``rank``'s vote (``bad`` wins over ``good``).

        :raises KeyError: unknown ``stream`` (callers drop such frames first).
        """
        st = self._s[stream]
        for rid in bad:
            self._bad(st, rid, now)
        bit = 1 << rank
        for rid in good:
            self._good(st, rid, bit, now)

    def complete(self, stream: str, good: Iterable[int], now: float) -> None:
        """Ring: ``good`` is ready on every rank (the intersection came back to PP0)."""
        st = self._s[stream]
        for rid in good:
            self._good(st, rid, self.full, now)

    def see(self, stream: str, rids: Iterable[int], now: float) -> None:
        """Ring: start the vote deadline of ``rids`` (first offered on some rank)."""
        st = self._s[stream]
        for rid in rids:
            if rid in st.decided or rid in st.pending:
                continue
            if rid in self.aborted:
                self.counters["abort_bad"] += 1
                self._bad(st, rid, now)
            else:
                st.pending[rid] = [now, 0]

    def abort(self, rids: Iterable[int], now: float) -> None:
        """Abort ``rids``: ``bad`` in every stream where pending now, and on any later vote."""
        for rid in rids:
            self.aborted.add(rid, now)
            for st in self._s.values():
                if rid in st.pending and rid not in st.bad:
                    self.counters["abort_bad"] += 1
                    self._bad(st, rid, now)

    def decide(self, now: float) -> list[Decision]:
        """Freeze what is decidable now: at most one :class:`Decision` per stream."""
        out: list[Decision] = []
        cut = now - self.vote_deadline_s
        for name, st in self._s.items():
            for rid, ent in st.pending.items():  # oldest first
                if ent[0] > cut:
                    break
                if rid not in st.good and rid not in st.bad:
                    st.bad[rid] = None
                    self.counters["deadline_bad"] += 1
            if not st.good and not st.bad:
                continue
            good, bad = tuple(st.good), tuple(st.bad)
            out.append(Decision(stream=name, seq=st.seq, good=good, bad=bad))
            st.seq += 1
            self.counters["decisions"] += 1
            for rid in good + bad:
                st.pending.pop(rid, None)
                st.decided.add(rid, now)
            st.good.clear()
            st.bad.clear()
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            self.aborted.prune(now)
            for st in self._s.values():
                st.decided.prune(now)
        return out

    def pending(self, stream: str) -> int:
        """Undecided request ids of ``stream`` known to the leader."""
        return len(self._s[stream].pending)


class Applier:
    """Checks and records decisions on one rank: gap-free ``seq``, each id decided once.

    :param streams: stream names (each starts at ``seq`` 0).
    :param horizon_s: how long decided ids are remembered for the exactly-once check.
    """

    def __init__(self, streams: Sequence[str], horizon_s: float) -> None:
        self.next_seq = {s: 0 for s in streams}
        self.decided = {s: Recent(horizon_s) for s in streams}
        self.applied = 0
        self._next_prune = 0.0

    def apply(self, d: Decision, now: float) -> None:
        """Validate and record ``d``.

        :raises ConsensusError: unknown stream, a ``seq`` gap or duplicate, an id both good
            and bad, an id repeated, or an id this stream already decided.
        """
        want = self.next_seq.get(d.stream)
        if want is None:
            raise ConsensusError(
                f"decision stream={d.stream!r} is not one of {tuple(self.next_seq)}"
            )
        if d.seq != want:
            kind = "duplicate" if d.seq < want else "gap"
            raise ConsensusError(
                f"decision sequence {kind} on stream={d.stream!r}: got seq={d.seq}, "
                f"expected seq={want}"
            )
        ids = d.good + d.bad
        if len(set(ids)) != len(ids):
            both = sorted(set(d.good) & set(d.bad))
            raise ConsensusError(
                f"decision stream={d.stream!r} seq={d.seq} repeats request ids"
                + (f" (good and bad: {both[:8]})" if both else "")
            )
        seen = self.decided[d.stream]
        again = [r for r in ids if r in seen]
        if again:
            raise ConsensusError(
                f"decision stream={d.stream!r} seq={d.seq} decides request ids already "
                f"decided: {again[:8]}"
            )
        for r in ids:
            seen.add(r, now)
        self.next_seq[d.stream] = want + 1
        self.applied += 1
        if now >= self._next_prune:
            self._next_prune = now + 1.0
            for rec in self.decided.values():
                rec.prune(now)
