"""pdplug: prefill/decode disaggregation machinery for LLM serving engines, as pluggy plugins.

Quick start for a host engine (complete, runnable: ``examples/consensus_pp.py`` and
``examples/transfer_dcp.py``)::

    from pdplug import ConsensusConfig, PluginManager
    pm = PluginManager()                            # every plugin, via entry points
    consensus = pm.make_consensus(ConsensusConfig(pp_rank=r, pp_size=P, endpoints=eps))
    consensus.offer("bootstrap", good=[room])       # every loop iteration ...
    for d in consensus.poll():                      # ... apply decisions exactly once, in order
        ...

Quick start for a plugin author::

    from pdplug import ConsensusSpec, hookimpl

    @hookimpl
    def pdplug_register_consensus():
        yield ConsensusSpec(name="mine", factory="my_pkg.impl:make", summary="...")

and declare ``[project.entry-points.pdplug] my-plugin = "my_pkg.plugin"``.

This package exports what hosts and plugin authors use: the manager, the Protocols, the
Configs, the Specs, ``KVPoll`` and ``KVLayout``, the errors and ``hookimpl``. Everything else
stays in its module: wire and plan structs in :mod:`pdplug.types` (``Decision``, ``Segment``,
``SendChunk``, ``PeerInfo``, ``PdplugEvent`` ...), the codec in :mod:`pdplug.wire`, the
rendezvous in :mod:`pdplug.bootstrap`, the extension-point table in :mod:`pdplug.manager`.
Importing :mod:`pdplug` is light: no torch, nixl, mooncake or triton, and no plugin.
"""

import importlib.metadata as _md
from types import ModuleType as _ModuleType

# The public API: every name imported below (and only those) is in __all__.
from pdplug.config import ConsensusConfig as ConsensusConfig
from pdplug.config import KVConfig as KVConfig
from pdplug.config import PlannerConfig as PlannerConfig
from pdplug.config import SchedulerConfig as SchedulerConfig
from pdplug.config import WireConfig as WireConfig
from pdplug.errors import CompatError as CompatError
from pdplug.errors import ConsensusError as ConsensusError
from pdplug.errors import PdplugError as PdplugError
from pdplug.errors import PlanError as PlanError
from pdplug.errors import PluginError as PluginError
from pdplug.errors import TransferError as TransferError
from pdplug.hookspecs import hookimpl as hookimpl
from pdplug.manager import PluginManager as PluginManager
from pdplug.manager import get_plugin_manager as get_plugin_manager
from pdplug.protocols import Consensus as Consensus
from pdplug.protocols import KVReceiver as KVReceiver
from pdplug.protocols import KVSender as KVSender
from pdplug.protocols import PackPlanner as PackPlanner
from pdplug.protocols import Scheduler as Scheduler
from pdplug.types import ConsensusSpec as ConsensusSpec
from pdplug.types import KVLayout as KVLayout
from pdplug.types import KVPoll as KVPoll
from pdplug.types import KVSenderSpec as KVSenderSpec
from pdplug.types import PackPlannerSpec as PackPlannerSpec
from pdplug.types import SchedulerSpec as SchedulerSpec

__all__ = sorted(
    n for n, v in globals().items() if not n.startswith("_") and not isinstance(v, _ModuleType)
)

try:
    __version__ = _md.version("pdplug")
except _md.PackageNotFoundError:  # a source tree on PYTHONPATH has no metadata
    __version__ = "0+unknown"
