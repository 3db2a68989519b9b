"""SGLang's transfer-backend classes on pdplug's parts: what ``get_kv_class(PDPLUG, ...)``
returns (this module is SGLang's import path for them; each lives in its own module).

* :class:`PdplugKVBootstrapServer` (:mod:`~pdplug.adapters.sglang.bootstrap_server`, prefill
  server process): pdplug's rendezvous on ``--disaggregation-bootstrap-port``.
* :class:`PdplugKVManager` (:mod:`~pdplug.adapters.sglang.manager`, one per scheduler
  process): one pdplug KV sender (prefill) or receiver (decode) per plane and the rank's rooms.
* :class:`PdplugKVSender` / :class:`PdplugKVReceiver` (:mod:`~pdplug.adapters.sglang.sender`,
  :mod:`~pdplug.adapters.sglang.receiver`, one per request): SGLang's ``BaseKVSender`` /
  ``BaseKVReceiver`` calls (``docs/sglang-backend.md`` section 2) mapped onto the planes' rooms.

Importing it checks the installed SGLang release first (``GATE``): an unsupported one raises
``ImportError`` with the reason.

Not done: speculative draft KV, decode host destinations, staging buffers, prefill CP, state
planes with PP > 1, heterogeneous KV-TP (the KV plane moves token rows between equal KV-TP
sizes); each is refused with a message naming it.
"""

from __future__ import annotations

import sglang  # noqa: F401  (absent: ModuleNotFoundError naming sglang)

from pdplug.adapters.sglang import GATE

GATE.require(GATE.installed())  # an unsupported release: ImportError with the reason

from pdplug.adapters.sglang.bootstrap_server import PdplugKVBootstrapServer  # noqa: E402
from pdplug.adapters.sglang.common import DIRECTORY  # noqa: E402
from pdplug.adapters.sglang.manager import PdplugKVManager  # noqa: E402
from pdplug.adapters.sglang.receiver import PdplugKVReceiver  # noqa: E402
from pdplug.adapters.sglang.sender import PdplugKVSender  # noqa: E402

__all__ = [
    "DIRECTORY",
    "PdplugKVBootstrapServer",
    "PdplugKVManager",
    "PdplugKVReceiver",
    "PdplugKVSender",
]
