"""Byte sizes on the command line: ``--max-memory 12GB``, ``--out-shard-size 5B``.

Decimal suffixes follow mergekit's ``parse_kmb`` (``k`` = 10³, ``M`` = 10⁶, ``B`` = 10⁹ — "billion", so
``--out-shard-size 5B`` means the same 5 × 10⁹ bytes in both tools), extended with ``G`` = 10⁹, ``T`` = 10¹²
and ``P`` = 10¹⁵, an optional trailing ``B`` after a decimal prefix (``kB``, ``MB``, ``GB``, ...), the binary
prefixes ``Ki`` to ``Pi`` (with or without ``B``) and ``bytes``. Suffixes are case-insensitive.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from resumerge.errors import UsageError

__all__ = ["format_duration", "format_size", "parse_size"]

_MULTIPLIERS: Mapping[str, int] = MappingProxyType({
    "": 1,
    "byte": 1,
    "bytes": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    # mergekit's "B" is billion, not byte: "5B" must mean 5e9 bytes in both tools.
    "b": 10**9,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
    "pi": 2**50,
    "pib": 2**50,
})

# A plain decimal number (no sign, no exponent, no underscores) and an optional unit, spaces allowed around.
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", re.ASCII)

_HINT = "write a number with an optional unit, e.g. 500M, 1.5GB, 2GiB or 5B (= 5e9 bytes)"

_UNITS = ("bytes", "kB", "MB", "GB", "TB", "PB")


def parse_size(value: str | int, *, option: str | None = None) -> int:
    """Return the number of bytes ``value`` denotes, rounded down to a whole byte.

    ``value`` is an int (taken as bytes, as mergekit accepts from YAML) or a string such as ``"123"``,
    ``"500M"``, ``"1.5GiB"``, ``"1 GB"`` or ``"5B"`` (5 × 10⁹). ``option`` (e.g. ``"--max-memory"``) prefixes
    the error message. Zero is accepted; callers that need a positive size check that themselves.

    Raises :class:`~resumerge.errors.UsageError` (one line, with a hint) for anything else: negative numbers,
    exponents, unknown units, booleans, empty strings.
    """
    prefix = f"{option}: " if option else ""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UsageError(f"{prefix}invalid size {value!r}", hint=_HINT)
    if isinstance(value, int):
        if value < 0:
            raise UsageError(f"{prefix}invalid size {value!r}: sizes cannot be negative", hint=_HINT)
        return value
    match = _SIZE.fullmatch(value)
    if match is None:
        raise UsageError(f"{prefix}invalid size {value!r}", hint=_HINT)
    number, unit = match.groups()
    multiplier = _MULTIPLIERS.get(unit.lower())
    if multiplier is None:
        raise UsageError(f"{prefix}invalid size {value!r}: unknown unit {unit!r}", hint=_HINT)
    # Fraction keeps "1.1GB" exact (float would give 1100000000.0000002 and risk an off-by-one byte); imported here,
    # as fractions pulls in decimal: a few ms of every `resumerge status`, which parses no size.
    from fractions import Fraction

    return int(Fraction(number) * multiplier)


def format_size(n: int, *, compact: bool = False) -> str:
    """Render ``n`` bytes with decimal units and three significant digits: ``"1.74 GB"``, ``"512 MB"``.

    Values below 1000 are printed exactly as ``"999 bytes"``, never ``"999 B"``, which :func:`parse_size`
    would read as 999 × 10⁹. ``compact=True`` drops the space (``"1.74GB"``, ``"999"``) so the result can be
    pasted after ``--max-memory``; :func:`parse_size` reads either form back to within 0.5 %. Negative
    values keep their sign.
    """
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    sep = "" if compact else " "
    if magnitude < 1000:
        return f"{sign}{magnitude}" if compact else f"{sign}{magnitude} bytes"
    index = 1
    while True:
        value = magnitude / 1000**index
        text = _three_digits(value)
        # 999.7 MB rounds to "1000": carry into the next unit instead of printing four digits.
        if float(text) < 1000 or index == len(_UNITS) - 1:
            return f"{sign}{text}{sep}{_UNITS[index]}"
        index += 1


def format_duration(seconds: float) -> str:
    """``seconds`` as the figures beside sizes say it: ``42 s`` under 90 s, ``35 min`` under 90 min, else ``2.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _three_digits(value: float) -> str:
    # Decide the decimals after rounding: 9.996 must print as "10.0", not "10.00".
    for decimals, bound in ((2, 10), (1, 100)):
        text = f"{value:.{decimals}f}"
        if float(text) < bound:
            return text
    return f"{value:.0f}"
