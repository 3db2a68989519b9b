"""Which readiness the prefill worker hands ``KVSender.send`` after a step's forward.

On CUDA: an event recorded on the current stream after the forward's KV writes (polled by the
sender, no stream synchronisation); on CPU: ``None``. No GPU here: the CUDA branch runs with a
fake event object (``record``/``query``), so this proves the choice, not CUDA itself.
"""

from __future__ import annotations

import pytest

from pdplug.adapters.push import step_ready
from pdplug.transfer.gather import check_ready


class _FakeEvent:
    made = 0

    def __init__(self) -> None:
        _FakeEvent.made += 1
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1

    def query(self) -> bool:
        return self.recorded > 0


@pytest.mark.parametrize("device", ["cpu", "meta", ""])
def test_cpu_step_is_ready_now_and_makes_no_event(device: str) -> None:
    _FakeEvent.made = 0
    assert step_ready(device, _FakeEvent) is None
    assert _FakeEvent.made == 0


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_step_records_one_event_the_sender_accepts(device: str) -> None:
    _FakeEvent.made = 0
    ev = step_ready(device, _FakeEvent)
    assert isinstance(ev, _FakeEvent) and _FakeEvent.made == 1
    assert ev.recorded == 1  # recorded once, on the current stream, never synchronised
    check_ready(ev)  # what KVSender.send checks: it has query()
    assert ev.query()
