"""Packing one segment: every plan of a segment through a packer, in one call where it can.

The ``dcp`` packers' ``pack_all`` builds one launch table for the whole segment (one upload and
one kernel launch on CUDA); a packer without it is called once per plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdplug.protocols import Packer
from pdplug.types import TransferPlan

__all__ = ["pack_segment"]


def pack_segment(
    packer: Packer,
    plans: Sequence[TransferPlan],
    entries: Sequence[Any],
    pack_buffer: Any,
) -> None:
    """Pack one segment's plans (one per destination DCP rank, each into its own region).

    Uses the packer's ``pack_all(plans, entries, pack_buffer)`` when it has one (the ``dcp``
    packers: one launch table, one upload and one kernel launch for the whole segment on
    CUDA), else calls ``pack`` per plan. On CUDA the work is enqueued on the current stream:
    record an event before posting writes that read the regions.

    :param entries: the source KV entries (tensors, as ``Packer.pack`` takes them).
    :param pack_buffer: uint8 ``[nbytes]`` tensor.
    :raises ValueError: as ``Packer.pack``; plans writing overlapping pack-buffer bytes.
    """
    batched = getattr(packer, "pack_all", None)
    if batched is not None:
        batched(plans, entries, pack_buffer)
        return
    for plan in plans:
        packer.pack(plan, entries, pack_buffer)
