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
        summary="NHD/HND/MLA, TP and page ratios, DCP: packed in destination order, fewest runs",
    )
    yield PackPlannerSpec(
        name="tp",
        factory="pdplug_dcp.planner:make_tp_planner",
        summary="direct merged runs, no packing (decode DCP 1)",
    )
