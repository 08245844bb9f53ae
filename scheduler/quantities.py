"""Byte and time quantities as people write them, and back (the word "units" names the
modules a plan takes over, `scheduler.units`).

Torch-free on purpose: the CLI, reports and the torch-free ``CostGraph`` all use it.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

__all__ = ["check_time_limit", "format_bytes", "format_seconds", "parse_bytes"]

# Keys are lower-cased so that "512mb", "512MB" and "512Mb" all mean the same thing; a memory
# budget is never given in bits, so reading "b" as bytes loses nothing.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_NUMBER_AND_UNIT = re.compile(
    r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)"
    r"\s*(?P<unit>[A-Za-z]*)\s*$"
)

_ACCEPTED = (
    "a positive number of bytes, optionally with a unit: "
    "'1024', '1.5e9', '512MB', '2 GiB', '100KiB', '1kB' "
    "(kB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024)"
)

_IEC_STEPS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_bytes(text: str) -> int:
    """Parse a byte quantity such as ``"6GiB"`` or ``"1.5e9"`` into an integer.

    Args:
        text: a number with an optional unit. SI units (kB, MB, GB, TB) are powers of
            1000, IEC units (KiB, MiB, GiB, TiB) powers of 1024; units are case-insensitive
            and may be separated from the number by spaces. A fractional result is rounded
            to the nearest byte.

    Returns:
        The number of bytes, at least 1.

    Raises:
        ValueError: for anything else, including negative numbers, zero, and bare
            one-letter units such as "6G", which are ambiguous between GB and GiB.

    Example:
        >>> parse_bytes("2 GiB")
        2147483648
        >>> parse_bytes("512MB")
        512000000
    """
    if not isinstance(text, str):
        raise ValueError(f"bad byte quantity {text!r}: expected a string, {_ACCEPTED}")
    match = _NUMBER_AND_UNIT.match(text)
    if match is None:
        raise ValueError(f"bad byte quantity {text!r}: expected {_ACCEPTED}")
    unit = match.group("unit")
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        hint = ""
        if unit.lower() in {"k", "m", "g", "t"}:
            u = unit.upper()
            hint = f" ('{u}' is ambiguous: write '{u}B' for 1000-based or '{u}iB' for 1024-based)"
        raise ValueError(f"bad byte quantity {text!r}: unknown unit {unit!r}{hint}; expected {_ACCEPTED}")
    try:
        value = Decimal(match.group("number")) * multiplier
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"bad byte quantity {text!r}: expected {_ACCEPTED}") from None
    n_bytes = int(value.to_integral_value(rounding=ROUND_HALF_EVEN))
    if n_bytes <= 0:
        raise ValueError(f"bad byte quantity {text!r}: it must be at least 1 byte; expected {_ACCEPTED}")
    return n_bytes


def format_bytes(n: int) -> str:
    """Format a byte count with IEC units: ``"12 B"``, ``"512.00 MiB"``, ``"1.50 GiB"``.

    Negative counts (differences between two peaks) keep their sign.
    """
    n = int(n)
    sign = "-" if n < 0 else ""
    magnitude = abs(n)
    if magnitude < 1024:
        return f"{sign}{magnitude} B"
    value = float(magnitude)
    step = 0
    while value >= 1024 and step < len(_IEC_STEPS) - 1:
        value /= 1024
        step += 1
    # 1023.999 MiB would print as "1024.00 MiB"; move it up a unit instead.
    if f"{value:.2f}" == "1024.00" and step < len(_IEC_STEPS) - 1:
        value /= 1024
        step += 1
    return f"{sign}{value:.2f} {_IEC_STEPS[step]}"


def format_seconds(seconds: float) -> str:
    """Format a duration for tables: ``"850 us"``, ``"12.3 ms"``, ``"1.25 s"``, ``"2 min 5.0 s"``."""
    s = float(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 1e-3:
        return f"{sign}{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{sign}{s * 1e3:.1f} ms"
    if s < 60.0:
        return f"{sign}{s:.2f} s"
    minutes, rest = divmod(s, 60.0)
    return f"{sign}{minutes:.0f} min {rest:.1f} s"


def check_time_limit(time_limit_s: object) -> float | None:
    """A solver time limit, checked the same way by the API and the CLI (which converts its
    text with ``float`` first).

    Args:
        time_limit_s: seconds, a finite number > 0 (an int or a float), or None: no time
            limit, each solver runs until it finishes (certifying its result still takes at
            most `SolverConfig.bound_s`).

    Returns:
        The limit as a float, or None.

    Raises:
        ValueError: zero, negative, NaN or infinite values, bools, strings and anything else
            not a number; the message names the value and what to pass instead.

    Example:
        >>> check_time_limit(30), check_time_limit(2.5), check_time_limit(None)
        (30.0, 2.5, None)
    """
    if time_limit_s is None:
        return None
    fix = "pass a finite number of seconds > 0 (e.g. 30), or None for no limit"
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, numbers.Real):
        # a ValueError, as for every other bad value a user passes
        raise ValueError(  # noqa: TRY004
            f"bad time limit {time_limit_s!r}: a {type(time_limit_s).__name__} is not a number "
            f"of seconds; {fix}")
    value = float(time_limit_s)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bad time limit {time_limit_s!r}: it must be finite and > 0; {fix}")
    return value
