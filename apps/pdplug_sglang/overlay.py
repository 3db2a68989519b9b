"""The folder the harness puts first on its SGLang engines' ``PYTHONPATH``.

It holds two things, both only for the processes the harness starts (nothing is installed
into site-packages):

* an ``sgl_kernel`` package that re-exports :mod:`pdplug_sglang.cpu_kernel` (SGLang's CPU
  engine imports ``sgl_kernel`` and PyPI has no CPU build of it);
* a ``.dist-info`` folder whose ``entry_points.txt`` declares
  :func:`pdplug_sglang.cpu_patches.register` in SGLang's ``sglang.srt.plugins`` group:
  ``importlib.metadata`` finds distributions on every ``sys.path`` entry, so SGLang's own
  ``load_plugins`` runs it in each engine process. Its entry-point name is
  :data:`PLUGIN_NAME`; an engine started with ``SGLANG_PLUGINS`` must list it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["PLUGIN_NAME", "write_overlay"]

#: the harness plugin's name in SGLang's ``sglang.srt.plugins`` group
PLUGIN_NAME = "pdplug-sglang-cpu"

_DIST = "pdplug_sglang_cpu_overlay-0.0.0.dist-info"

_KERNEL = '''"""CPU stand-in for sgl_kernel (written by pdplug_sglang.overlay)."""
from pdplug_sglang.cpu_kernel import __getattr__, __version__, assign_req_to_token_pool_cpu

__all__ = ["assign_req_to_token_pool_cpu"]
'''


def write_overlay(directory: str | Path) -> Path:
    """Write the overlay into ``directory`` (created; files rewritten) and return it.

    :param directory: a folder owned by the run (e.g. inside its log folder).
    :returns: the folder, to put first on the engines' ``PYTHONPATH``.
    """
    root = Path(directory)
    (root / "sgl_kernel").mkdir(parents=True, exist_ok=True)
    (root / "sgl_kernel" / "__init__.py").write_text(_KERNEL)
    dist = root / _DIST
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pdplug-sglang-cpu-overlay\nVersion: 0.0.0\n"
        "Summary: pdplug's SGLang harness: CPU workarounds (not installed)\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[sglang.srt.plugins]\n{PLUGIN_NAME} = pdplug_sglang.cpu_patches:register\n"
    )
    return root
