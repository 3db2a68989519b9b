"""``import_nixl`` finds NIXL's Python API under each wheel's module name (``nixl`` meta
package, ``nixl_cu12``, ``nixl_cu13``), the one matching torch's CUDA major first."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pdplug_nixl.engine import NIXL_MODULES, import_nixl


def _fake(monkeypatch: pytest.MonkeyPatch, present: tuple[str, ...]) -> None:
    """Only the packages in ``present`` import (as empty stand-in modules: nothing here runs
    NIXL); the others raise ImportError (``sys.modules[name] = None``)."""
    for mod in NIXL_MODULES:
        pkg = mod.split(".")[0]
        if pkg in present:
            api = types.ModuleType(mod)
            monkeypatch.setitem(sys.modules, pkg, types.ModuleType(pkg))
            monkeypatch.setitem(sys.modules, mod, api)
        else:
            monkeypatch.setitem(sys.modules, pkg, None)
            monkeypatch.setitem(sys.modules, mod, None)


def test_module_names() -> None:
    assert NIXL_MODULES == ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


@pytest.mark.parametrize(
    "present,cuda,found",
    [
        (("nixl_cu13",), None, "nixl_cu13._api"),  # the H200 machine: only the CUDA 13 wheel
        (("nixl_cu12", "nixl_cu13"), "12.8", "nixl_cu12._api"),
        (("nixl_cu12", "nixl_cu13"), "13.0", "nixl_cu13._api"),  # torch cu130: its wheel first
        (("nixl", "nixl_cu12", "nixl_cu13"), "13.0", "nixl._api"),  # the meta package wins
    ],
)
def test_import_nixl_finds_each_wheel(monkeypatch, present, cuda, found) -> None:
    _fake(monkeypatch, present)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert import_nixl().__name__ == found


def test_import_nixl_names_every_module_tried(monkeypatch) -> None:
    _fake(monkeypatch, ())
    with pytest.raises(ImportError) as e:
        import_nixl()
    assert all(f"{m}: " in str(e.value) for m in NIXL_MODULES)
