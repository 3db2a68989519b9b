"""The demos' summary table of a parity run on real engines: the reference demo's rows (same
names and meanings) that an engine pair measures; rows only the reference host measures (the
TTFT breakdown, prefill chunk sizes) are left out, the engines keep them inside.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ParitySummary", "parity_table", "print_parity_report"]


class ParitySummary(Protocol):
    """What the table reads from a parity run (e.g. :class:`pdplug_vllm.parity.ParityResult`);
    times in seconds, bytes in bytes."""

    @property
    def requests(self) -> int:
        """Requests sent on each path."""

    @property
    def max_tokens(self) -> int:
        """Tokens generated per request."""

    @property
    def identical(self) -> int:
        """Requests whose tokens equal the single engine's."""

    @property
    def failed(self) -> list[tuple[int, str]]:
        """Failed requests (index, reason)."""

    @property
    def differ(self) -> list[tuple[int, int, int]]:
        """Differing requests (index, first differing position, prompt tokens)."""

    @property
    def kv_bytes(self) -> int:
        """KV bytes the transfer reported moving."""

    @property
    def kv_bytes_min(self) -> int:
        """Fewest bytes the prompts need."""

    @property
    def kv_bytes_max(self) -> int:
        """Most bytes the prompts need."""

    @property
    def bytes_ok(self) -> bool:
        """``kv_bytes`` is whole units inside what the prompts need."""

    @property
    def ttft_p50_s(self) -> float:
        """TTFT p50 of the disaggregated path."""

    @property
    def ttft_p99_s(self) -> float:
        """TTFT p99 of the disaggregated path."""

    @property
    def single_ttft_p50_s(self) -> float:
        """TTFT p50 of the single engine."""

    @property
    def throughput_rps(self) -> float:
        """Disaggregated requests per second."""

    @property
    def disagg_run_s(self) -> float:
        """Wall time of the disaggregated request phase."""

    @property
    def start_s(self) -> float:
        """Launch to every engine ready."""


def parity_table(
    res: ParitySummary,
    *,
    title: str,
    caption: str,
    scale: int,
    per_token_bytes: int,
    engine: str,
    front: str = "pdplug proxy",
    via: str = "the proxy",
    engines: str = "all three engines",
) -> Any:
    """The summary table (a ``rich.table.Table``) of ``res``.

    :param scale: the trace scale (a 512-token trace block -> ``512 // scale`` tokens).
    :param per_token_bytes: KV bytes of one token (the ``tokens transferred`` row).
    :param engine: the engine's name in the rows (``"vLLM"``).
    :param front: what clients talk to (TTFT row: ``client -> <front> -> first token``).
    :param via: the same, in the throughput row (``... s through <via>``).
    :param engines: which engines the ``engines up`` row waited for.
    """
    from rich.table import Table

    t = Table(title=title, caption=caption, show_header=False)
    t.add_column("", style="bold")
    t.add_column("", no_wrap=True)
    t.add_column("", style="dim")
    n = res.requests
    t.add_row("requests", str(n), f"inputs scaled 1/{scale} (a 512-token trace block -> "
              f"{512 // scale} tokens), outputs capped at {res.max_tokens} tokens")  # fmt: skip
    t.add_row("parity OK", f"{res.identical} / {n}",
              f"requests whose every token equals the single {engine} engine's")  # fmt: skip
    t.add_row("tokens transferred", str(res.kv_bytes // per_token_bytes if per_token_bytes else 0),
              "tokens whose KV crossed to decode (whole blocks, warm-up included)")  # fmt: skip
    t.add_row("bytes transferred", f"{res.kv_bytes / 2**20:.1f} MiB",
              f"checked: {res.kv_bytes_min:,}..{res.kv_bytes_max:,} bytes needed "
              f"({'ok' if res.bytes_ok else 'OUTSIDE'})")  # fmt: skip
    t.add_row("TTFT p50 / p99", f"{res.ttft_p50_s * 1e3:.1f} / {res.ttft_p99_s * 1e3:.1f} ms",
              f"client -> {front} -> first token streamed by the decode engine")  # fmt: skip
    t.add_row("  single engine TTFT p50", f"{res.single_ttft_p50_s * 1e3:.1f} ms",
              f"the same requests on one {engine} engine (no transfer)")  # fmt: skip
    t.add_row("throughput", f"{res.throughput_rps:.2f} req/s",
              f"{n} requests in {res.disagg_run_s:.1f} s through {via}")  # fmt: skip
    t.add_row("engines up", f"{res.start_s:.0f} s", f"launch to {engines} ready")
    return t


def print_parity_report(res: ParitySummary, table: Any, console: Any) -> None:
    """Print ``table`` and the first 5 failed and differing requests of ``res``."""
    console.print(table)
    for i, why in res.failed[:5]:
        console.print(f"request {i} failed: {why}", markup=False)
    for i, pos, n in res.differ[:5]:
        console.print(
            f"request {i} ({n} prompt tokens) differs from the single engine at token {pos}"
        )
