"""``pdplug proxy`` refuses a room allocator id its rooms cannot encode, naming the option
(before starting anything)."""

from __future__ import annotations

from click.testing import CliRunner

from pdplug.adapters.room_ids import MAX_ALLOCATOR_ID
from pdplug_vllm.cli import proxy


def test_proxy_refuses_an_allocator_id_out_of_range() -> None:
    for bad in (str(MAX_ALLOCATOR_ID + 1), "40000", "-1"):
        args = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
        res = CliRunner().invoke(proxy, [*args, "--allocator-id", bad])
        assert res.exit_code == 2, (bad, res.output)
        assert "Invalid value for '--allocator-id'" in res.output and bad in res.output
        assert "Traceback" not in res.output
