"""pdplug as an SGLang transfer backend: ``--disaggregation-transfer-backend pdplug``.

SGLang loads the entry-point group ``sglang.srt.plugins`` in every process it starts (server,
schedulers, detokenizer; ``sglang/srt/plugins/__init__.py``); pdplug's pyproject declares
``pdplug = "pdplug.adapters.sglang:register"`` there. :func:`register`:

* adds ``"pdplug"`` to the ``--disaggregation-transfer-backend`` choices
  (``sglang.srt.arg_groups.choices.add_disagg_transfer_backend_choices``);
* adds a ``PDPLUG`` member to SGLang's ``TransferBackend`` Enum (the same class every module
  imported, so ``TransferBackend("pdplug")`` works everywhere);
* wraps ``get_kv_class`` (SGLang's ``HookRegistry``, AROUND) so that ``PDPLUG`` returns the
  classes of :mod:`pdplug.adapters.sglang.conn`, and every other backend SGLang's own;
* wraps ``ChunkSizePredictor.fit``, ``DynamicChunkSizer.profile_and_fit`` and
  ``DynamicChunkSizer.predict`` so that a ``pdplug`` engine's dynamic chunk sizes come from the
  selected pdplug scheduler
  (:mod:`pdplug.adapters.sglang.chunking`).

It never raises and imports no pdplug transfer code: SGLang processes that do not select
pdplug are not disturbed. On an SGLang release outside :data:`GATE` it only warns; selecting
the backend there fails when SGLang first asks for its classes, with the reason
(:meth:`pdplug.adapters.version.VersionGate.require` in :mod:`~pdplug.adapters.sglang.conn`).
``docs/sglang-backend.md`` has the interface and how to run it.
"""

from __future__ import annotations

import logging
from typing import Any

from pdplug.adapters.version import VersionGate

__all__ = ["BACKEND", "GATE", "register"]

log = logging.getLogger(__name__)

#: the value of ``--disaggregation-transfer-backend``
BACKEND = "pdplug"
#: SGLang releases this adapter was written against (its disaggregation interface moves often)
GATE = VersionGate(
    component="pdplug's SGLang transfer backend", engine="SGLang", module="sglang",
    supported=((0, 5), (0, 6)),
)  # fmt: skip

_registered = False


def add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """Add ``name = value`` to an existing Enum class in place (every importer's class keeps
    its identity, so ``enum_cls(value)`` and ``enum_cls.name`` work wherever it was imported).

    :returns: the member (the existing one when ``value`` is already there).
    """
    if value in enum_cls._value2member_map_:
        return enum_cls(value)
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def _kv_class(original: Any, backend: Any, class_type: Any) -> Any:
    if getattr(backend, "value", backend) != BACKEND or class_type.name == "KVARGS":
        return original(backend, class_type)
    from pdplug.adapters.sglang import conn  # refuses an unsupported SGLang, with the reason

    return {
        "MANAGER": conn.PdplugKVManager,
        "SENDER": conn.PdplugKVSender,
        "RECEIVER": conn.PdplugKVReceiver,
        "BOOTSTRAP_SERVER": conn.PdplugKVBootstrapServer,
    }[class_type.name]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (idempotent; logs, never raises)."""
    global _registered
    if _registered:
        return
    _registered = True
    GATE.warn(log, GATE.installed())
    steps = (("choices", _add_choice), ("TransferBackend", _add_backend), ("hooks", _add_hooks))
    for what, step in steps:
        try:
            step()
        except Exception as e:  # an SGLang that moved these: selecting pdplug will say why
            log.warning("pdplug: SGLang plugin step %s failed: %s: %s", what, type(e).__name__, e)


def _add_choice() -> None:
    from sglang.srt.arg_groups import choices

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])


def _add_backend() -> None:
    from sglang.srt.disaggregation.utils import TransferBackend

    add_enum_member(TransferBackend, "PDPLUG", BACKEND)


def _add_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pdplug.adapters.sglang.chunking import fit_hook, predict_hook, profile_hook

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _kv_class, HookType.AROUND
    )
    sizer = "sglang.srt.managers.scheduler_components.dynamic_chunk_sizer"
    HookRegistry.register(f"{sizer}.ChunkSizePredictor.fit", fit_hook, HookType.AROUND)
    HookRegistry.register(f"{sizer}.DynamicChunkSizer.predict", predict_hook, HookType.AROUND)
    HookRegistry.register(
        f"{sizer}.DynamicChunkSizer.profile_and_fit", profile_hook, HookType.AROUND
    )
