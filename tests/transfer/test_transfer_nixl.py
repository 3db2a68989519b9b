"""The ``nixl`` KV sender/receiver across real processes (see ``_kvharness``)."""

from __future__ import annotations

import pytest

from pdplug.testing import require

require("nixl")

import kvscenarios as sc  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(90)]

BACKEND = "nixl"


def test_roundtrip_tp_dcp2_dcp4_pp2_partial_pages_and_prefix() -> None:
    sc.roundtrip(BACKEND)


def test_failed_post_abort_compat_and_fuzz() -> None:
    sc.failures(BACKEND)


def test_prefill_killed_mid_transfer() -> None:
    sc.kill_prefill(BACKEND)


def test_late_tags_of_a_recycled_room_are_ignored() -> None:
    sc.late_tags(BACKEND)
