"""Checks of ``pdplug bench`` options: an ordinary mistake gets one line and exit status 2
before anything is spawned or allocated, never a traceback later."""

from __future__ import annotations

import math
import re
from typing import Any

import click

__all__ = ["component_names", "number_list", "variant_pairs"]


def _resolve(point: str, name: str, option: str) -> None:
    """Refuse ``name`` unless the plugin manager can build it for ``point``."""
    from pdplug import PdplugError, PluginManager

    try:  # a fresh manager: this environment's PDPLUG_* switches apply
        PluginManager().resolve(point, name)
    except PdplugError as e:
        raise click.BadParameter(str(e), param_hint=f"'{option}'") from None


def component_names(value: str, point: str, option: str) -> list[str]:
    """A comma list of component names of extension point ``point``, each resolvable.

    :raises click.BadParameter: an empty list or entry, a name given twice, or a name no plugin
        provides (the message lists the available ones).
    """
    names = [x.strip() for x in value.split(",")]
    if not value.strip() or not all(names):
        raise click.BadParameter(
            f"{value!r}: expected comma-separated names", param_hint=f"'{option}'"
        )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise click.BadParameter(
            f"{value!r} names {', '.join(dup)} more than once", param_hint=f"'{option}'"
        )
    for name in names:
        _resolve(point, name, option)
    return names


def component_name(value: str, point: str, option: str) -> str:
    """One component name of extension point ``point``, resolvable.

    :raises click.BadParameter: a list, an empty name, or a name no plugin provides.
    """
    names = component_names(value, point, option)
    if len(names) != 1:
        raise click.BadParameter(
            f"{value!r}: one name only (this benchmark runs one {point} at a time)",
            param_hint=f"'{option}'",
        )
    return names[0]


#: a number as people type it: ASCII digits, an optional point and exponent (``float`` also
#: takes ``1_6`` and non-ASCII digits, which a size on a command line never means); nan and
#: inf pass here to be refused by name
_NUMBER = re.compile(
    r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?|[+-]?(?:nan|inf|infinity)",
    re.ASCII | re.IGNORECASE,
)


class StrictIntRange(click.IntRange):
    """:class:`click.IntRange` over a whole number in ASCII digits (``int()``, which click
    uses, also takes ``1_0`` and other scripts' digits: ``--repeats 1_0`` ran 10 repeats)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, str) and not WHOLE_NUMBER.fullmatch(value):
            self.fail(f"{value!r}: expected a whole number (ASCII digits)", param, ctx)
        return int(super().convert(value, param, ctx))


#: a whole number as people type it (spaces around and a sign, as ``int()`` takes them)
WHOLE_NUMBER = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)


def number_list(value: str, option: str, unit: str, minimum: float) -> list[float]:
    """A comma list of numbers, each at least ``minimum``.

    :raises click.BadParameter: an empty entry, an entry that is not a number (ASCII digits,
        optional point and exponent), one below ``minimum``, or one given twice (it would
        print one measurement as two rows).
    """
    try:
        parts = [x.strip() for x in value.split(",")]
        if not all(_NUMBER.fullmatch(x) for x in parts):
            raise ValueError(value)
        out = [float(x) for x in parts]
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected comma-separated numbers ({unit})", param_hint=f"'{option}'"
        ) from None
    if not all(math.isfinite(x) for x in out):
        raise click.BadParameter(f"{value!r}: every value must be finite", param_hint=f"'{option}'")
    if not out or min(out) < minimum:
        raise click.BadParameter(
            f"{value!r}: every value must be >= {minimum:g} {unit}", param_hint=f"'{option}'"
        )
    twice = sorted({x for x in out if out.count(x) > 1})
    if twice:
        raise click.BadParameter(
            f"{value!r} names {', '.join(f'{x:g}' for x in twice)} more than once",
            param_hint=f"'{option}'",
        )
    return out


def variant_pairs(value: str, option: str) -> list[tuple[str, str]]:
    """``CONSENSUS+KV_SENDER`` pairs, comma-separated, both names resolvable.

    :raises click.BadParameter: an empty list or pair, a pair without ``+``, an unknown name,
        or a pair named twice.
    """
    pairs = []
    for v in value.split(","):
        cons, plus, kv = v.strip().partition("+")
        if not plus or not cons.strip() or not kv.strip():
            raise click.BadParameter(
                f"{v.strip()!r}: expected CONSENSUS+KV_SENDER, e.g. pp0+nixl",
                param_hint=f"'{option}'",
            )
        _resolve("consensus", cons.strip(), option)
        _resolve("kv_sender", kv.strip(), option)
        pair = (cons.strip(), kv.strip())
        if pair in pairs:
            raise click.BadParameter(
                f"{value!r} names {'+'.join(pair)} more than once", param_hint=f"'{option}'"
            )
        pairs.append(pair)
    return pairs
