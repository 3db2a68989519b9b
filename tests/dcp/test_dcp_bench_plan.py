"""``pdplug bench plan`` on small shapes: HND at TP 1:2 with a page ratio reaches the ideal run
count, its checks pass, a packer that corrupts one byte (whole-segment or per-rank path) makes
it exit non-zero, and a sweep of row sizes x DCP prints one summary row per shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from pdplug_bench.plan import cli

pytestmark = pytest.mark.torch  # the bench packs torch tensors

SMALL = ["--cached", "1024", "--unique", "1000", "--chunk-bound", "512", "--layers", "2",
         "--pack-layers", "2", "--repeats", "2", "--pack-repeats", "1", "--kv-heads", "4",
         "--head-bytes", "64", "--page", "16"]  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        ["--layout", "hnd", "--tp", "1:2", "--page-ratio", "2"],
        ["--layout", "nhd", "--tp", "1:2", "--dcp", "1"],
        ["--layout", "mla", "--row-bytes", "96", "--page-ratio", "0.5"],
        # a DCP size that does not divide the chunk bound: the packed segment is cut at the
        # regions' whole-page capacity (it raised CapacityError)
        ["--layout", "hnd", "--tp", "1:2", "--page-ratio", "2", "--dcp", "3"],
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
    assert "bytes (pack_all and per rank) vs numpy sub-row gather: identical" in res.output
    assert got["pack_plans"] >= 1 and got["mismatched_bytes_by_path"] == {"whole": 0, "per_rank": 0}


@pytest.mark.parametrize("method", ["pack", "pack_all"])
def test_bench_plan_exits_non_zero_when_packed_bytes_differ(monkeypatch, method: str) -> None:
    """The old bench compared a zero-filled reference with a 0xA5-filled buffer on CUDA and
    carried on; now both buffers are filled alike and any differing byte of either pack path
    (the whole segment in one call, or rank by rank) fails the run."""
    from pdplug_dcp.packers import TorchPacker

    real = getattr(TorchPacker, method)

    def corrupt(self, plans, entries, buf):  # type: ignore[no-untyped-def]
        real(self, plans, entries, buf)
        pl = plans[0] if isinstance(plans, list | tuple) else plans
        if pl.packed and pl.num_tokens and pl.region is not None:
            buf[pl.region.offset] ^= 0xFF

    monkeypatch.setattr(TorchPacker, method, corrupt)
    res = CliRunner().invoke(cli, [*SMALL, "--layout", "hnd", "--tp", "1:2"])
    assert res.exit_code != 0
    assert "DIFFER" in res.output and "check failed: packed bytes differ" in res.output
    why = res.output.split("check failed")[1]
    if method == "pack":  # only the per-rank path is corrupted
        assert re.search(r"'whole': 0, 'per_rank': [1-9]", why), why
    else:  # pack() delegates to pack_all(): both are
        assert re.search(r"'whole': [1-9]\d*, 'per_rank': [1-9]", why), why


def test_bench_plan_sweeps_row_sizes_and_dcp(tmp_path: Path) -> None:
    """Every (row bytes, DCP) pair is measured; DCP 1 MLA (sent directly by the planner) packs
    whole rows anyway so the kernel is measured there too; the triton host preparation is
    timed when triton imports."""
    out = tmp_path / "sweep.json"
    res = CliRunner().invoke(
        cli, [*SMALL, "--row-bytes", "96,128", "--dcp", "1,2", "--prep-repeats", "5",
              "--json", str(out)]
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    shapes = json.loads(out.read_text())["shapes"]
    assert [(s["sizes"]["row_bytes"], s["sizes"]["dcp"]) for s in shapes] == [
        (96, 1), (96, 2), (128, 1), (128, 2)
    ]  # fmt: skip
    assert all(s["bit_exact"] and s["check_failures"] == [] for s in shapes)
    assert [s["forced_whole_rows"] for s in shapes] == [True, False, True, False]
    assert [s["pack_plans"] for s in shapes] == [1, 2, 1, 2]
    assert "summary: row B | DCP | pack_all/copy" in res.output
    assert res.output.count("| ok") == 4
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    assert all(s["prep_us_p50"] > 0 and s["prep_entries"] == 2 for s in shapes)


def test_bench_plan_names_a_bad_page_ratio() -> None:
    res = CliRunner().invoke(cli, [*SMALL, "--page-ratio", "3"])
    assert res.exit_code == 2 and "is not a whole decode page" in res.output
    for bad in ("0", "-1", "nan", "inf"):
        res = CliRunner().invoke(cli, [*SMALL, "--page-ratio", bad])
        assert res.exit_code == 2 and "--page-ratio must be a positive number" in res.output, bad
    res = CliRunner().invoke(cli, [*SMALL, "--dcp", "2,x"])
    assert res.exit_code == 2 and "'--dcp': '2,x' is not integers separated by commas" in res.output


def test_cuda_report_lines_format_every_cuda_field(capsys) -> None:
    """No GPU here: the CUDA report and summary lines are formatted from a CPU run's result
    plus the fields only ``--device cuda`` measures, so a misspelt field fails here rather
    than on the GPU machine."""
    from pdplug_bench.plan import _planner_bench, _shape_report, _summary
    from pdplug_bench.plan_pack import CUDA_FIELDS, packer_bench

    args = {"cached": 1024, "unique": 1000, "chunk_bound": 512, "layers": 2, "pack_layers": 2,
            "kv_heads": 4, "head_bytes": 64, "page": 16, "planner": "dcp", "layout": "mla",
            "tp": "1:1", "page_ratio": 1.0, "row_bytes": 96, "dcp": 2}  # fmt: skip
    pl = _planner_bench(args, 2)
    pk = packer_bench(args, "cpu", 2)
    assert not set(CUDA_FIELDS) & set(pk)
    import inspect

    import pdplug_bench.plan_pack as pp

    body = inspect.getsource(pp.packer_bench) + inspect.getsource(pp._CudaTimer.extra)
    assert all(f'"{k}"' in body for k in CUDA_FIELDS)  # each is written by the CUDA path
    pk.update({k: [2, 3] if k.startswith("spin") else 0.5 for k in CUDA_FIELDS})
    pk["gpu_time_method"] = "cuda events"
    _shape_report(args, "cuda", 2, pl, pk)
    _summary("cuda", [{**pl, **pk, "sizes": args}])
    out = capsys.readouterr().out
    assert "in 2/3 repeats, rank by rank 2/3" in out and "host-incl/copy" in out


def test_bench_plan_refuses_a_packer_benchmark_larger_than_memory() -> None:
    """A layout whose pack buffer cannot fit (e.g. ``--tp 1:16`` of 61 layers) is refused with
    the sizes and the options to shrink, not killed by the OOM killer."""
    import click
    import torch

    from pdplug_bench.plan_pack import check_memory

    check_memory(1 << 20, torch.device("cpu"), "a small one")
    with pytest.raises(click.UsageError, match=r"needs 1048576\.0 GiB \(huge\) but cpu has .* "
                       r"GiB available; use fewer --pack-layers"):  # fmt: skip
        check_memory(1 << 50, torch.device("cpu"), "huge")
