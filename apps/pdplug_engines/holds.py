"""The test-only write switch as an engine harness sees it (both engines' kill phases).

A prefill engine started with ``PDPLUG_TEST_FAIL_WRITES=<switch>`` in its environment wraps
each KV sender's transfer engine (:func:`pdplug.transfer.faults.inject_from_env`); while the
switch file holds :data:`~pdplug.transfer.faults.HOLD` no write is issued, so a harness can
kill the decode while rooms are live however fast the host runs them.
"""

from __future__ import annotations

from pathlib import Path

from pdplug.transfer.faults import FAULT_ENV

__all__ = ["hold_ranks"]


def hold_ranks(log_path: str | Path, switch: str | Path) -> int:
    """KV senders of an engine that installed the test-only write switch ``switch``, read from
    the engine's log: each logs it once when it wraps its transfer engine (a line naming
    ``PDPLUG_TEST_FAIL_WRITES=<switch>:``). A hold that a sender never installed holds nothing
    there: its rooms end as fast as the host runs them (0 when the engine was started
    without the switch in its environment, or the log is missing).

    :param log_path: the engine's log (every process of the engine writes to it).
    :param switch: the switch file the engine was started with.
    :returns: how many senders installed it (vLLM: one per worker; SGLang: one per plane of
        each scheduler process).
    """
    mark = f"{FAULT_ENV}={Path(switch).resolve()}:"
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return 0
    return sum(mark in line for line in text.splitlines())
