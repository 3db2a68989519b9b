"""How to start SGLang servers here: an engine (single, prefill, decode) and SGLang's router.

One :class:`EngineSpec` per engine, one :class:`RouterSpec` for the router in front of a
prefill/decode pair; :func:`pdplug_engines.procs.launch` / :func:`pdplug_engines.procs.running`
start each in its own process group, wait for ``GET /health`` and stop the whole group.

Settings SGLang 0.5.23 needs on this CPU-only machine (measured here):

* ``SGLANG_USE_CPU_ENGINE=1`` (else ``is_cpu()`` is false and SGLang looks for CUDA) and the
  overlay folder first on ``PYTHONPATH`` (:mod:`pdplug_sglang.overlay`: the ``sgl_kernel``
  stand-in and the harness's CPU plugin);
* ``--device cpu --attention-backend torch_native --disable-cuda-graph
  --skip-tokenizer-init`` and ``--max-total-tokens`` (without it the KV pool takes most of
  the free memory: 14.8 GB here);
* decode: ``--disaggregation-decode-retraction-backup none`` (its default backup calls
  ``cudaHostRegister``); prefill: ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0`` (the
  early send of a cached prefix records a ``torch.cuda.Event``);
* ``--pp-size N`` with ``SGLANG_CPU_OMP_THREADS_BIND`` naming one core list per stage
  (``"0|1"``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import msgspec

__all__ = ["ROLES", "EngineSpec", "RouterSpec"]

#: an engine's role: a plain engine, or one side of a disaggregated pair
ROLES = ("single", "prefill", "decode")


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to start one ``python -m sglang.launch_server`` engine.

    :ivar name: label in logs and errors; the log file's name.
    :ivar model: checkpoint directory (:func:`pdplug_engines.tiny_model.build_tiny_llama`).
    :ivar port: HTTP port on 127.0.0.1.
    :ivar overlay: the folder from :func:`pdplug_sglang.overlay.write_overlay`.
    :ivar role: ``"single"``, ``"prefill"`` or ``"decode"``.
    :ivar backend: ``--disaggregation-transfer-backend`` (``"pdplug"``, ``"mooncake"``,
        ``"mooncake_tcp"``, ``"nixl"``); ignored for ``"single"``.
    :ivar bootstrap_port: the prefill's ``--disaggregation-bootstrap-port`` (the port the
        router hands decode as ``bootstrap_port``); 0 for other roles.
    :ivar pp_size: pipeline-parallel stages (one scheduler process each).
    :ivar cpu_cores: ``SGLANG_CPU_OMP_THREADS_BIND`` (one ``|``-separated core list per PP
        stage), or ``""`` for SGLang's choice; required when ``pp_size > 1``.
    :ivar max_total_tokens: KV pool size in tokens.
    :ivar page_size: KV page size in tokens (None: SGLang's default, 1).
    :ivar env: extra environment variables (pdplug's ``PDPLUG_*`` selections, ...).
    :ivar args: extra ``launch_server`` arguments.
    :ivar paths: folders put on ``PYTHONPATH`` after the overlay (e.g. a test's pdplug plugin
        with its ``.dist-info``).
    """

    name: str
    model: str
    port: int
    overlay: str
    role: str = "single"
    backend: str = ""
    bootstrap_port: int = 0
    pp_size: int = 1
    cpu_cores: str = ""
    max_total_tokens: int = 65536
    page_size: int | None = None
    env: dict[str, str] = {}
    args: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"EngineSpec.role={self.role!r} is not one of {ROLES}")
        if self.role != "single" and not self.backend:
            raise ValueError(f"EngineSpec.backend is empty for role={self.role!r}")
        if self.role == "prefill" and not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"EngineSpec.bootstrap_port={self.bootstrap_port} (prefill)")
        if self.pp_size < 1:
            raise ValueError(f"EngineSpec.pp_size={self.pp_size} < 1")
        if self.pp_size > 1 and len(self.cpu_cores.split("|")) != self.pp_size:
            raise ValueError(
                f"EngineSpec.cpu_cores={self.cpu_cores!r} needs one core list per PP stage "
                f"(pp_size={self.pp_size}), e.g. '0|1'"
            )

    @property
    def url(self) -> str:
        """Base URL of the engine's HTTP server."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server command line (run with this interpreter)."""
        cmd = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--skip-tokenizer-init", "--max-total-tokens", str(self.max_total_tokens),
        ]  # fmt: skip
        if self.page_size is not None:
            cmd += ["--page-size", str(self.page_size)]
        if self.pp_size > 1:
            cmd += ["--pp-size", str(self.pp_size)]
        if self.role != "single":
            cmd += [
                "--disaggregation-mode", self.role,
                "--disaggregation-transfer-backend", self.backend,
            ]  # fmt: skip
        if self.role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.role == "decode":
            cmd += ["--disaggregation-decode-retraction-backup", "none"]
        return cmd + list(self.args)

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The engine's environment: ``base``, the CPU engine switch, the overlay first on
        ``PYTHONPATH``, the prefill's cached-prefix switch, the core binding, then
        :attr:`env`. An ``SGLANG_PLUGINS`` allow list gets the harness plugin added."""
        from pdplug_sglang.overlay import PLUGIN_NAME

        env = dict(base)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = ":".join([self.overlay, *self.paths, *([path] if path else [])])
        if self.role == "prefill":
            env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] = "0"
        if self.cpu_cores:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = self.cpu_cores
            # a stage's process is bound to its core: OpenMP threads that spin between
            # kernels there starve the transfer engine's threads (Mooncake's TCP workers
            # stalled writes past 30 s at PP 2 here); passive waiting leaves them the core
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.update(self.env)
        allowed = env.get("SGLANG_PLUGINS", "")
        if allowed and PLUGIN_NAME not in allowed.split(","):
            env["SGLANG_PLUGINS"] = allowed + "," + PLUGIN_NAME
        return env


class RouterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's router in front of prefill and decode engines
    (``python -m sglang_router.launch_router --pd-disaggregation --mini-lb``: the Python
    load balancer, random pairing, which hands each request a fresh 63-bit
    ``bootstrap_room`` and posts it to both engines at once).

    :ivar port: HTTP port on 127.0.0.1.
    :ivar prefill: ``(url, bootstrap_port)`` per prefill engine.
    :ivar decode: URL per decode engine.
    :ivar timeout_s: the router's bound of one request (``--request-timeout-secs``).
    """

    port: int
    prefill: tuple[tuple[str, int], ...]
    decode: tuple[str, ...]
    name: str = "router"
    timeout_s: int = 600

    @property
    def url(self) -> str:
        """Base URL of the router."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The router command line."""
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--mini-lb", "--host", "127.0.0.1", "--port", str(self.port),
               "--request-timeout-secs", str(self.timeout_s)]  # fmt: skip
        for url, bport in self.prefill:
            cmd += ["--prefill", url, str(bport)]
        for url in self.decode:
            cmd += ["--decode", url]
        return cmd

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` unchanged."""
        return dict(base)
