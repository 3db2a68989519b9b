"""Describe the machine a benchmark ran on (printed and stored with every result)."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

import click

_F = TypeVar("_F", bound=Callable[..., Any])


def available_bytes() -> int:
    """Host memory available now, in bytes (``MemAvailable``; the free pages where
    ``/proc/meminfo`` cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_info() -> dict[str, Any]:
    """``{"cpu", "cores", "memory_gib", "python", "omp_wait_policy", "torch", "cuda"}`` of this
    machine (and process)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0.0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def machine_line() -> str:
    """One line for a benchmark header."""
    m = machine_info()
    gpu = f", GPU {m['cuda']}" if m.get("cuda") else ", no GPU"
    return (
        f"machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB{gpu}, "
        f"torch {m.get('torch')}, OMP_WAIT_POLICY={m['omp_wait_policy']}"
    )


def console() -> Any:
    """The reference host's console (:func:`pdplug_host.console.console`)."""
    from pdplug_host.console import console as host_console

    return host_console()


def _writable(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a ``--json`` path that cannot be written before the run, not after minutes of
    measuring: empty, a folder, a missing folder, or a file the open for append fails on (a
    real write test: permission bits say little to root, nothing about /proc)."""
    if value is None:
        return None
    if not value or value.endswith(os.sep) or os.path.isdir(value):
        raise click.BadParameter(f"{value!r}: expected a file path")
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"{value!r}: folder {folder} does not exist")
    existed = os.path.exists(value)
    try:
        with open(value, "a"):
            pass
    except OSError as e:
        raise click.BadParameter(f"{value!r}: not writable ({e.strerror})") from None
    if not existed:
        os.remove(value)
    return value


def writable_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--workdir`` callback: the folder is created if missing and must take a file, checked
    before the run (engines started in a folder nobody can write fail minutes later)."""
    if value is None:
        return None
    try:
        os.makedirs(value, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=value):
            pass
    except OSError as e:
        raise click.BadParameter(f"{value!r}: not a writable folder ({e.strerror})") from None
    return value


def json_option(fn: _F) -> _F:
    """The ``--json PATH`` option every benchmark takes (parameter ``json_path``); the path's
    folder must exist and be writable (checked before the run)."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False),
        default=None,
        callback=_writable,
        help="Write the results here.",
    )(fn)


def write_json(path: str, results: dict[str, Any]) -> None:
    """Write ``results`` with this machine's :func:`machine_info` under ``"machine"`` and the
    command's options as parsed under ``"options"`` unless ``results`` has its own (so a file
    says how it was made), and say where."""
    ctx = click.get_current_context(silent=True)
    options = {} if ctx is None else {"command": ctx.command_path, **ctx.params}
    with open(path, "w") as f:
        json.dump(
            {"options": options, **results, "machine": machine_info()}, f, indent=2, default=str
        )
    click.echo(f"wrote {path}")
