"""Meta-tests (datasette-style): every hook spec is documented parameter by parameter, and every
public name of pdplug has a docstring."""

from __future__ import annotations

import inspect

import pytest

import pdplug
import pdplug.testing
from pdplug.hookspecs import PdplugSpecs

SPECS = sorted(n for n in dir(PdplugSpecs) if n.startswith("pdplug_"))


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
    fn = getattr(PdplugSpecs, name)
    doc = inspect.getdoc(fn) or ""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters if p != "self"]
    assert doc, f"{name} has no docstring"
    assert "Called in:" in doc, f"{name}: say where and when it is called"
    assert ":returns:" in doc, f"{name}: document the return value"
    for p in params:
        assert f":param {p}:" in doc, f"{name}: parameter {p!r} is undocumented"
        assert sig.parameters[p].annotation is not inspect.Parameter.empty, (name, p)
    if not params:
        assert "Takes no parameters" in doc
    assert sig.return_annotation is not inspect.Signature.empty, name


def test_hook_markers() -> None:
    opts = {n: getattr(PdplugSpecs, n).pdplug_spec for n in SPECS}
    assert opts["pdplug_configure"]["historic"] is True
    assert not any(o["firstresult"] for o in opts.values()), "every hook is a broadcast"


def _public(module: object) -> list[tuple[str, object]]:
    return [(n, getattr(module, n)) for n in module.__all__]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "obj"),
    [*_public(pdplug), *[(f"testing.{n}", o) for n, o in _public(pdplug.testing)]],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_public_names_have_docstrings(name: str, obj: object) -> None:
    if isinstance(obj, str | int | float | tuple | dict | frozenset):
        return  # data (__version__, STREAMS …) is documented where it is defined
    doc = inspect.getdoc(obj)
    assert doc and len(doc.strip()) > 10, f"{name} has no docstring"
    if inspect.isclass(obj):
        for meth, fn in vars(obj).items():
            if callable(fn) and not meth.startswith("_") and inspect.isfunction(fn):
                assert inspect.getdoc(fn), f"{name}.{meth} has no docstring"


def test_every_all_name_exists() -> None:
    for mod in (pdplug, pdplug.testing):
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert missing == []
