"""Exceptions raised by pdplug. Every message names the field and the value at fault."""

from __future__ import annotations

__all__ = [
    "PdplugError",
    "PluginError",
    "UnknownComponentError",
    "DuplicateComponentError",
    "CompatError",
    "PlanError",
    "CapacityError",
    "ConsensusError",
    "TransferError",
]


class PdplugError(Exception):
    """Base of all pdplug errors."""


class PluginError(PdplugError):
    """A plugin failed to load, or the registry is inconsistent."""


class UnknownComponentError(PluginError, LookupError):
    """A selected name is not provided by any loaded plugin (message lists the alternatives)."""


class DuplicateComponentError(PluginError):
    """Two distributions provide the same name and neither declares the override."""


class CompatError(PdplugError):
    """A peer was refused at the handshake; ``mismatches`` lists every reason."""

    def __init__(self, mismatches: list[str]) -> None:
        self.mismatches = list(mismatches)
        super().__init__("peer refused at handshake: " + "; ".join(self.mismatches))


class PlanError(PdplugError, ValueError):
    """A send cannot be planned (geometry mismatch, unaligned prefix, too few pages)."""


class CapacityError(PlanError):
    """A plan would overflow its pack region (never silently falls back to per-token)."""


class ConsensusError(PdplugError):
    """Consensus cannot continue: a sequence gap/duplicate or a dead peer rank."""


class TransferError(PdplugError):
    """A KV transfer failed (raised by ``failure_exception``-style helpers)."""
