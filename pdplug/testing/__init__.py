"""Opt-in test helpers for plugin authors (not a ``pytest11`` plugin: never loads by itself).

Use in a plugin's test suite::

    # conftest.py
    pytest_plugins = ["pdplug.testing"]          # provides the ``plugin_manager`` fixture

    # test_mine.py
    import my_plugin

    def test_registers(plugin_manager):
        plugin_manager.register(my_plugin, name="my-plugin")
        assert "mine" in plugin_manager.names("consensus")

or without fixtures: ``pm = make_plugin_manager(("my-plugin", my_plugin))``.

A fresh manager loads the defaults through the installed ``pdplug`` entry points, with
third-party autoload off and strict mode on, and never reads ``os.environ`` (pass ``env=`` to
test a switch). :func:`fake_entry_point` builds real :class:`importlib.metadata.EntryPoint`
objects of a fake distribution, for discovery tests (pluggy's and pytest's technique).
:func:`require` implements the ``PDPLUG_REQUIRE`` rule for tests that need nixl, mooncake or
triton. :func:`fake_layout` / :func:`fake_layouts` / :func:`fake_kv` build small KV geometries.
:func:`undocumented` is a meta-test helper: the public names of a module that have no
docstring of their own.

Needs pytest: ``pip install "pdplug[testing]"``.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

import numpy as np

try:
    import pytest
except ImportError as _e:  # an install without the testing extra
    raise ImportError(
        'pdplug.testing needs pytest: pip install "pdplug[testing]" '
        f"(importing pytest failed: {_e})"
    ) from _e

from pdplug.hookspecs import hookimpl
from pdplug.manager import PluginManager, discover_entry_points
from pdplug.testing.netns.probe import netns_cluster
from pdplug.testing.require import (
    BACKEND_MODULES,
    REQUIRE_ENV,
    probe_module,
    require,
    required_modules,
)
from pdplug.types import KVLayout, PdplugEvent, PeerInfo

__all__ = [
    "REQUIRE_ENV",
    "BACKEND_MODULES",
    "required_modules",
    "probe_module",
    "require",
    "FakeDistribution",
    "fake_entry_point",
    "make_plugin_manager",
    "plugin_manager",
    "fake_layout",
    "fake_layouts",
    "fake_kv",
    "fake_peer",
    "EventLog",
    "undocumented",
    "netns_cluster",
]


class FakeDistribution(md.Distribution):
    """An in-memory distribution with a name, a version and ``pdplug`` entry points.

    :param name: distribution name (as in ``pyproject.toml``).
    :param version: its version string.
    :param entry_points: ``entry-point name -> "module"`` of the ``pdplug`` group.
    """

    def __init__(
        self, name: str, version: str = "0.0.1", entry_points: Mapping[str, str] | None = None
    ) -> None:
        entry_points = entry_points or {}
        self._files = {
            "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            "entry_points.txt": "[pdplug]\n"
            + "".join(f"{k} = {v}\n" for k, v in entry_points.items()),
        }

    def read_text(self, filename: str) -> str | None:
        """Contents of a metadata file (``METADATA``, ``entry_points.txt``) or ``None``."""
        return self._files.get(filename)

    def locate_file(self, path: Any) -> Any:
        """Fake distributions have no files on disk."""
        raise FileNotFoundError(path)


def fake_entry_point(
    name: str, value: str, *, dist: str = "pdplug-fake", version: str = "0.0.1"
) -> md.EntryPoint:
    """A real ``pdplug`` :class:`~importlib.metadata.EntryPoint` whose ``.dist`` is fake.

    :param name: entry-point name (conventionally the distribution name).
    :param value: ``"module"`` (or ``"module:attr"``) loaded by ``ep.load()``.
    :param dist: distribution name reported in listings and errors.
    :param version: distribution version.
    """
    (ep,) = FakeDistribution(dist, version, {name: value}).entry_points
    return ep


def make_plugin_manager(
    *plugins: object | tuple[str, object],
    env: Mapping[str, str] | None = None,
    entry_points: Iterable[md.EntryPoint] | None = None,
    strict: bool = True,
    **kwargs: Any,
) -> PluginManager:
    """A fresh :class:`~pdplug.manager.PluginManager` for one test.

    :param plugins: in-test plugins, each ``(name, module_or_object)`` or a module (registered
        under its ``__name__``); registered after discovery, like a late import.
    :param env: environment seen by the manager; ``PDPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` is added
        unless present. ``os.environ`` is never read.
    :param entry_points: entry points to discover (default: the installed ``pdplug`` group,
        i.e. the defaults once autoload is off).
    :param strict: strict mode (default on: a broken plugin fails the test loudly).
    :param kwargs: passed to :class:`~pdplug.manager.PluginManager` (``select=``, ``block=`` …).
    :raises TypeError: a plugin given without a name has no ``__name__``.
    """
    named: list[tuple[str, object]] = []
    for p in plugins:
        if isinstance(p, tuple):
            named.append((str(p[0]), p[1]))
        elif isinstance(p, ModuleType):
            named.append((p.__name__, p))
        else:
            raise TypeError(f"plugin {p!r}: pass (name, plugin) so pluggy does not invent a name")
    full_env = {"PDPLUG_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})}
    eps = discover_entry_points() if entry_points is None else list(entry_points)
    return PluginManager(eps, full_env, strict=strict, plugins=named, **kwargs)


@pytest.fixture
def plugin_manager() -> Iterator[PluginManager]:
    """A fresh manager (defaults only, autoload off, strict); in-test plugins registered on it
    with ``register(obj, name=...)`` are unregistered at teardown."""
    pm = make_plugin_manager()
    before = {r.name for r in pm.records}
    yield pm
    for r in list(pm.records):
        if r.name not in before and pm.pm.get_plugin(r.name) is not None:
            pm.unregister(r.name)


# --------------------------------------------------------------------------- fake KV geometry


def fake_layout(
    *,
    page_size: int = 16,
    num_layers: int = 2,
    first_layer: int = 0,
    entries_per_layer: int = 2,
    bytes_per_token: int = 64,
    draft_layers: int = 0,
    dtype: str = "bfloat16",
    pp_size: int = 1,
    pp_rank: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> KVLayout:
    """A small :class:`~pdplug.types.KVLayout`.

    :param page_size: tokens per page.
    :param num_layers: layers held by this rank; ``first_layer``: the first of them.
    :param entries_per_layer: 2 for K/V, 1 for an MLA latent.
    :param bytes_per_token: bytes of one token row of every entry.
    :param draft_layers: extra draft-model layers appended (their entries are not DCP-sharded).
    :raises ValueError: as :class:`~pdplug.types.KVLayout` (bad sizes or ranks).
    """
    n_main = num_layers * entries_per_layer
    n_draft = draft_layers * entries_per_layer
    return KVLayout(
        page_size=page_size,
        entry_bytes_per_token=(bytes_per_token,) * (n_main + n_draft),
        draft_entries=tuple(range(n_main, n_main + n_draft)),
        dtype=dtype,
        pp_size=pp_size,
        pp_rank=pp_rank,
        tp_size=tp_size,
        tp_rank=tp_rank,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        first_layer=first_layer,
        num_layers=num_layers + draft_layers if draft_layers else num_layers,
    )


def fake_layouts(
    *,
    total_layers: int = 4,
    pp_size: int = 2,
    dcp_size: int = 2,
    page_size: int = 16,
    entries_per_layer: int = 2,
    bytes_per_token: int = 64,
) -> tuple[list[KVLayout], list[KVLayout]]:
    """Prefill PP-rank layouts (layers split evenly) and decode DCP-rank layouts (all layers).

    :returns: ``(prefill[pp_size], decode[dcp_size])``.
    :raises ValueError: ``total_layers`` is not a multiple of ``pp_size``.
    """
    if total_layers % pp_size:
        raise ValueError(f"total_layers={total_layers} is not a multiple of pp_size={pp_size}")
    per = total_layers // pp_size
    prefill = [
        fake_layout(
            num_layers=per,
            first_layer=r * per,
            pp_size=pp_size,
            pp_rank=r,
            bytes_per_token=bytes_per_token,
            page_size=page_size,
            entries_per_layer=entries_per_layer,
        )
        for r in range(pp_size)
    ]
    decode = [
        fake_layout(
            num_layers=total_layers,
            dcp_size=dcp_size,
            dcp_rank=r,
            bytes_per_token=bytes_per_token,
            page_size=page_size,
            entries_per_layer=entries_per_layer,
        )
        for r in range(dcp_size)
    ]
    return prefill, decode


def fake_kv(layout: KVLayout, num_pages: int, seed: int = 0) -> list[np.ndarray]:
    """Deterministic random KV buffers: one uint8 array per entry, shape
    ``[num_pages * page_size, entry_bytes_per_token[e]]`` (token slot rows)."""
    rng = np.random.default_rng(seed)
    rows = num_pages * layout.page_size
    return [
        rng.integers(0, 256, size=(rows, bpt), dtype=np.uint8)
        for bpt in layout.entry_bytes_per_token
    ]


def fake_peer(layout: KVLayout, role: str = "prefill", instance: str = "") -> PeerInfo:
    """A :class:`~pdplug.types.PeerInfo` for ``layout`` (no endpoints, no registered memory)."""
    return PeerInfo(instance=instance or f"{role}-0", role=role, layout=layout)


class EventLog:
    """An observer plugin that keeps every :class:`~pdplug.types.PdplugEvent` its manager
    emits, in order, in ``events`` (room outcomes ``transfer_done``/``transfer_failed`` with
    their fields, and every other event): register it on the manager a session is made from,
    ``PluginManager(plugins=[("events", log)])``, and read ``log.events`` in the test."""

    def __init__(self) -> None:
        self.events: list[PdplugEvent] = []

    @hookimpl
    def pdplug_on_event(self, event: PdplugEvent) -> None:
        """Keep ``event``."""
        self.events.append(event)


# --------------------------------------------------------------------------- documentation


def undocumented(module: ModuleType) -> list[str]:
    """Public classes and functions of ``module`` (its ``__all__``) without a docstring of
    their own, and their public methods without one.

    Reads each object's own ``__doc__``, never :func:`inspect.getdoc`: ``getdoc`` falls back to
    a base class's docstring, so an undocumented msgspec Struct would pass with
    ``msgspec.Struct``'s text (issue 10). Data (constants, aliases) is skipped: it is
    documented where it is defined.

    :param module: a module with ``__all__``.
    :returns: ``"Name"`` or ``"Name.method"`` for each missing docstring (empty when complete).
    """
    import inspect

    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        # ``type(obj)``, not ``inspect.isclass``: on Python 3.10 a generic alias such as
        # ``Callable[[int], str]`` passes ``isclass`` (it forwards ``__class__``), yet it is data.
        is_class = issubclass(type(obj), type)
        if not (is_class or inspect.isfunction(obj)):
            continue
        if len((obj.__doc__ or "").strip()) <= 10:
            missing.append(name)
        if is_class:
            for meth, fn in vars(obj).items():
                if isinstance(fn, staticmethod | classmethod):
                    fn = fn.__func__
                elif isinstance(fn, property):
                    fn = fn.fget
                if inspect.isfunction(fn) and not meth.startswith("_") and not fn.__doc__:
                    missing.append(f"{name}.{meth}")
    return missing
