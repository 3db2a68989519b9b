"""Default pdplug plugin `pdplug_dcp`: entry-point module (imports nothing heavy).

Registered through the `pdplug` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import PackPlannerSpec, hookimpl


@hookimpl(trylast=True)
def pdplug_register_pack_planners() -> Iterator[PackPlannerSpec]:
    """Offer this package's components (see pdplug.hookspecs)."""
    yield PackPlannerSpec(
        name="dcp",
        factory="pdplug_dcp.planner:make_dcp_planner",
        summary="DCP relayout: per-rank pack regions, Triton/torch gather, merged runs",
    )
    yield PackPlannerSpec(
        name="tp",
        factory="pdplug_dcp.planner:make_tp_planner",
        summary="identity layout: merged contiguous page runs, no packing",
    )
