"""pdplug.packing is a package of small modules with one job each, and re-exports every public
name it had as one module (issue 24): ``from pdplug.packing import X`` keeps working."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import pdplug.packing

#: the submodules, found by walking the package (a new one is covered without editing this)
SUBMODULES = sorted(m.name for m in pkgutil.iter_modules(pdplug.packing.__path__))
#: the public names of pdplug.packing when it was one module (before issue 24)
PUBLIC = [
    "sharded_entries",
    "pack_bytes_per_token",
    "region_capacity_tokens",
    "pack_buffer_nbytes",
    "pack_regions",
    "region_index",
    "send_capacity_tokens",
    "merge_runs",
    "run_addresses",
    "MAX_PAGE_ID",
    "page_array",
    "segment_to_chunk",
    "segment_chunks",
    "pack_groups",
    "group_rows",
    "plan_all_ranks",
    "plan_segment",
    "pack_segment",
]
#: importable from the package but never in its ``__all__`` (the sender's pipeline uses them)
EXTRA = ["REGION_ALIGN", "plan_addresses", "source_table", "DirectRuns"]


def test_the_package_has_its_modules() -> None:
    assert set(SUBMODULES) >= {"regions", "pages", "chunks", "runs", "addresses", "groups"}


@pytest.mark.parametrize("name", SUBMODULES)
def test_packing_modules_are_small_and_say_their_job(name: str) -> None:
    mod = importlib.import_module(f"pdplug.packing.{name}")
    lines = Path(str(mod.__file__)).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 460, (name, len(lines))
    first = (mod.__doc__ or "").strip().splitlines()[0]
    assert first.endswith(".") and ":" in first and len(first) > 30, (name, first)
    assert mod.__all__, name


def test_the_package_reexports_exactly_the_old_public_names() -> None:
    assert pdplug.packing.__all__ == PUBLIC
    owner = {}
    for name in SUBMODULES:
        mod = importlib.import_module(f"pdplug.packing.{name}")
        for public in mod.__all__:
            assert public not in owner, (public, owner.get(public), name)
            owner[public] = mod
    assert set(owner) == set(PUBLIC) | set(EXTRA), sorted(set(owner) ^ set(PUBLIC + EXTRA))
    for public, mod in owner.items():
        # the very object, not a copy: one definition of each name
        assert getattr(pdplug.packing, public) is getattr(mod, public), public


@pytest.mark.parametrize("name", SUBMODULES)
def test_a_packing_module_never_imports_the_package_itself(name: str) -> None:
    path = Path(pdplug.packing.__path__[0]) / f"{name}.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            assert node.module != "pdplug.packing", (name, ast.unparse(node))
