"""`pdplug bench consensus` runs end to end on a tiny size and writes the documented JSON
(no timing assertions: performance claims live in the benchmark output)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pdplug.cli import main


@pytest.mark.timeout(60)
def test_bench_consensus_smoke(tmp_path) -> None:
    out = tmp_path / "cons.json"
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "consensus",
            "--pp",
            "2",
            "--iter-ms",
            "2",
            "--requests",
            "12",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert "machine:" in r.output and "ratio ring/pp0" in r.output
    data = json.loads(out.read_text())
    assert [(x["impl"], x["pp_size"]) for x in data["rows"]] == [("pp0", 2), ("ring", 2)]
    for row in data["rows"]:
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert set(data["ratio_ring_over_pp0"]) == {"2"}


def test_bench_consensus_rejects_bad_pp() -> None:
    r = CliRunner().invoke(main, ["bench", "consensus", "--pp", "2,x"])
    assert r.exit_code != 0 and "--pp='2,x'" in r.output
