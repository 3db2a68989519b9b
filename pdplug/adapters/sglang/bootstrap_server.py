"""SGLang's bootstrap server for the pdplug backend: pdplug's rendezvous on the prefill's
``--disaggregation-bootstrap-port`` (SGLang's prefill server process)."""

from __future__ import annotations

import logging
import os

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from pdplug import bootstrap
from pdplug.adapters.sglang.settings import settings_from

__all__ = ["PdplugKVBootstrapServer"]

log = logging.getLogger(__name__)


class PdplugKVBootstrapServer(BaseKVBootstrapServer):
    """pdplug's rendezvous on SGLang's bootstrap port (prefill server process).

    :param host: SGLang's ``--host`` (the bind host unless ``PDPLUG_SGLANG_BIND_HOST``).
    :param port: ``--disaggregation-bootstrap-port``.
    :raises ValueError: socket settings that are inconsistent (no key off loopback ...).
    :raises zmq.ZMQError: the port is taken.
    """

    def __init__(self, host: str, port: int) -> None:
        self.settings = settings_from(os.environ, host=host, chunked_prefill_size=None)
        self.server = bootstrap.RendezvousServer(self.settings.net.wire, port=port).start()
        self.endpoint = self.server.endpoint
        log.info("pdplug: rendezvous for SGLang prefill ranks at %s", self.endpoint)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self.server.stop()
