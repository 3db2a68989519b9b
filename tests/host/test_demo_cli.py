"""``pdplug demo`` refuses bad input in seconds with one clear line (no traceback, no hang)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplug.cli import main

pytestmark = pytest.mark.timeout(60)


def _demo(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["demo", *args], env=env)
    assert "Traceback" not in res.output, res.output
    return res.exit_code, res.output


@pytest.mark.parametrize(
    "args",
    [
        ("--prefill-pp", "0"),
        ("--decode-dcp", "0"),
        ("--requests", "0"),
        ("--requests", "-3"),
        ("--scale", "0"),
        ("--max-output", "0"),
        ("--chunk-size", "0"),
        ("--timeout", "0"),
    ],
)
def test_out_of_range_sizes_are_usage_errors(args: tuple[str, str]) -> None:
    code, out = _demo(*args)
    assert code == 2
    assert args[0] in out


def test_unknown_component_lists_the_alternatives() -> None:
    code, out = _demo("--kv-sender", "nope")
    assert code == 1
    assert "no kv_sender named 'nope'" in out
    assert "mooncake" in out and "nixl" in out


def test_blocked_default_is_named_as_blocked() -> None:
    code, out = _demo(env={"PDPLUG_DISABLE_PLUGINS": "pdplug-nixl"})
    assert code == 1
    assert "no kv_sender named 'nixl'" in out
    assert "Blocked plugins" in out and "pdplug-nixl" in out


def test_identity_planner_with_a_dcp_decode_is_refused_before_start() -> None:
    code, out = _demo("--pack-planner", "tp", "--decode-dcp", "2")
    assert code == 1
    assert "'tp' planner needs destination dcp_size 1, got 2" in out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"not json\n", "1: invalid JSON"),
        (b'{"timestamp": 0, "input_length": 5, "output_length": 2}\n', "hash_ids"),
        (b"\xff\xfe\n", "cannot load the trace"),
        (b"", "has no requests"),
    ],
)
def test_bad_trace_files_name_the_problem(tmp_path: Path, content: bytes, needle: str) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(content)
    code, out = _demo("--trace", str(trace))
    assert code == 1
    assert needle in out


def test_scale_that_breaks_page_alignment_is_refused() -> None:
    code, out = _demo("--scale", "64")
    assert code == 1
    assert "--scale 64" in out and "16-token page" in out
