"""The demo's options and every check made on them before a worker starts (torch-free).

Each size has a bound and each wait a limit; a violation is refused in one line that names the
command-line option (``--prefill-pp``) and the bound, seconds after the command starts, instead
of failing later inside a worker or waiting silently.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from pdplug.manager import EXTENSION_POINTS
from pdplug_host.config import ModelConfig, layer_split, pages_needed
from pdplug_host.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

__all__ = [
    "BOUNDS",
    "DEFAULT_REQUESTS",
    "SCALES",
    "DemoError",
    "DemoOptions",
    "check_device",
    "check_options",
    "check_schedule",
    "check_sizes",
    "kv_memory_bytes",
    "load_requests",
    "need_torch",
    "refusals",
    "refuse",
    "selected_names",
]

log = logging.getLogger("pdplug_host.driver")

#: requests replayed when ``DemoOptions.requests`` is None
DEFAULT_REQUESTS = 32
#: trace scales that work with the demo's 16-token page: 512 / scale is a whole number of pages
SCALES = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if (512 // s) % 16 == 0)

#: inclusive bounds of the sizes and waits, by ``DemoOptions`` field (the CLI uses the same)
BOUNDS: dict[str, tuple[float, float]] = {
    "prefill_pp": (1, ModelConfig().num_layers),  # one PP rank needs at least one layer
    "decode_dcp": (1, 16),  # one process per rank
    "max_output": (1, 1024),
    "chunk_size": (1, 4096),
    "pack_region_tokens": (1, 65536),
    "num_pages": (16, 1 << 20),
    "timeout_s": (1.0, 3600.0),
    "run_timeout_s": (10.0, 86400.0),
    "time_scale": (0.0, 1000.0),
}

#: command-line spelling of each field (error messages name the option the user typed)
FLAGS: dict[str, str] = {
    "prefill_pp": "--prefill-pp",
    "decode_dcp": "--decode-dcp",
    "requests": "--requests",
    "scale": "--scale",
    "max_output": "--max-output",
    "chunk_size": "--chunk-size",
    "pack_region_tokens": "--pack-region-tokens",
    "num_pages": "--num-pages",
    "timeout_s": "--timeout",
    "run_timeout_s": "--run-timeout",
    "time_scale": "--time-scale",
    "page_size": "page_size",
}

#: share of physical memory the demo's KV caches and pack regions may take together
MEMORY_SHARE = 0.5


class DemoError(RuntimeError):
    """The run could not start or complete (a refused option, a worker that died or reported a
    fatal error, or a timeout); the message says which, in one line."""


class DemoOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options of ``pdplug demo`` / ``pdplug bench e2e`` (see ``pdplug demo --help``).

    :ivar requests: requests replayed from the trace; ``None``: the first
        :data:`DEFAULT_REQUESTS` (all of a shorter trace, without a note).
    :ivar scale: trace lengths are divided by this (one of :data:`SCALES`).
    :ivar time_scale: arrival times (seconds) are multiplied by this; 0 = as fast as admitted.
    :ivar num_pages: KV pages per worker (prefill: its layers; decode: all layers).
    :ivar timeout_s: bound on every wait inside the workers (transfer, consensus, gloo,
        a decode waiting for pages with none freed), seconds.
    :ivar run_timeout_s: bound on the whole replay, seconds.
    :ivar log_dir: worker logs; ``None``: a fresh temp dir, removed after a clean run unless
        ``keep_logs``; ``""``: the workers write to this process's stderr.
    :ivar device: ``"cpu"`` or ``"cuda"``: where every worker keeps the model, its KV cache and
        the pack buffer (``cuda``: NIXL registers VRAM, the Triton packer packs).
    """

    prefill_pp: int = 2
    decode_dcp: int = 2
    requests: int | None = None
    trace: str | None = None
    scale: int = 32
    max_output: int = 16
    time_scale: float = 1.0
    consensus: str | None = None
    kv_sender: str | None = None
    pack_planner: str | None = None
    scheduler: str | None = None
    page_size: int = 16
    chunk_size: int = 128
    pack_region_tokens: int = 64
    num_pages: int = 4096
    timeout_s: float = 30.0
    run_timeout_s: float = 600.0
    reference: bool = True
    profile: bool = True
    log_dir: str | None = None
    keep_logs: bool = False
    device: str = "cpu"


def _flag(field: str) -> str:
    return FLAGS.get(field, field)


def kv_memory_bytes(opts: DemoOptions, model: ModelConfig | None = None) -> int:
    """Bytes the run's KV caches and pack regions take, over every worker.

    Every prefill rank holds ``num_pages`` pages of its layers (so all PP ranks together hold
    the whole model's) and ``decode_dcp`` destinations x 2 pack regions of
    ``pack_region_tokens`` tokens of its layers; every decode rank holds ``num_pages`` pages of
    all layers.
    """
    cfg = model or ModelConfig()
    row = cfg.kv_bytes_per_token * 2 * cfg.num_layers  # K and V of every layer, one token
    kv = opts.num_pages * opts.page_size * row * (1 + opts.decode_dcp)
    pack = opts.pack_region_tokens * row * opts.decode_dcp * 2
    return kv + pack


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_sizes(opts: DemoOptions) -> None:
    """Refuse sizes and waits out of their bounds, before any worker starts.

    :raises DemoError: the first field out of :data:`BOUNDS`, a scale not in :data:`SCALES`,
        ``--requests`` < 1, a profile chunk (4 x ``chunk_size`` tokens) larger than the KV cache,
        or KV caches and pack regions over half of this machine's memory; the message names
        the option, the value and the bound.
    """
    for field, (lo, hi) in BOUNDS.items():
        v = getattr(opts, field)
        if not lo <= v <= hi:
            raise DemoError(f"{_flag(field)} {v}: must be in {lo:g}..{hi:g}")
    if opts.requests is not None and opts.requests < 1:
        raise DemoError(f"--requests {opts.requests}: must be >= 1")
    if opts.page_size < 1:
        raise DemoError(f"page_size {opts.page_size}: must be >= 1")
    if opts.pack_region_tokens < opts.page_size:
        raise DemoError(
            f"--pack-region-tokens {opts.pack_region_tokens}: must be at least one page "
            f"({opts.page_size} tokens)"
        )
    if opts.log_dir:
        d = os.path.abspath(opts.log_dir)
        if os.path.exists(d) and not os.path.isdir(d):
            raise DemoError(f"--log-dir {opts.log_dir}: not a directory")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise DemoError(f"--log-dir {opts.log_dir}: cannot create it ({e.strerror})") from e
        if not os.access(d, os.W_OK):
            raise DemoError(f"--log-dir {opts.log_dir}: not writable")
    block = TRACE_BLOCK_TOKENS // opts.scale if opts.scale >= 1 else 0
    if (
        opts.scale < 1
        or TRACE_BLOCK_TOKENS % opts.scale
        or block < opts.page_size
        or block % opts.page_size
    ):
        good = [s for s in SCALES if (TRACE_BLOCK_TOKENS // s) % opts.page_size == 0]
        raise DemoError(
            f"--scale {opts.scale}: must be one of {', '.join(map(str, good))} (a 512-token "
            f"trace block must become a whole number of {opts.page_size}-token pages)"
        )
    cache_tokens = opts.num_pages * opts.page_size
    if opts.profile and 4 * opts.chunk_size > cache_tokens:
        raise DemoError(
            f"--chunk-size {opts.chunk_size}: the chunk-model profile runs up to "
            f"{4 * opts.chunk_size} tokens, more than the {cache_tokens}-token KV cache "
            f"(--num-pages {opts.num_pages})"
        )
    mem, total = kv_memory_bytes(opts), _physical_memory()
    if total is not None and mem > MEMORY_SHARE * total:
        raise DemoError(
            f"--num-pages {opts.num_pages}, --pack-region-tokens {opts.pack_region_tokens}, "
            f"--decode-dcp {opts.decode_dcp}: KV caches and pack regions would take "
            f"{mem / 2**30:.1f} GiB, over half of this machine's {total / 2**30:.1f} GiB"
        )


def refusals(opts: DemoOptions, requests: Sequence[TraceRequest]) -> dict[int, str]:
    """Requests that can never fit the KV cache, each with the reason (they are refused alone;
    the others run).

    A prompt needs ``ceil(input_len / page_size)`` pages on every prefill rank; a decode rank
    holds its share of prompt and output, ``ceil((input_len + output_len) / (page_size *
    decode_dcp))`` pages.
    """
    out: dict[int, str] = {}
    vpage = opts.page_size * opts.decode_dcp
    for r in requests:
        pre = pages_needed(r.input_len, opts.page_size)
        dec = pages_needed(r.input_len + r.output_len, vpage)
        if pre > opts.num_pages:
            out[r.rid] = (
                f"its {r.input_len}-token prompt needs {pre} KV pages on a prefill rank, the "
                f"cache has {opts.num_pages} (--num-pages)"
            )
        elif dec > opts.num_pages:
            out[r.rid] = (
                f"its {r.input_len}+{r.output_len} tokens need {dec} KV pages on a decode rank, "
                f"the cache has {opts.num_pages} (--num-pages)"
            )
    return out


def check_schedule(opts: DemoOptions, requests: Sequence[TraceRequest]) -> None:
    """Refuse a replay whose arrivals cannot all happen within the run limit.

    :raises DemoError: the last arrival (trace time x ``time_scale``) lies past
        ``run_timeout_s``; the message names both options and a ``--time-scale`` that fits.
    """
    if opts.time_scale <= 0 or not requests:
        return
    times = [r.arrival_ms for r in requests]
    span_s = (max(times) - min(times)) / 1000.0
    last = span_s * opts.time_scale
    if last >= opts.run_timeout_s:
        fit = 0.5 * opts.run_timeout_s / span_s
        raise DemoError(
            f"the trace's last request arrives {last:.0f} s after the first (--time-scale "
            f"{opts.time_scale:g}), past --run-timeout {opts.run_timeout_s:g} s; use "
            f"--time-scale {fit:.3g} or less, --no-arrivals, or a longer --run-timeout"
        )


def selected_names(opts: DemoOptions) -> dict[str, str]:
    """Explicit selections only (``None`` options fall back to ``PDPLUG_*`` / the defaults in
    every worker, exactly as in this process)."""
    chosen = {point: getattr(opts, point) for point in EXTENSION_POINTS}
    return {k: v for k, v in chosen.items() if v}


def check_device(opts: DemoOptions) -> None:
    """Refuse ``--device cuda`` where torch sees no CUDA device (one line naming the option).

    :raises DemoError: an unknown device, or ``cuda`` without a CUDA device.
    """
    if opts.device == "cpu":
        return
    if opts.device != "cuda":
        raise DemoError(f"--device {opts.device}: must be cpu or cuda")
    try:
        import torch
    except ImportError as e:
        raise DemoError(f"--device cuda: torch is not importable ({e})") from e
    if not torch.cuda.is_available():
        raise DemoError(
            "--device cuda: no CUDA device on this machine (torch.cuda.is_available() is "
            "False); run with --device cpu"
        )


def check_options(opts: DemoOptions) -> None:
    """Refuse a configuration before any worker starts (seconds, not a timeout later).

    Checks every size and wait against its bound (:func:`check_sizes`),
    resolves every selected name through the plugin manager and dry-runs the pack planner on
    the demo's prefill and decode layouts, so e.g. the identity ``tp`` planner with a DCP
    decode is refused with the planner's own message.

    :raises DemoError: a size or wait out of bounds, an unknown/blocked/failed component, or a
        planner that cannot plan for this prefill PP / decode DCP geometry.
    """
    from pdplug import KVLayout, PdplugError, PlannerConfig, PluginManager
    from pdplug.types import SendChunk

    check_sizes(opts)
    check_device(opts)
    try:  # a manager of its own, as every worker builds: this environment's switches apply
        pm = PluginManager()
    except PdplugError as e:
        raise DemoError(str(e)) from e
    names = selected_names(opts)
    try:
        for point in EXTENSION_POINTS:
            pm.resolve(point, names.get(point))
        planner = pm.make_pack_planner(PlannerConfig(), name=names.get("pack_planner"))
        cfg = ModelConfig()
        lo, hi = layer_split(cfg.num_layers, opts.prefill_pp)[0]
        bpt = (cfg.kv_bytes_per_token,)
        src = KVLayout(
            page_size=opts.page_size,
            entry_bytes_per_token=bpt * 2 * (hi - lo),
            dtype=cfg.dtype,
            pp_size=opts.prefill_pp,
            first_layer=lo,
            num_layers=hi - lo,
        )
        n = opts.page_size * opts.decode_dcp
        pages = np.arange(1, dtype=np.int64)
        for r in range(opts.decode_dcp):
            dst = KVLayout(
                page_size=opts.page_size,
                entry_bytes_per_token=bpt * 2 * cfg.num_layers,
                dtype=cfg.dtype,
                dcp_size=opts.decode_dcp,
                dcp_rank=r,
                num_layers=cfg.num_layers,
            )
            chunk = SendChunk(
                room=0, src_pages=np.arange(opts.decode_dcp), dst_pages=pages, num_tokens=n
            )
            planner.plan(chunk, src, dst, r, None)
    except PdplugError as e:
        raise DemoError(str(e)) from e


def need_torch() -> None:
    """:raises DemoError: torch is not installed (the workers and the reference need it)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise DemoError("the demo needs torch: pip install 'pdplug[torch]' (or torch itself)")


def load_requests(opts: DemoOptions) -> list[TraceRequest]:
    """The requests of the run: the first ``opts.requests`` (default :data:`DEFAULT_REQUESTS`)
    of the trace, scaled; a ``warning`` log line when ``--requests`` asked for more than the
    trace has.

    :raises DemoError: the trace cannot be read or parsed (the message names the file and the
        expected format), or has no requests.
    """
    path = Path(opts.trace) if opts.trace else None
    limit = opts.requests if opts.requests is not None else DEFAULT_REQUESTS
    try:
        requests = load_trace(path, limit=limit, scale=opts.scale, max_output=opts.max_output)
    except (OSError, ValueError) as e:  # TraceFormatError is a ValueError
        raise DemoError(f"cannot load the trace: {e}") from e
    if not requests:
        raise DemoError(f"the trace {opts.trace or '(bundled sample)'} has no requests")
    if opts.requests is not None and len(requests) < opts.requests:
        log.warning(
            "the trace has %d requests; replaying all of them (--requests %d)",
            len(requests),
            opts.requests,
        )
    return requests


def refuse(opts: DemoOptions, requests: list[TraceRequest]) -> dict[int, str]:
    """:func:`refusals`, with one ``warning`` log line naming the first refused request.

    :raises DemoError: no request fits at all.
    """
    refused = refusals(opts, requests)
    if refused and len(refused) == len(requests):
        rid, why = next(iter(refused.items()))
        raise DemoError(f"no request fits the KV cache: request {rid}: {why}")
    if refused:
        rid, why = next(iter(refused.items()))
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        log.warning(
            "request %d is refused: %s%s; the other %d run",
            rid,
            why,
            more,
            len(requests) - len(refused),
        )
    return refused
