"""``pdplug bench`` answers ordinary mistakes with one line and a non-zero exit, before it
spawns a rank, opens an engine or allocates a buffer (never a traceback)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from click.testing import CliRunner

from pdplug.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("consensus", "--impl", "nope"), ("'--impl'", "no consensus named 'nope'", "pp0")),
        (("consensus", "--impl", "pp0,nope"), ("'--impl'", "no consensus named 'nope'")),
        (("consensus", "--impl", ""), ("'--impl'", "expected comma-separated names")),
        (("consensus", "--requests", "0"), ("'--requests'", "1<=x<=100000")),
        (("consensus", "--iter-ms", "0"), ("'--iter-ms'",)),
        (("transfer", "--backend", "nope"), ("'--backend'", "no kv_sender named 'nope'")),
        (("transfer", "--sizes", "abc"), ("'--sizes'", "expected comma-separated numbers")),
        (("transfer", "--sizes", "0.01"), ("'--sizes'", "must be >= 0.25 MiB")),
        (("transfer", "--sizes", "1,,2"), ("'--sizes'", "expected comma-separated numbers")),
        (("transfer", "--sizes", "1_6"), ("'--sizes'", "expected comma-separated numbers")),
        (("transfer", "--sizes", "\uff11\uff16"), ("'--sizes'", "expected comma-separated")),
        (("transfer", "--small-sizes", "0x10"), ("'--small-sizes'", "expected comma-separated")),
        (("transfer", "--sizes", "16,16"), ("'--sizes'", "names 16 more than once")),
        (("transfer", "--steps", "8,8"), ("'--steps'", "names 8 more than once")),
        (("transfer", "--repeats", "0"), ("'--repeats'", "1<=x<=40")),
        (("transfer", "--repeats", "41"), ("'--repeats'", "1<=x<=40")),
        (("transfer", "--repeats", "1_0"), ("'--repeats'", "'1_0': expected a whole number")),
        (("transfer", "--repeats", "\u0665"), ("'--repeats'", "expected a whole number")),
        (("plan", "--page", "\uff16\uff14"), ("'--page'", "expected a whole number")),
        (("plan", "--dcp", "1,\uff14"), ("'--dcp'", "is not integers separated by commas")),
        (("transfer", "--steps", "0"), ("'--steps'", "whole numbers 1-64")),
        (("transfer", "--steps", "1.5"), ("'--steps'", "whole numbers 1-64")),
        (("transfer", "--json", "/nonexistent-dir/x.json"), ("'--json'", "does not exist")),
        (("pack", "--json", "/nonexistent-dir/x.json"), ("'--json'", "does not exist")),
        (("plan", "--json", "/proc/x.json"), ("'--json'", "not writable")),
        (("plan", "--json", ""), ("'--json'", "expected a file path")),
        (("plan", "--json", "/tmp/"), ("'--json'", "is a directory")),
        (("plan", "--json", "/tmp/no-such-dir-pdplug/"), ("'--json'", "expected a file path")),
        (("transfer", "--sizes", "nan"), ("'--sizes'", "every value must be finite")),
        (("transfer", "--sizes", "1e400"), ("'--sizes'", "every value must be finite")),
        (("pack", "--backend", "nixl,mooncake"), ("'--backend'", "one name only")),
        (("sglang", "--json", "/proc/x.json"), ("'--json'", "not writable")),
        (("sglang", "--workdir", "/proc/x"), ("'--workdir'", "not a writable folder")),
        (("vllm", "--json", "/proc/x.json"), ("'--json'", "not writable")),
        (("vllm", "--workdir", "/proc/x"), ("'--workdir'", "not a writable folder")),
        (("plan", "--planner", "dcp,tp"), ("'--planner'", "one name only")),
        (("plan", "--repeats", "0"), ("'--repeats'", "1<=x<=100000")),
        (("plan", "--dcp", "0"), ("'--dcp'", "1<=x<=64")),
        (("plan", "--page", "0"), ("'--page'", "1<=x<=4096")),
        (("plan", "--planner", "nope"), ("'--planner'", "no pack_planner named 'nope'", "dcp")),
        (("pack", "--backend", "nope"), ("'--backend'", "no kv_sender named 'nope'")),
        (("pack", "--layers", "0"), ("'--layers'", "1<=x<=128")),
        (("e2e", "--variants", "foo"), ("'--variants'", "'foo': expected CONSENSUS+KV_SENDER")),
        (("e2e", "--variants", ""), ("'--variants'", "expected CONSENSUS+KV_SENDER")),
        (("e2e", "--variants", "pp0+nixl,+nixl"), ("'--variants'", "'+nixl'")),
        (("e2e", "--variants", "pp0+nope"), ("'--variants'", "no kv_sender named 'nope'")),
        (("cluster", "--backend", "nope"), ("'--backend'", "no kv_sender named 'nope'")),
        (("cluster", "--backend", ""), ("'--backend'", "expected comma-separated names")),
        (("cluster", "--scenarios", "1,8"), ("'--scenarios'", "scenario numbers among 1, 2")),
        (("cluster", "--scenarios", ""), ("'--scenarios'", "scenario numbers")),
        (("cluster", "--rate", "0"), ("'--rate'", "rooms per second in 1..1000")),
        (("cluster", "--rate", "nan"), ("'--rate'", "rooms per second in 1..1000")),
        (("cluster", "--scenarios", "1,1"), ("'--scenarios'", "names 1 more than once")),
        (("cluster", "--backend", "nixl,nixl"), ("'--backend'", "names nixl more than once")),
        (("cluster", "--concurrency", "0"), ("'--concurrency'", "1<=x<=64")),
        (("cluster", "--json", "/nonexistent-dir/x.json"), ("'--json'", "does not exist")),
        (("transfer", "--backend", "nixl,nixl"), ("'--backend'", "names nixl more than once")),
        (
            ("transfer", "--sizes", "0.3,0.2999"),
            ("'--sizes'", "0.3 and 0.2999 are 76 tokens (0.296875 MiB)", "whole tokens of 4,096 B"),
        ),
        (
            ("e2e", "--variants", "pp0+nixl,ring+nixl,pp0+nixl"),
            ("'--variants'", "names pp0+nixl more than once"),
        ),
    ],
)
def test_ordinary_mistakes_get_one_line_and_exit_2(
    args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output
    assert res.output.splitlines()[-1].startswith("Error: Invalid value for"), res.output
    flat = " ".join(res.output.split())
    for needle in needles:
        assert needle in flat, res.output
    assert time.monotonic() - t0 < 20, "refused late: something was spawned first"


def test_help_has_no_rest_markup_and_every_option_is_explained() -> None:
    runner = CliRunner()
    top = runner.invoke(main, ["bench", "--help"])
    assert top.exit_code == 0 and "``" not in top.output and "OMP_WAIT_POLICY" in top.output
    for cmd in ("consensus", "plan", "pack", "transfer", "e2e", "cluster"):
        res = runner.invoke(main, ["bench", cmd, "--help"], terminal_width=200)
        assert res.exit_code == 0 and "``" not in res.output, res.output
    res = runner.invoke(main, ["bench", "consensus", "--help"], terminal_width=200)
    assert "--seed INTEGER seed of the readiness schedule" in " ".join(res.output.split())


def test_vllm_commands_name_what_is_missing_in_one_line() -> None:
    """`pdplug proxy` and `pdplug bench vllm` after a plain `.[all]` install (no vLLM extras)
    ended in a ModuleNotFoundError traceback (found by a new user)."""
    import importlib.util

    if importlib.util.find_spec("httpx") is not None:
        pytest.skip("the [vllm] extra is installed here")
    for args in (["proxy", "--prefill", "http://a", "--decode", "http://b"], ["bench", "vllm"]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 1, res.output
        assert "Traceback" not in res.output and "pdplug[vllm]" in res.output, res.output


def test_bench_cluster_without_pytest_names_the_testing_extra_in_one_line() -> None:
    """The cluster bench runs on pdplug.testing.netns, which imports pytest: an install
    without the [testing] extra gets one line naming it, not an ImportError traceback."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None; from pdplug.cli import main; "
        "main(['bench', 'cluster', '--scenarios', '1', '--backend', 'nixl'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count('pip install "pdplug[testing]"') == 1, out.stderr  # said once


def test_sigterm_unwinds_like_ctrl_c_and_restores_the_handler() -> None:
    """``pdplug bench`` and the engine demos run inside :func:`sigterm_as_interrupt`: a
    ``kill`` raises KeyboardInterrupt, so ``running`` blocks stop their engines (the default
    action orphaned a bench's SGLang engines)."""
    import os
    import signal

    from pdplug_engines.procs import sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode; never reached
    assert signal.getsignal(signal.SIGTERM) is before


def _report(requests: int, parity_ok: int) -> dict[str, object]:
    """The fields ``pdplug bench e2e`` reads from one ``run_demo`` report."""
    ms = {"p50": 1.0, "p99": 2.0}
    return {
        "plugins": {"consensus": {"name": "pp0"}, "kv_sender": {"name": "nixl"}},
        "requests": requests,
        "parity_ok": parity_ok,
        "throughput": {"requests_per_s": 1.0, "output_tokens_per_s": 1.0},
        "ttft_ms": ms,
        "breakdown_ms": {"consensus": ms, "transfer": ms},
        "serve_s": 1.0,
    }


@pytest.mark.parametrize("lost", [0, 1])
def test_bench_e2e_exits_nonzero_when_a_variant_is_not_token_identical(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, lost: int
) -> None:
    """The parity column is a check, not a figure: a variant whose requests are not all
    token-identical to the reference run fails the command (after its table and JSON). The
    runs are replaced by their reports: this tests the command's verdict, not the host."""
    import pdplug_host.driver

    reports = iter([_report(4, 4), _report(4, 4 - lost)])
    monkeypatch.setattr(pdplug_host.driver, "run_demo", lambda _opts: next(reports))
    out = f"{tmp_path}/e2e.json"
    res = CliRunner().invoke(
        main, ["bench", "e2e", "--requests", "4", "--variants", "pp0+nixl,ring+nixl",
               "--json", out]
    )  # fmt: skip
    assert res.exit_code == (1 if lost else 0), res.output
    assert ("ring+nixl 3/4" in res.output) == bool(lost), res.output
    with open(out) as f:
        doc = json.load(f)
    assert "parity_ok" in json.dumps(doc["rows"]), doc
    # the file says how it was made: the command and its options as parsed
    opts = doc["options"]
    assert opts["command"].endswith("bench e2e") and opts["requests"] == 4, opts
    assert opts["variants"] == "pp0+nixl,ring+nixl" and opts["json_path"] == out, opts


def test_bench_e2e_refuses_consensus_and_kv_sender_which_the_variants_set() -> None:
    """--consensus/--kv-sender (shared with pdplug demo) would be ignored: refused, not run."""
    for flag in ("--consensus", "--kv-sender"):
        res = CliRunner().invoke(main, ["bench", "e2e", flag, "foo", "--requests", "2"])
        assert res.exit_code == 2, res.output
        assert f"{flag} foo: bench e2e takes the consensus and the KV sender" in " ".join(
            res.output.split()
        ), res.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--pack-region-tokens", "8"), "pp0+nixl: --pack-region-tokens 8: must be at least"),
        (("--time-scale", "nan"), "pp0+nixl: --time-scale nan: must be in"),
        (("--log-dir", "/etc/passwd"), "pp0+nixl: --log-dir /etc/passwd: not a directory"),
        (("--pack-planner", "nope"), "pp0+nixl: "),
    ],
)
def test_bench_e2e_refuses_what_pdplug_demo_refuses_in_one_line(
    args: tuple[str, ...], needle: str
) -> None:
    """Every variant's options are checked before the first one runs, with pdplug demo's
    checks; a refusal is one line and exit 1 (it was a traceback: DemoError is no
    PdplugError)."""
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["bench", "e2e", "--requests", "2", *args])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.output.splitlines()[-1].startswith("Error: "), res.output
    assert needle in " ".join(res.output.split()), res.output
    assert time.monotonic() - t0 < 20, "refused late: something was spawned first"


def test_bench_e2e_turns_a_failed_run_into_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails (a worker refused the geometry, a bad trace) ends the command with one
    line naming the variant, as pdplug demo does."""
    import pdplug_host.driver
    from pdplug_host.options import DemoError

    def fail(_opts: object) -> None:
        raise DemoError("prefill worker 0 died: CompatError: example")

    monkeypatch.setattr(pdplug_host.driver, "run_demo", fail)
    res = CliRunner().invoke(main, ["bench", "e2e", "--requests", "2", "--variants", "pp0+nixl"])
    assert res.exit_code == 1, res.output
    assert res.output.splitlines()[-1] == (
        "Error: pp0+nixl: prefill worker 0 died: CompatError: example"
    ), res.output


def test_bench_transfer_refuses_a_run_that_does_not_fit_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sized from the smallest small size times the largest K (the K rows' buffer), checked
    against the memory available before anything is allocated or spawned."""
    import pdplug_bench.machine

    monkeypatch.setattr(pdplug_bench.machine, "available_bytes", lambda: 512 << 20)
    t0 = time.monotonic()
    res = CliRunner().invoke(
        main, ["bench", "transfer", "--backend", "nixl", "--sizes", "1", "--small-sizes",
               "16,4", "--steps", "64"]
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    flat = " ".join(res.output.split())
    assert "--sizes/--small-sizes/--steps need" in flat, flat
    assert "0.5 GiB is available" in flat, flat
    # 4 MiB x 64, not 16 MiB x 64: the K rows post the smallest small size
    assert "KV of 256 MiB on each side" in flat, flat
    assert time.monotonic() - t0 < 20, "refused late: something was spawned first"


def test_bench_transfer_sizes_are_whole_tokens() -> None:
    """A size is the bytes of the whole tokens a send moves (rounded down), so a row's label
    and GB/s are what it moved: 0.3 MiB is 76 tokens, 311,296 B (0.296875 MiB)."""
    from pdplug_bench.transfer import MIB, _whole_tokens

    assert _whole_tokens([0.3, 0.0625, 16.0], "--sizes") == [311_296, 65_536, 16 * MIB]


def test_bench_transfer_k_rows_get_whole_pages_and_e2e_hides_refused_options() -> None:
    """The K rows' sends each take whole pages of their own: ``--sizes 1 --small-sizes
    0.0625 --steps 32`` sized its buffers for 32 x 64 KiB (8 pages, 24 with the margin) and
    failed with "32 sends of 65536 bytes need more than 24 pages"; the buffer now holds 32
    pages of 256 KiB. ``bench e2e --help`` no longer offers --consensus/--kv-sender, which it
    refuses."""
    from pdplug_bench import transfer

    seen: list[int] = []

    class _Stop(Exception):
        pass

    def fake_rig(backend: str, need: int) -> None:
        seen.append(need)
        raise _Stop

    mp = pytest.MonkeyPatch()
    mp.setattr(transfer, "Rig", fake_rig)
    try:
        res = CliRunner().invoke(
            main,
            [
                "bench",
                "transfer",
                "--backend",
                "nixl",
                "--sizes",
                "1",
                "--small-sizes",
                "0.0625",
                "--steps",
                "32",
            ],
        )
    finally:
        mp.undo()
    # the rig's error ends the run as a reported failure of that backend, no table printed
    assert res.exit_code == 1, res.output
    assert "nixl did not run: _Stop\n" in res.output and "┃" not in res.output, res.output
    assert seen == [32 * 256 * 1024], seen
    help_text = CliRunner().invoke(main, ["bench", "e2e", "--help"]).output
    offered = [line.split()[0] for line in help_text.splitlines() if line.startswith("  --")]
    assert "--variants" in offered and "--decode-dcp" in offered, offered
    assert "--consensus" not in offered and "--kv-sender" not in offered, offered


def test_a_backend_that_could_not_run_is_named_in_one_readable_line() -> None:
    """An interrupted bench's decode process shows up as a lost pipe: the line says so, with
    the error's text, not its repr (found by a fresh user's Ctrl-C)."""
    import click

    from pdplug_bench.transfer import _why

    why = _why(BrokenPipeError(32, "Broken pipe"))
    assert why.startswith("BrokenPipeError: [Errno 32] Broken pipe")
    assert "decode process ended" in why
    assert _why(click.ClickException("nixl is not installed")) == "nixl is not installed"
    assert _why(RuntimeError("boom")) == "RuntimeError: boom"
    assert _why(RuntimeError()) == "RuntimeError"


def test_bench_transfer_stops_when_its_decode_process_is_gone() -> None:
    """A Ctrl-C of the terminal reaches the bench's decode process too: the rig's pipe breaks
    and the run stops there (exit 1, the lost pipe named) instead of benchmarking the next
    backend (found by a fresh user: the interrupt was swallowed and Mooncake ran on)."""
    from pdplug_bench import transfer

    seen: list[str] = []

    def fake_rig(backend: str, need: int) -> None:
        seen.append(backend)
        raise BrokenPipeError(32, "Broken pipe")

    mp = pytest.MonkeyPatch()
    mp.setattr(transfer, "Rig", fake_rig)
    try:
        res = CliRunner().invoke(
            main, ["bench", "transfer", "--backend", "nixl,mooncake", "--sizes", "1"]
        )
    finally:
        mp.undo()
    assert res.exit_code == 1, res.output
    assert seen == ["nixl"], seen
    assert "nixl did not run: BrokenPipeError: [Errno 32] Broken pipe" in res.output, res.output


def test_the_decode_process_ends_quietly_on_a_terminal_interrupt(monkeypatch: Any) -> None:
    """A terminal's Ctrl-C reaches the bench's decode process too: it ends without a traceback
    (the bench names the lost process in one line; found by a fresh user: the child's
    ``KeyboardInterrupt`` traceback buried it); any other error still reaches the bench."""
    from pdplug_bench import _kvpeer

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(_kvpeer, "_send", lambda conn, **kw: sent.append(kw))

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_kvpeer, "_worker", interrupted)
    _kvpeer._main(None, "nixl", "tcp://127.0.0.1:1", "p", b"")
    assert sent == []

    def broken(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(_kvpeer, "_worker", broken)
    with pytest.raises(RuntimeError, match="boom"):
        _kvpeer._main(None, "nixl", "tcp://127.0.0.1:1", "p", b"")
    assert sent == [{"event": "error", "error": "RuntimeError: boom"}]
