"""Meta-tests (datasette-style): every hook spec is documented parameter by parameter, and every
public name of the library has a docstring of its own (never one inherited from msgspec)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import pkgutil
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

import pdplug
import pdplug.testing
from pdplug import hookspecs
from pdplug.testing import undocumented

SPECS = sorted(n for n in dir(hookspecs) if n.startswith("pdplug_"))
# every library module; a package that cannot be imported here (torch missing) is still listed
MODULES = sorted(m.name for m in pkgutil.walk_packages(pdplug.__path__, "pdplug.", lambda _: None))


def test_the_hook_set_is_the_documented_one() -> None:
    assert SPECS == [
        "pdplug_check_compat",
        "pdplug_configure",
        "pdplug_on_event",
        "pdplug_register_consensus",
        "pdplug_register_kv_senders",
        "pdplug_register_pack_planners",
        "pdplug_register_schedulers",
    ]


@pytest.mark.parametrize("name", SPECS)
def test_hookspec_docstring_covers_every_parameter(name: str) -> None:
    fn = getattr(hookspecs, name)
    doc = fn.__doc__ or ""
    sig = inspect.signature(fn)
    assert doc, f"{name} has no docstring"
    assert "Called in:" in doc, f"{name}: say where and when it is called"
    assert ":returns:" in doc, f"{name}: document the return value"
    for p in sig.parameters:
        assert f":param {p}:" in doc, f"{name}: parameter {p!r} is undocumented"
        assert sig.parameters[p].annotation is not inspect.Parameter.empty, (name, p)
    if not sig.parameters:
        assert "Takes no parameters" in doc
    assert sig.return_annotation is not inspect.Signature.empty, name


def test_hookspecs_are_module_level_with_docstring_only_bodies() -> None:
    """pytest's style: no spec class, no ``raise NotImplementedError`` stubs."""
    src = inspect.getsource(hookspecs)
    assert "class " not in src and "NotImplementedError" not in src
    for name in SPECS:
        body = inspect.getsource(getattr(hookspecs, name)).split('"""')[-1]
        assert body.strip() == "", f"{name}: the body is its docstring only"


def test_registry_specs_state_the_trylast_default() -> None:
    for name in SPECS:
        if name.startswith("pdplug_register_"):
            assert "trylast" in (getattr(hookspecs, name).__doc__ or ""), name


def test_hook_markers() -> None:
    opts = {n: getattr(hookspecs, n).pdplug_spec for n in SPECS}
    assert opts["pdplug_configure"]["historic"] is True
    assert not any(o["firstresult"] for o in opts.values()), "every hook is a broadcast"


def test_an_undocumented_struct_is_caught() -> None:
    """``inspect.getdoc`` inherits msgspec.Struct's docstring; the check reads ``__doc__``."""

    class Undocumented(msgspec.Struct):
        x: int

        def method(self) -> int:
            return self.x

    mod = ModuleType("fake_public")
    mod.__all__ = ["Undocumented"]  # type: ignore[attr-defined]
    mod.Undocumented = Undocumented  # type: ignore[attr-defined]
    assert inspect.getdoc(Undocumented), "getdoc would have passed it"
    assert undocumented(mod) == ["Undocumented", "Undocumented.method"]


def test_a_type_alias_is_data_not_an_undocumented_class() -> None:
    """On Python 3.10 ``inspect.isclass(Callable[...])`` is True; an alias in ``__all__`` (like
    ``pdplug.transfer.Compat``) is documented by its ``#:`` comment, not a docstring."""
    mod = ModuleType("fake_public")
    mod.__all__ = ["Alias"]  # type: ignore[attr-defined]
    mod.Alias = Callable[[int], str]  # type: ignore[attr-defined]
    assert undocumented(mod) == []


@pytest.mark.parametrize("module", ["pdplug", *MODULES])
def test_public_names_have_their_own_docstrings(module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        # optional dependencies: torch (extra [torch]), vLLM and SGLang (their own installs, tox
        # envs vllm and sglang)
        if (e.name or "").split(".")[0] not in ("torch", "vllm", "sglang"):
            raise
        pytest.skip(f"{module} needs {e.name}")
    if hasattr(mod, "__all__"):
        assert undocumented(mod) == []


def test_every_all_name_exists() -> None:
    for mod in (pdplug, pdplug.testing):
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert missing == []


# --------------------------------------------------------------------------- a small public face


def test_the_public_face_is_small_and_derived_once() -> None:
    assert len(pdplug.__all__) <= 25, pdplug.__all__
    assert set(pdplug.__all__) >= {
        "PluginManager",
        "get_plugin_manager",
        "hookimpl",
        "KVPoll",
        "KVLayout",
        "Consensus",
        "KVSender",
        "KVReceiver",
        "PackPlanner",
        "Scheduler",
        "ConsensusConfig",
        "KVConfig",
        "ConsensusSpec",
        "KVSenderSpec",
        "PdplugError",
        "PluginError",
        "CompatError",
    }
    # wire structs and helpers stay in their modules
    assert not {"Codec", "Vote", "Decision", "ChunkTag", "merge_poll", "entry_map"} & set(
        pdplug.__all__
    )
    assert pdplug.__version__ == importlib.metadata.version("pdplug")


def test_import_pdplug_imports_no_plugin_no_app_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import pdplug"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    mods = {
        line.rsplit("|", 1)[-1].strip()
        for line in out.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "pdplug" in mods and "pluggy" in mods
    heavy = {"torch", "triton", "nixl", "nixl_cu12", "mooncake"}
    ours = {m for m in mods if m.split(".")[0].startswith("pdplug_")}  # plugins and apps
    assert not ({m.split(".")[0] for m in mods} & heavy) and not ours, sorted(mods)


def test_pdplug_testing_without_pytest_says_how_to_install_it() -> None:
    code = "import sys; sys.modules['pytest'] = None; import pdplug.testing"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert 'pip install "pdplug[testing]"' in out.stderr, out.stderr


# --------------------------------------------------------------------------- docs that ship

#: every top-level package the distribution installs: the library, its plugins and its apps
TOP_LEVEL = sorted(importlib.metadata.distribution("pdplug").read_text("top_level.txt").split())
#: files that do not ship with the package; cite a paper, PR or issue number instead
OFF_TREE = re.compile(r"DESIGN\.md|prior-art|/shared/|\bshared/(cases|notes)")
#: Google-style section headers; the one docstring style is Sphinx fields (``:param x:``)
GOOGLE = re.compile(r"^\s*(Args|Arguments|Returns|Raises|Yields):\s*$")


def _installed_sources() -> list[Path]:
    files: list[Path] = []
    for top in TOP_LEVEL:
        spec = importlib.util.find_spec(top)  # locates the package without importing it
        assert spec is not None and spec.submodule_search_locations, top
        for root in spec.submodule_search_locations:
            files += sorted(Path(root).rglob("*.py"))
    return files


def test_sources_cite_nothing_outside_the_package() -> None:
    assert {"pdplug", "pdplug_dcp", "pdplug_host"} <= set(TOP_LEVEL), TOP_LEVEL
    sources = _installed_sources()
    assert len(sources) > 50, "the walk found the package sources"
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OFF_TREE.search(line)
    ]
    assert hits == [], "\n".join(hits)


def test_one_docstring_style_sphinx_fields() -> None:
    hits = [
        f"{path}:{n}: {line.strip()}"
        for path in _installed_sources()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if GOOGLE.match(line)
    ]
    assert hits == [], "use :param x: / :returns: / :raises E: instead:\n" + "\n".join(hits)
