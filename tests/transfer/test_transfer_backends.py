"""The KV sender/receiver of every backend across real processes (see ``_kvharness``): one
module, parametrized by backend (NIXL, Mooncake)."""

from __future__ import annotations

import kvscenarios as sc
import pytest

pytestmark = pytest.mark.timeout(90)


def test_roundtrip_tp_dcp2_dcp4_pp2_partial_pages_and_prefix(backend: str) -> None:
    sc.roundtrip(backend)


def test_failed_post_abort_compat_and_fuzz(backend: str) -> None:
    sc.failures(backend)


def test_prefill_killed_mid_transfer(backend: str) -> None:
    sc.kill_prefill(backend)


def test_late_tags_of_a_recycled_room_are_ignored(backend: str) -> None:
    sc.late_tags(backend)
