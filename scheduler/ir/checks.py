"""Field checks shared by the `CostGraph` and `Schedule` loaders: reading a JSON file into
Python values, and checking one value's type, sign, finiteness and size, each failure an
error of the caller's type (`CostGraphError`, `ScheduleError`) naming the field.

A bool is never an int or a float here (JSON ``true`` is not a byte count); byte counts are
integers that fit int64 with room for the solvers' sums (`MAX_BYTES`); times are finite
numbers of seconds up to `MAX_SECONDS`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["MAX_BYTES", "MAX_SECONDS", "Checks", "read_json"]

#: the most bytes one field may hold: 2**53 (8 PiB). Larger counts are not measurements, and
#: capping them keeps the solvers' sums of thousands of them inside int64 (OR-Tools' range).
MAX_BYTES = 2**53
#: the most seconds one time may hold (about 31 years): larger ones are not measurements.
MAX_SECONDS = 1e9


def read_json(path: str | Path, error: type[ValueError], what: str) -> Any:
    """The JSON value in the file at ``path``; ``error`` (a one-line message starting with
    the path) when it is a directory, unreadable, not UTF-8 text, not JSON or nested too
    deeply to parse. A missing file raises `FileNotFoundError` as usual."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{path}: is a directory, not {what}; give the path of the JSON file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e}); give {what}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not a text file (byte {raw[e.start]:#04x} at offset {e.start} "
                    f"is not UTF-8); give {what}, a JSON file") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise error(f"{path}: JSON nested too deeply to be {what}") from e


def _show(v: Any) -> str:
    """A short repr of ``v`` for a message (deep or long values cut)."""
    try:
        text = repr(v)
    except RecursionError:
        text = f"<deeply nested {type(v).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


class Checks:
    """Checks of single values; each raises ``error`` naming ``where`` (e.g.
    ``nodes[3].time_s``) and returns the value when it passes."""

    def __init__(self, error: type[ValueError]):
        self.error = error

    def fail(self, where: str, why: str) -> NoReturn:
        raise self.error(f"{where}: {why}" if where else why)

    def type(self, where: str, v: Any, typ: type | tuple[type, ...]) -> Any:
        """``v`` if it is a ``typ`` (a bool only where ``bool`` is named)."""
        types = typ if isinstance(typ, tuple) else (typ,)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = "/".join("null" if t is type(None) else t.__name__ for t in types)
            self.fail(where, f"expected {want}, got {type(v).__name__} ({_show(v)})")
        return v

    def key(self, d: dict[str, Any], key: str, where: str = "") -> Any:
        if key not in d:
            self.fail(f"{where}{key}", "missing")
        return d[key]

    def bytes(self, where: str, v: Any, *, optional: bool = False, limit: int = MAX_BYTES
              ) -> Any:
        """A byte count: an int in [0, ``limit``] (or None if ``optional``)."""
        if optional and v is None:
            return v
        self.type(where, v, (int, type(None)) if optional else int)
        if v < 0:
            self.fail(where, f"{_show(v)} is negative (a byte count)")
        if v > limit:
            self.fail(where, f"{_show(v)} bytes is more than {limit}; not a real size")
        return v

    def count(self, where: str, v: Any, *, optional: bool = False) -> Any:
        """A count or id: an int in [0, 2**62] (or None if ``optional``)."""
        if optional and v is None:
            return v
        self.type(where, v, (int, type(None)) if optional else int)
        if not 0 <= v <= 2**62:
            self.fail(where, f"{_show(v)} is not in [0, 2**62]")
        return v

    def seconds(self, where: str, v: Any, *, optional: bool = False) -> Any:
        """A time: a finite int or float in [0, `MAX_SECONDS`] (or None if ``optional``)."""
        if optional and v is None:
            return v
        self.type(where, v, (int, float, type(None)) if optional else (int, float))
        if isinstance(v, float) and not math.isfinite(v):
            self.fail(where, f"{v} is not a finite time (seconds)")
        if v < 0:
            self.fail(where, f"{v} is negative (a time in seconds)")
        if v > MAX_SECONDS:
            self.fail(where, f"{_show(v)} s is more than {MAX_SECONDS:g} s; not a real time")
        return float(v)

    def number(self, where: str, v: Any, *, optional: bool = False) -> Any:
        """A finite int or float of any sign (or None if ``optional``)."""
        if optional and v is None:
            return v
        self.type(where, v, (int, float, type(None)) if optional else (int, float))
        if isinstance(v, float) and not math.isfinite(v):
            self.fail(where, f"{v} is not a finite number")
        if isinstance(v, int) and abs(v) > 2**63:
            self.fail(where, f"{_show(v)} is too large (more than 2**63)")
        return v

    def strings(self, where: str, v: Any) -> list[str]:
        """A list of strings."""
        self.type(where, v, list)
        for i, x in enumerate(v):
            self.type(f"{where}[{i}]", x, str)
        return v

    def fields(self, where: str, d: dict[str, Any], known: set[str] | frozenset[str]) -> None:
        """No keys in ``d`` beyond ``known``."""
        unknown = sorted(set(d) - set(known))
        if unknown:
            self.fail(where, f"unknown fields {unknown} (known: {sorted(known)})")

    def row(self, where: str, v: Any, n: int, what: str) -> list[Any]:
        """A list of exactly ``n`` values (``what`` names them, e.g. ``[kind, storage]``)."""
        if not isinstance(v, list) or len(v) != n:
            self.fail(where, f"expected {what}, got {_show(v)}")
        return v
