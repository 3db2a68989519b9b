"""Every supported prefill -> decode layout mapping, byte by byte (hypothesis).

Layouts {NHD, HND fused K|V, HND split K/V, MLA latent} x TP {1:1, 1:2, 2:1, 4:2 with 2 heads,
2:4 with 2 heads} x page ratio {1, 2, 1/2} x DCP {1, 2, 4}: every prefill TP rank sends a
cached-prefix request (decode_prefix_len > 0 sometimes, partial last pages) to every decode
rank the way a KV sender does (scheduler split at the pack capacity, plan per segment and rank,
torch packer over strided views of each rank's storage, runs written into decode memory); the
decode memory must equal a per-token-per-head reference byte for byte, every byte the
reference writes written exactly once, every other byte still poison. The Triton packer runs
a subset of these sends under TRITON_INTERPRET=1 (``test_dcp_packers``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _layoutsim import DCPS, KINDS, POISON, RATIOS, TPS, build, expected, fill_source, simulate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

COMBOS = list(itertools.product(KINDS, TPS, RATIOS, DCPS))


def _send_all(data, kind, tps, ratio, dcp) -> dict[str, int]:
    """Draw one scenario, send it to every decode rank, compare every byte."""
    ptp, dtp, heads = tps
    pd = data.draw(st.sampled_from([2, 4]), label="decode_page")
    ps = int(pd * ratio)
    vd = pd * dcp
    prefix = data.draw(st.integers(0, 2), label="prefix_vpages") * vd
    total = data.draw(st.integers(0, 5 * vd + 3), label="send_tokens")
    chunk = data.draw(st.integers(1, 24), label="chunk_size")
    region_pages = data.draw(st.integers(1, 3), label="region_pages")
    layers = data.draw(st.integers(1, 2), label="layers")
    hb = data.draw(st.sampled_from([2, 4, 6, 8, 12]), label="head_bytes")
    interleave = data.draw(st.booleans(), label="interleaved_storage")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    ntok = prefix + total
    pages = -(-ntok // ps) + -(-total // vd) + 4
    req = rng.permutation(pages)[: -(-ntok // ps)]
    dpages = rng.permutation(pages)[: -(-total // vd)]
    e = layers * (2 if kind == "hnd_split" else 1)
    kv = rng.integers(0, 256, (e, heads, max(ntok, 1), hb), dtype=np.uint8)
    srcs = [build(kind, ps, ptp, r, heads, layers, hb, pages, interleave=interleave)
            for r in range(ptp)]  # fmt: skip
    for src in srcs:
        fill_source(src, kv, req, ntok, rng)
    totals = {"plans": 0, "runs": 0, "packed": 0}
    for d in range(dtp):
        for r in range(dcp):
            dst = build(kind, pd, dtp, d, heads, layers, hb, pages, dcp=dcp, dcp_rank=r,
                        interleave=interleave)  # fmt: skip
            dst.mem[:] = POISON
            want, written = expected(dst, kv, dpages, prefix, total)
            stats = simulate(srcs, dst, req, dpages, prefix, total, chunk, region_pages)
            bad = np.flatnonzero(dst.mem != want)
            assert bad.size == 0, (
                f"decode tp {d} dcp {r}: {bad.size} bytes differ from the reference, first at "
                f"{bad[0]} ({stats})"
            )
            assert (dst.count[written] == 1).all(), "a byte was written twice (or never)"
            assert (dst.count[~written] == 0).all(), "a byte outside the tokens was written"
            # each decode head comes from exactly one prefill rank: as many sources as
            # prefill ranks its heads span (one for an MLA latent or replicated heads)
            h = 1 if kind == "mla" else heads
            assert stats["sources"] == max(1, max(1, h // dtp) // max(1, h // ptp))
            for k in totals:
                totals[k] += stats[k]
    return totals


@pytest.mark.parametrize(
    ("kind", "tps", "ratio", "dcp"),
    COMBOS,
    ids=[f"{k}-{t[0]}:{t[1]}-r{r}-d{d}" for k, t, r, d in COMBOS],
)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_layout_mapping_is_byte_exact(data, kind, tps, ratio, dcp) -> None:
    """Each of the 180 combinations, two random scenarios each."""
    _send_all(data, kind, tps, ratio, dcp)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(combo=st.sampled_from(COMBOS), data=st.data())
def test_layout_mappings_random_sweep(combo, data) -> None:
    """A deeper random sweep over the same space (more scenarios per combination)."""
    _send_all(data, *combo)
