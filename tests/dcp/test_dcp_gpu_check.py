"""The prepared GPU check (scripts/gpu_check): its ``run --cpu`` smoke mode passes end to end
(random Triton cases under TRITON_INTERPRET=1, bench plan sweeps), and its reference and
comparison catch a wrong byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pdplug.testing import require

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check" / "gpu_check.sh"


def _check_pack():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import check_pack
    finally:
        sys.path.pop(0)
    return check_pack


def test_reference_and_compare_catch_a_wrong_byte() -> None:
    require("triton")
    cp = _check_pack()
    from pdplug_dcp.packers import TorchPacker

    c = cp.Checker("cpu", 3)
    made = c.segment("hnd", 32, 2, 2, 40, tp=2, ways=())
    plans, ents, raw, size = made
    want = cp.reference(plans, raw, size)
    buf = torch.full((size,), cp.POISON, dtype=torch.uint8)
    TorchPacker().pack_all(plans, ents, buf)
    c.compare("segments: torch", buf, want)
    assert c.mismatches == [] and c.counts == {"segments": 1}
    written = np.flatnonzero(want != cp.POISON)
    buf[int(written[len(written) // 2])] ^= 1
    c.compare("segments: torch", buf, want)
    assert len(c.mismatches) == 1 and "1 bytes differ" in c.mismatches[0]


def test_usage_is_printed_without_a_command() -> None:
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "gpu_check.sh download" in proc.stdout


@pytest.mark.slow
@pytest.mark.triton
def test_run_cpu_smoke_mode_passes(tmp_path: Path) -> None:
    require("triton")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)  # the script sets it
    proc = subprocess.run(
        ["bash", str(SCRIPT), "run", "--cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT: all steps passed" in summary
    res = json.loads((tmp_path / "check_pack.json").read_text())
    assert res["mismatches"] == []
    assert {"random", "random-tiny", "random-mla", "segments", "back_to_back"} <= set(res["checks"])
    assert res["launch_tables"]["cached"] >= 1
    shapes = json.loads((tmp_path / "bench_plan.json").read_text())["shapes"]
    assert len(shapes) == 4 and all(s["bit_exact"] for s in shapes)
