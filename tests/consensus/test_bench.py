"""`pdplug bench consensus` runs end to end on a tiny size and writes the documented JSON
(no timing assertions: performance claims live in the benchmark output)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pdplug.cli import main


@pytest.mark.slow  # multi-process; the py310/312/313 core envs skip it
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
    assert "phases pipeline" in r.output and "ring_trip" in r.output
    data = json.loads(out.read_text())
    assert [(x["impl"], x["pp_size"]) for x in data["rows"]] == [("pp0", 2), ("ring", 2)]
    for row in data["rows"]:
        assert 0 < row["p50_ms"] <= row["p99_ms"]
    pp0, ring = data["rows"]
    assert pp0["round_trip_iterations"] is None and ring["round_trip_iterations"] >= 2
    assert set(data["ratio_ring_over_pp0"]) == {"2"} and data["sizes"]["phases"] == "pipeline"


def test_pipeline_phases_space_the_ranks_over_one_iteration() -> None:
    import random

    from pdplug_bench.consensus import phase_offsets

    assert phase_offsets(4, 0.008, "pipeline", random.Random(0)) == [0.0, 0.002, 0.004, 0.006]
    rand = phase_offsets(4, 0.008, "random", random.Random(0))
    assert all(0 <= x < 0.008 for x in rand)
    with pytest.raises(ValueError, match="phases='x'"):
        phase_offsets(4, 0.008, "x", random.Random(0))


def test_bench_consensus_rejects_bad_pp() -> None:
    r = CliRunner().invoke(main, ["bench", "consensus", "--pp", "2,x"])
    assert r.exit_code != 0 and "--pp='2,x'" in r.output
