"""Default pdplug plugin `pdplug_scheduler`: entry-point module (imports nothing heavy).

Registered through the `pdplug` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

from pdplug import SchedulerSpec, hookimpl


@hookimpl(trylast=True)
def pdplug_register_schedulers() -> Iterator[SchedulerSpec]:
    """Offer this package's components (see pdplug.hookspecs)."""
    yield SchedulerSpec(
        name="default",
        factory="pdplug_scheduler.scheduler:make_scheduler",
        summary="grid/capacity send splitting and dynamic chunked-prefill sizing",
    )
