"""Pack-buffer layout, run merging and run addressing shared by planners and KV senders.

Pure numpy helpers (no torch, no plugin imports). The algorithm follows SGLang's DCP packing
(``dcp_pack_buffer_bytes`` / per-rank regions, PRs #35762 and #40376), rewritten for
pdplug's contracts; regions are laid out in destination order (:class:`pdplug.PackGroup`).
One module per job, every public name re-exported here:

* :mod:`pdplug.packing.regions`: pack-buffer sizes, the region table, slots, the send bound;
* :mod:`pdplug.packing.pages`: page-id conversion (``page_array``, ``MAX_PAGE_ID``);
* :mod:`pdplug.packing.chunks`: segment to chunk (``segment_to_chunk``, ``segment_chunks``);
* :mod:`pdplug.packing.runs`: run merging (``merge_runs``);
* :mod:`pdplug.packing.addresses`: run addressing and per-entry source tables;
* :mod:`pdplug.packing.direct`: a pair's direct whole-page template bound to a peer
  (``DirectRuns``: a send's descriptors without a plan);
* :mod:`pdplug.packing.groups`: a packed plan's gather (``pack_groups``, ``group_rows``);
* :mod:`pdplug.packing.plans`: one segment planned for its destinations (``plan_segment``);
* :mod:`pdplug.packing.pack`: one segment packed (``pack_segment``).

Double buffering (how a KV sender overlaps packing with transfer)
-----------------------------------------------------------------
With ``depth >= 2`` regions per destination rank, segment ``k`` of a send uses slot
``k % depth`` (:func:`region_index` with the segment's ``chunk_id``)::

    regions = pack_regions(src_layout, dst_dcp_size=D, depth=2, region_tokens=cap)
    segments = scheduler.split_send(..., capacity_tokens=send_capacity_tokens(regions[0], D))
    for seg in segments:
        chunk = segment_to_chunk(room, seg, send_pages[seg.page_start:], dst_pages, prefix, P)
        slot = [regions[region_index(r, seg.chunk_id, depth=2)] for r in range(D)]
        wait_until_free(slot)        # the writes posted from them depth segments ago are done
        plans = plan_all_ranks(planner, chunk, src_layout, dst_layout, slot)
        pack_segment(packer, plans, kv_entries, pack_buffer)  # one launch; async: record an event
        for r, plan in enumerate(plans):                      # after the event
            post(run_addresses(plan, src_bases, dst_bases[r], emap, pack_base))

While segment ``k`` is in flight from slot ``k % 2``, segment ``k + 1`` is packed into the
other slot; a sender must not repack a slot before the write that reads it has completed
(engines report completion per posted transfer). ``depth = 1`` serialises pack and transfer.
"""

from __future__ import annotations

from pdplug.packing.addresses import plan_addresses as plan_addresses
from pdplug.packing.addresses import run_addresses
from pdplug.packing.addresses import source_table as source_table
from pdplug.packing.chunks import segment_chunks, segment_to_chunk
from pdplug.packing.direct import DirectRuns as DirectRuns
from pdplug.packing.groups import group_rows, pack_groups
from pdplug.packing.pack import pack_segment
from pdplug.packing.pages import MAX_PAGE_ID, page_array
from pdplug.packing.plans import plan_all_ranks, plan_segment
from pdplug.packing.regions import REGION_ALIGN as REGION_ALIGN
from pdplug.packing.regions import (
    pack_buffer_nbytes,
    pack_bytes_per_token,
    pack_regions,
    region_capacity_tokens,
    region_index,
    send_capacity_tokens,
    sharded_entries,
)
from pdplug.packing.runs import merge_runs

__all__ = [
    "sharded_entries",
    "pack_bytes_per_token",
    "region_capacity_tokens",
    "pack_buffer_nbytes",
    "pack_regions",
    "region_index",
    "send_capacity_tokens",
    "merge_runs",
    "run_addresses",
    "MAX_PAGE_ID",
    "page_array",
    "segment_to_chunk",
    "segment_chunks",
    "pack_groups",
    "group_rows",
    "plan_all_ranks",
    "plan_segment",
    "pack_segment",
]
