"""pdplug: prefill/decode disaggregation machinery for LLM serving engines, as pluggy plugins.

Quick start for a host engine::

    from pdplug import get_plugin_manager, ConsensusConfig
    pm = get_plugin_manager()                       # finds every plugin via entry points
    consensus = pm.make_consensus(ConsensusConfig(pp_rank=r, pp_size=P, endpoints=eps))
    consensus.offer("bootstrap", good=[room])       # every loop iteration …
    for d in consensus.poll():                      # … apply decisions exactly once, in order
        ...

Quick start for a plugin author::

    from pdplug import hookimpl, ConsensusSpec

    @hookimpl
    def pdplug_register_consensus():
        yield ConsensusSpec(name="mine", factory="my_pkg.impl:make", summary="…")

and declare ``[project.entry-points.pdplug] my-plugin = "my_pkg.plugin"``.
Importing :mod:`pdplug` is light: no torch, nixl, mooncake or triton.
"""

from __future__ import annotations

from pdplug.config import ConsensusConfig, KVConfig, PlannerConfig, SchedulerConfig, WireConfig
from pdplug.errors import (
    CapacityError,
    CompatError,
    ConsensusError,
    DuplicateComponentError,
    PdplugError,
    PlanError,
    PluginError,
    TransferError,
    UnknownComponentError,
)
from pdplug.hookspecs import PdplugSpecs, hookimpl, hookspec
from pdplug.layout import entries_per_layer, entry_map, layout_mismatches
from pdplug.manager import PluginManager, get_plugin_manager, load_factory
from pdplug.protocols import Consensus, KVReceiver, KVSender, Packer, PackPlanner, Scheduler
from pdplug.types import (
    STREAMS,
    ChunkTag,
    ComponentSpec,
    ConsensusSpec,
    Decision,
    DestInfo,
    KVEntry,
    KVLayout,
    KVPoll,
    KVSenderSpec,
    PackGroup,
    PackPlannerSpec,
    PackRegion,
    PdplugEvent,
    PeerInfo,
    SchedulerSpec,
    Segment,
    SendChunk,
    TransferPlan,
    Vote,
    merge_poll,
    pages_from_bytes,
    pages_to_bytes,
    reduce_poll,
)
from pdplug.wire import Codec

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "hookimpl",
    "hookspec",
    "PdplugSpecs",
    "PluginManager",
    "get_plugin_manager",
    "load_factory",
    "Codec",
    "Consensus",
    "Scheduler",
    "PackPlanner",
    "Packer",
    "KVSender",
    "KVReceiver",
    "ConsensusConfig",
    "KVConfig",
    "PlannerConfig",
    "SchedulerConfig",
    "WireConfig",
    "KVPoll",
    "merge_poll",
    "reduce_poll",
    "KVLayout",
    "KVEntry",
    "PackGroup",
    "SendChunk",
    "Segment",
    "TransferPlan",
    "PackRegion",
    "Vote",
    "Decision",
    "STREAMS",
    "PeerInfo",
    "DestInfo",
    "ChunkTag",
    "PdplugEvent",
    "ComponentSpec",
    "SchedulerSpec",
    "ConsensusSpec",
    "KVSenderSpec",
    "PackPlannerSpec",
    "pages_to_bytes",
    "pages_from_bytes",
    "entries_per_layer",
    "entry_map",
    "layout_mismatches",
    "PdplugError",
    "PluginError",
    "UnknownComponentError",
    "DuplicateComponentError",
    "CompatError",
    "PlanError",
    "CapacityError",
    "ConsensusError",
    "TransferError",
]
