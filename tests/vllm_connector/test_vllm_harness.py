"""The vLLM parity harness without an engine: the engine specs a run launches and the check
that a write hold reached every prefill worker.

A decode-kill run without fault phases once launched a prefill spec built before the write
switch was added to it (issue 22): no prefill worker read the switch, and the PP 2
decode-kill test found no room held whenever the host ended every room between two polls.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")  # the harness imports pdplug proxy

from pdplug.transfer.faults import FAULT_ENV, inject_from_env
from pdplug_vllm.parity import run_specs
from pdplug_vllm.phases import hold_ranks

PORTS = list(range(41000, 41008))


@pytest.mark.parametrize(
    ("phases", "held"),
    [
        ({}, False),
        ({"kill_decode": True}, True),
        ({"restart": True}, True),
        ({"fault_prompts": 6}, True),
        ({"kill_decode": True, "fault_prompts": 6, "restart": True}, True),
    ],
)
def test_the_prefill_launched_is_the_one_with_the_switch(
    tmp_path: Path, phases: dict[str, Any], held: bool
) -> None:
    s = run_specs("pdplug", "/model", PORTS, tmp_path, prefill_pp=2, **phases)
    launched = {e.name: e for e in s.engines}
    switch = (tmp_path / "fail-writes").resolve()
    # the phases read s.prefill / s.switch; the launch list is built from the same specs
    assert launched["prefill"] == s.prefill
    assert s.switch == (switch if held else None)
    assert launched["prefill"].env.get(FAULT_ENV) == (str(switch) if held else None)
    assert all(FAULT_ENV not in e.env for name, e in launched.items() if name != "prefill")
    assert ("decode-fail" in launched) == bool(phases.get("fault_prompts"))
    assert list(launched)[:3] == ["single", "prefill", "decode"]


def test_nixl_kill_holds_nothing(tmp_path: Path) -> None:
    s = run_specs("nixl", "/model", PORTS, tmp_path, kill_decode=True)
    assert s.switch is None and all(FAULT_ENV not in e.env for e in s.engines)


class _Engine:
    name = "fake"
    notifications = True


class _Session:
    engine: Any = _Engine()


def test_hold_ranks_counts_the_workers_that_installed_this_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    switch = tmp_path / "fail-writes"
    monkeypatch.setenv(FAULT_ENV, str(switch.resolve()))
    with caplog.at_level(logging.WARNING, logger="pdplug.transfer.faults"):
        assert inject_from_env(_Session())  # what each prefill worker logs
    (line,) = [r.getMessage() for r in caplog.records]
    log = tmp_path / "prefill.log"
    other = line.replace(str(switch.resolve()), str(tmp_path / "other-switch"))
    log.write_text(f"start\n(Worker_PP0) pdplug: {line}\n{other}\n(Worker_PP1) pdplug: {line}\n")
    assert hold_ranks(log, switch) == 2
    assert hold_ranks(log, tmp_path / "unrelated") == 0
    assert hold_ranks(tmp_path / "missing.log", switch) == 0


def test_extra_prefills_push_to_the_one_decode_and_the_fail_decode_is_tp1(tmp_path: Path) -> None:
    ports = list(range(41000, 41014))
    s = run_specs("pdplug", "/model", ports, tmp_path, decode_tp=2, fault_prompts=6,
                  extra_prefills=[(1, 2), (2, 1)], bootstrap_timeout_s=10)  # fmt: skip
    names = [e.name for e in s.engines]
    assert names == ["single", "prefill", "decode", "decode-fail", "prefill-1", "prefill-2"]
    assert s.decode.tensor_parallel_size == 2 and s.decode.cpu_cores == "1|1"
    assert s.decode_fail is not None and s.decode_fail.tensor_parallel_size == 1
    assert s.decode_fail.cpu_cores == "1"
    (p1, _), (p2, _) = s.extra
    assert (p1.tensor_parallel_size, p2.pipeline_parallel_size) == (2, 2)
    for i, (p, o) in enumerate(s.extra, 1):
        doc = p.kv_transfer or {}
        extra = doc["kv_connector_extra_config"]
        assert doc["engine_id"] == extra["instance"] == o["prefill_instance"] == f"prefill-{i}"
        assert o["bootstrap"] == f"tcp://127.0.0.1:{extra['bootstrap_port']}"
        assert extra["bootstrap_timeout_s"] == 10 and FAULT_ENV not in p.env
    # every engine on its own port, every rendezvous on its own
    http = [e.port for e in s.engines]
    assert len(set(http)) == len(http)
    with pytest.raises(ValueError, match="ports"):
        run_specs("pdplug", "/model", PORTS, tmp_path, extra_prefills=[(1, 2)])
    with pytest.raises(ValueError, match="extra_prefills"):
        run_specs("nixl", "/model", ports, tmp_path, extra_prefills=[(1, 2)])


def test_an_empty_trace_is_refused_before_any_engine_starts(tmp_path: Path) -> None:
    from pdplug_host.vllm_demo import run_vllm_demo
    from pdplug_vllm.parity import run_parity

    empty = tmp_path / "empty.trace"
    for text in ("", "[]", "\n\n"):
        empty.write_text(text)
        with pytest.raises(ValueError, match=r"--trace .*empty.trace: the trace has no requests"):
            run_vllm_demo(None, 32, 8, trace=str(empty))
    with pytest.raises(ValueError, match="prompts is empty"):
        run_parity("pdplug", tmp_path, prompts=[])
