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
    CHARS_PER_TOKEN,
    EXPECTED,
    TraceFormatError,
    TraceRequest,
    block_hash_chain,
    load_trace,
    parse_trace_lines,
    parse_trace_text,
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


#: the project's shared traces lie beside the checkout (CI clones next to a copy of them)
SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def test_bundled_sample_matches_shared_trace_head() -> None:
    full = SHARED_TRACES / "conversation_trace.jsonl"
    if not full.exists():
        pytest.skip(f"no shared traces beside this checkout ({SHARED_TRACES})")
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
        ("7", "Expected `object` (one trace record), got int"),
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


def test_a_json_array_of_records_equals_the_same_json_lines(tmp_path: Path) -> None:
    lines = [_line(timestamp=t, hash_ids=[t, t + 1]) for t in range(3)]
    arr = tmp_path / "t.json"
    arr.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    assert load_trace(arr) == parse_trace_lines(lines)
    assert len(load_trace(arr, limit=2)) == 2


def _conv(*turns: str) -> dict[str, object]:
    who = ("human", "gpt")
    return {
        "id": "x",
        "conversations": [{"from": who[i % 2], "value": v} for i, v in enumerate(turns)],
    }


def test_sharegpt_conversations_become_requests(tmp_path: Path) -> None:
    system = "s" * 4096  # two 512-token blocks at 4 characters per token
    convs = [
        _conv(system + "first question", "an answer of 40 chars".ljust(40)),
        _conv("only one turn"),  # no answer: skipped
        _conv(system + "second question, longer", "x" * 9, "a later turn"),
        _conv("", "answer to nothing"),  # empty prompt: skipped
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs, indent=2))  # pretty-printed, as ShareGPT files are
    a, b = load_trace(path, scale=1, max_output=64)
    assert (a.rid, b.rid) == (0, 1)
    assert a.raw_input_length == math.ceil((4096 + 14) / CHARS_PER_TOKEN) == 1028
    assert (a.raw_output_length, b.raw_output_length) == (10, 3)  # ceil(chars / 4)
    assert a.arrival_ms == b.arrival_ms == 0.0
    assert len(a.hash_ids) == math.ceil(a.raw_input_length / 512) == 3
    assert a.hash_ids[:2] == b.hash_ids[:2] and a.hash_ids[2] != b.hash_ids[2]  # shared prefix
    assert block_hash_chain(a)[:2] == block_hash_chain(b)[:2]
    assert np.array_equal(prompt_tokens(a)[:1024], prompt_tokens(b)[:1024])
    # the same records as JSON lines
    jsonl = tmp_path / "sharegpt.jsonl"
    jsonl.write_text("\n".join(json.dumps(c) for c in convs))
    assert load_trace(jsonl, scale=1, max_output=64) == [a, b]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\xff\xfe{}", "t.json: not UTF-8 text (byte 0xff at offset 0)"),
        (b'[{"timestamp": 0', "t.json: invalid JSON array"),
        (b'{\n  "data": []\n}', "t.json:1: invalid JSON"),
        (b'[{"conversations": [1, 2]}]', "t.json: record 1: field 'conversations' must be"),
    ],
)
def test_other_files_are_refused_with_the_expected_format(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError) as exc:
        load_trace(path)
    assert needle in str(exc.value)
    assert str(exc.value).endswith(EXPECTED)


def test_parse_trace_text_reads_both_layouts() -> None:
    one = _line(hash_ids=[5, 6])
    assert parse_trace_text(one) == parse_trace_text(f"[{one}]") == parse_trace_lines([one])
