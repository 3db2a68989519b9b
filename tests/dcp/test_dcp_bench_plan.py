"""``pdplug bench plan`` on small shapes: HND at TP 1:2 with a page ratio reaches the ideal run
count, its checks pass, and a packer that corrupts one byte makes it exit non-zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplug_bench.plan import cli

SMALL = ["--cached", "1024", "--unique", "1000", "--chunk-bound", "512", "--layers", "2",
         "--pack-layers", "2", "--repeats", "2", "--pack-repeats", "1", "--kv-heads", "4",
         "--head-bytes", "64", "--page", "16"]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        ["--layout", "hnd", "--tp", "1:2", "--page-ratio", "2"],
        ["--layout", "nhd", "--tp", "1:2", "--dcp", "1"],
        ["--layout", "mla", "--row-bytes", "96", "--page-ratio", "0.5"],
    ],
)
def test_bench_plan_reaches_the_ideal_and_checks_bytes(tmp_path: Path, extra: list[str]) -> None:
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(cli, [*SMALL, *extra, "--json", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["check_failures"] == [] and got["bit_exact"] is True
    assert got["runs_per_send"] <= 1.1 * got["ideal_runs_per_send"]
    assert ("nhd_equal_tp_runs_per_send" in got) == (extra[1] != "mla")
    assert "bytes vs numpy sub-row gather: identical" in res.output


def test_bench_plan_exits_non_zero_when_packed_bytes_differ(monkeypatch) -> None:
    """The old bench compared a zero-filled reference with a 0xA5-filled buffer on CUDA and
    carried on; now both buffers are filled alike and any differing byte fails the run."""
    from pdplug_dcp.packers import TorchPacker

    real = TorchPacker.pack

    def corrupt(self, plan, entries, buf):  # type: ignore[no-untyped-def]
        real(self, plan, entries, buf)
        if plan.packed and plan.num_tokens and plan.region is not None:
            buf[plan.region.offset] ^= 0xFF

    monkeypatch.setattr(TorchPacker, "pack", corrupt)
    res = CliRunner().invoke(cli, [*SMALL, "--layout", "hnd", "--tp", "1:2"])
    assert res.exit_code != 0
    assert "DIFFER" in res.output and "check failed: packed bytes differ" in res.output


def test_bench_plan_names_a_bad_page_ratio() -> None:
    res = CliRunner().invoke(cli, [*SMALL, "--page-ratio", "3"])
    assert res.exit_code == 2 and "is not a whole decode page" in res.output
