"""A prefill instance that comes back is found again, with no decode restarted (real processes
over real engines on 127.0.0.1; see ``kvscenarios``)."""

from __future__ import annotations

import kvscenarios as sc
import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_a_restarted_prefill_is_found_again_by_the_next_room(backend: str) -> None:
    sc.refind_restarted_prefill(backend)


def test_a_frozen_prefill_is_found_again_and_its_failed_room_drains(backend: str) -> None:
    sc.refind_frozen_prefill(backend)


def test_prefill_ranks_register_again_after_a_rendezvous_restart(backend: str) -> None:
    sc.rendezvous_restart(backend)


def test_a_found_instance_connects_in_the_background_and_an_unknown_one_fails_alone(
    backend: str,
) -> None:
    sc.find_in_background(backend)


def test_a_host_connect_racing_the_decodes_own_search_ends_connected(backend: str) -> None:
    sc.connect_while_found_again(backend)
