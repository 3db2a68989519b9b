"""Trace loader: bundled sample, scaling, validation errors, deterministic block tokens, chains."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplug_host.trace import (
    TraceFormatError,
    TraceRequest,
    block_hash_chain,
    load_trace,
    parse_trace_lines,
    prompt_tokens,
)


def _line(**kw: object) -> str:
    rec = {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2]}
    rec.update(kw)
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


def test_bundled_sample_loads_64_requests() -> None:
    reqs = load_trace()
    assert len(reqs) == 64
    assert [r.rid for r in reqs] == list(range(64))
    r0 = reqs[0]
    # First line: {"timestamp": 0, "input_length": 6758, "output_length": 500, hash_ids 0..13}
    assert (r0.raw_input_length, r0.raw_output_length) == (6758, 500)
    assert r0.input_len == math.ceil(6758 / 32) == 212
    assert r0.output_len == 16 and r0.block_tokens == 16
    assert r0.hash_ids == tuple(range(14)) and r0.num_full_blocks == 13
    assert all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(reqs))
    assert len(load_trace(limit=5)) == 5


def test_bundled_sample_matches_shared_trace_head() -> None:
    full = Path("/work/shared/traces/conversation_trace.jsonl")
    if not full.exists():
        pytest.skip("shared trace not present")
    assert load_trace(full, limit=64) == load_trace()


def test_scale_and_max_output() -> None:
    (r,) = parse_trace_lines([_line(input_length=1000, output_length=3)], scale=64, max_output=8)
    assert (r.input_len, r.output_len, r.block_tokens) == (16, 3, 8)
    (r,) = parse_trace_lines([_line(input_length=5, hash_ids=[4])], scale=32)
    assert r.input_len == 1  # ceil, at least 1
    with pytest.raises(ValueError, match="divisor of 512"):
        parse_trace_lines([], scale=3)
    with pytest.raises(ValueError, match="max_output"):
        parse_trace_lines([], max_output=0)


@pytest.mark.parametrize(
    "line,expect",
    [
        (_line(input_length="x"), "field 'input_length' = 'x'"),
        (_line(output_length=0), "field 'output_length' = 0"),
        (_line(timestamp=-5), "field 'timestamp' = -5"),
        (_line(hash_ids=[1, -2]), "field 'hash_ids[1]' = -2"),
        (_line(hash_ids="ab"), "field 'hash_ids' = 'ab'"),
        (_line(hash_ids=...), "field 'hash_ids' is missing"),
        (_line(hash_ids=[1, 2, 3]), "field 'hash_ids' has 3 ids, expected"),
        ("{not json", "invalid JSON"),
        ("[1, 2]", "Expected `object`"),
    ],
)
def test_parse_errors_name_line_field_value(tmp_path: Path, line: str, expect: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line() + "\n\n" + line + "\n")  # blank line still counts: error on line 3
    with pytest.raises(TraceFormatError) as exc:
        load_trace(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:3: "), msg
    assert expect in msg, msg


def test_equal_hash_ids_give_equal_tokens() -> None:
    reqs = load_trace(limit=3)
    a, b = prompt_tokens(reqs[0]), prompt_tokens(reqs[1])
    assert reqs[0].hash_ids[0] == reqs[1].hash_ids[0] and reqs[0].hash_ids[1] != reqs[1].hash_ids[1]
    assert np.array_equal(a[:16], b[:16]) and not np.array_equal(a[16:32], b[16:32])
    assert a.dtype == np.int64 and len(a) == reqs[0].input_len
    assert a.min() >= 0 and a.max() < 4096
    # Partial last block = first tokens of the same block in full.
    (full,) = parse_trace_lines([_line(input_length=1024, hash_ids=[7, 9])])
    (part,) = parse_trace_lines([_line(input_length=600, hash_ids=[7, 9])])
    assert part.input_len == 19
    assert np.array_equal(prompt_tokens(part), prompt_tokens(full)[:19])
    assert np.array_equal(prompt_tokens(full, seed=0), prompt_tokens(full, seed=0))
    assert not np.array_equal(prompt_tokens(full, seed=1), prompt_tokens(full, seed=0))
    assert prompt_tokens(full, vocab=10).max() < 10
    with pytest.raises(ValueError, match="hash ids for 2 blocks"):
        prompt_tokens(msgspec.structs.replace(full, hash_ids=(7,)))


def test_block_hash_chain() -> None:
    (a,) = parse_trace_lines([_line(input_length=2048, hash_ids=[1, 2, 3, 4])])
    (b,) = parse_trace_lines([_line(input_length=2000, hash_ids=[1, 2, 5, 4])])
    ca, cb = block_hash_chain(a), block_hash_chain(b)
    assert len(ca) == 4 * 512 // 32 // 16 and len(cb) == 3  # b's last block is partial
    assert ca[:2] == cb[:2]
    assert ca[2] != cb[2]
    assert len(set(ca)) == 4
    assert all(0 <= h < 2**63 for h in ca + cb)
    assert block_hash_chain(a) == ca  # stable


def test_trace_request_is_frozen_struct() -> None:
    (r,) = parse_trace_lines([_line()])
    assert msgspec.json.decode(msgspec.json.encode(r), type=TraceRequest) == r
    with pytest.raises(AttributeError):
        r.input_len = 3  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 200_000),
    st.integers(1, 5000),
    st.sampled_from([1, 8, 32, 64, 512]),
    st.integers(1, 64),
)
def test_scaled_lengths_property(inp: int, out: int, scale: int, max_out: int) -> None:
    ids = list(range(math.ceil(inp / 512)))
    (r,) = parse_trace_lines(
        [_line(input_length=inp, output_length=out, hash_ids=ids)],
        scale=scale,
        max_output=max_out,
    )
    assert r.input_len == max(1, math.ceil(inp / scale))
    assert r.output_len == min(out, max_out)
    assert math.ceil(r.input_len / r.block_tokens) == len(ids)  # every token has its block
    assert len(block_hash_chain(r)) == r.input_len // r.block_tokens
    if r.input_len <= 4096:
        assert len(prompt_tokens(r)) == r.input_len
