"""A chunk's tokens: validation, which tokens a DCP rank owns, and where they lie on the source.

Chunk token ``k`` (``0 <= k < num_tokens``) is request token ``decode_prefix_len + rel0 + k``.
On the source it sits in ``src_pages[(s0 + k) // Ps]`` at in-page offset ``(s0 + k) % Ps`` with
``s0 = (decode_prefix_len + rel0) % Ps`` (prefill pages hold a request from token 0). Decode
DCP rank ``r`` of ``D`` owns ``rel0 + k ≡ r (mod D)`` and stores it at local offset
``(rel0 + k) // D``: in ``dst_pages[local // Pd]`` at ``local % Pd`` (SGLang
``build_dcp_token_transfer_plan``, PRs #35762 / #40376). Draft entries hold every token at
local ``rel0 + k`` in virtual pages of ``Pd * D`` tokens.
"""

from __future__ import annotations

import msgspec
import numpy as np

from pdplug import PlanError
from pdplug.packing import page_array
from pdplug.types import SendChunk
from pdplug_dcp.pairs import Pair

__all__ = ["ChunkState", "chunk_state", "src_offsets", "token_runs"]


class ChunkState(msgspec.Struct, frozen=True):
    """A validated chunk: int64 page arrays, ``rel0``, ``s0`` and token count ``nt``."""

    chunk: SendChunk
    src_pages: np.ndarray
    dst_pages: np.ndarray
    rel0: int
    s0: int
    nt: int


def chunk_state(chunk: SendChunk, pair: Pair) -> ChunkState:
    """Validate ``chunk`` against ``pair``.

    :raises PlanError: unaligned ``decode_prefix_len``, negative offsets or counts, a
        negative page id or one >= 2**40, too few source or destination pages (each names
        room, field and value).
    """
    ps, pd, d = pair.src_page, pair.dst_page, pair.dcp
    vp = pd * d
    prefix = chunk.decode_prefix_len
    if prefix < 0 or prefix % vp:
        raise PlanError(
            f"room {chunk.room}: decode_prefix_len={prefix} is not a multiple of the decode "
            f"virtual page page_size*dcp_size={pd}*{d}={vp} tokens"
        )
    if chunk.src_page_offset < 0 or chunk.num_tokens < 0 or chunk.rel_start < -1:
        raise PlanError(
            f"room {chunk.room}: src_page_offset={chunk.src_page_offset}, num_tokens="
            f"{chunk.num_tokens} and rel_start={chunk.rel_start} must be >= 0 (rel_start: -1)"
        )
    rel0 = chunk.rel_start if chunk.rel_start >= 0 else chunk.src_page_offset * ps
    s0 = (prefix + rel0) % ps
    src_pages = page_array(chunk.src_pages, "src_pages", chunk.room)
    dst_pages = page_array(chunk.dst_pages, "dst_pages", chunk.room)
    n = chunk.num_tokens
    if n and src_pages.shape[0] * ps < s0 + n:
        raise PlanError(
            f"room {chunk.room}: num_tokens={n} from in-page offset {s0} needs "
            f"{-(-(s0 + n) // ps)} source pages (page_size={ps}), src_pages has "
            f"{src_pages.shape[0]}"
        )
    end = rel0 + n
    need = -(-end // vp)
    if n and dst_pages.shape[0] < need:
        raise PlanError(
            f"room {chunk.room}: too few destination pages: tokens up to {end} after "
            f"decode_prefix_len={prefix} need {need} virtual pages of {vp} tokens, dst_pages "
            f"has {dst_pages.shape[0]}"
        )
    return ChunkState(chunk, src_pages, dst_pages, rel0, s0, n)


_INPAGE: dict[tuple[int, int, int, int, int], np.ndarray] = {}


def _inpage(ps: int, step: int, first: int, scale: int, pages: int) -> np.ndarray:
    """Read-only int64 ``[pages * ps // step]``: ``(first + step * i) * scale`` for ``i <
    ps // step``, repeated for ``pages`` pages (cached; sends repeat a few shapes)."""
    key = (ps, step, first, scale, pages)
    out = _INPAGE.get(key)
    if out is None:
        out = np.tile((first + step * np.arange(ps // step, dtype=np.int64)) * scale, pages)
        out.flags.writeable = False
        if len(_INPAGE) >= 256:
            _INPAGE.clear()
        _INPAGE[key] = out
    return out


def src_offsets(
    st: ChunkState, ps: int, first: int, step: int, n: int, page_mul: int, tok_mul: int
) -> np.ndarray:
    """Source offsets of chunk tokens ``first + step * j`` (``j < n``): int64 ``[n]`` =
    ``src_page * page_mul + in-page offset * tok_mul`` (bytes, or units of a divisor)."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if st.s0 == 0 and ps % step == 0 and first < step:
        # every page holds the same in-page offsets: page bases repeated (long loops, no
        # short broadcast rows) plus one cached row of in-page offsets
        per = ps // step
        npg = -(-n // per)
        out = np.multiply(st.src_pages[:npg], page_mul).repeat(per)
        if npg * per != n:
            out = out[:n]
        out += _inpage(ps, step, first, tok_mul, npg)[:n]
        return out
    k = st.s0 + first + step * np.arange(n, dtype=np.int64)
    pg = k // ps
    k -= pg * ps
    k *= tok_mul
    return st.src_pages[pg] * page_mul + k


def token_runs(
    st: ChunkState, ps: int, page: int, l_start: int, first: int = 0, step: int = 1, n: int = -1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of tokens consecutive on both sides inside one source and one destination page.

    Tokens are chunk tokens ``first + step * j`` stored at local ``l_start + j`` in pages of
    ``page`` tokens (``n`` of them; -1: all from ``first`` with ``step == 1``).

    :returns: int64 ``(chunk token of each run start, local offset of each run start, run
        length)``; runs of one token when ``step > 1``.
    """
    if n < 0:
        n = st.nt - first
    if n <= 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    if step > 1:
        j = np.arange(n, dtype=np.int64)
        return first + step * j, l_start + j, np.ones(n, dtype=np.int64)
    a = st.s0 + first  # source in-page position of token 0
    s_brk = np.arange((-a) % ps or ps, n, ps, dtype=np.int64)
    d_brk = np.arange((-l_start) % page or page, n, page, dtype=np.int64)
    starts = np.union1d(s_brk, d_brk)
    starts = np.concatenate(([0], starts)).astype(np.int64)
    lens = np.diff(np.concatenate((starts, [n])))
    return first + starts, l_start + starts, lens
