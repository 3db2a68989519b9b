"""Fake plugin modules for the manager and CLI tests (installed into sys.modules per test)."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest

from pdplug import ConsensusSpec, KVSenderSpec, hookimpl


def install_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> ModuleType:
    """Put a module ``name`` with ``attrs`` into ``sys.modules`` for the current test."""
    mod = ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def consensus_hook(*specs: ConsensusSpec) -> Any:
    """A fresh ``pdplug_register_consensus`` implementation yielding ``specs``."""

    @hookimpl
    def pdplug_register_consensus() -> Any:
        yield from specs

    return pdplug_register_consensus


def kv_hook(*specs: KVSenderSpec) -> Any:
    """A fresh ``pdplug_register_kv_senders`` implementation yielding ``specs``."""

    @hookimpl
    def pdplug_register_kv_senders() -> Any:
        yield from specs

    return pdplug_register_kv_senders


class FakeConsensus:
    """Records its config; satisfies nothing but identity checks."""

    def __init__(self, config: Any, tag: str) -> None:
        self.config = config
        self.tag = tag
