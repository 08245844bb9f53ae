"""Random damage to a JSON document, for fuzzing the loaders (`CostGraph.load`,
`Schedule.load`): `mutate` changes a value to another type, sign or size (huge, NaN, infinite),
deletes a key or an element, duplicates one, nests one in lists, or copies one value over
another (so that names and ids from the document land in the wrong places).

Driven by a `random.Random`, so that a property test (hypothesis's ``randoms()``) and a long
fuzz run share it; same seed, same damage.
"""

from __future__ import annotations

import copy
import random
from typing import Any

__all__ = ["NASTY", "mutate", "paths"]

#: replacement values: wrong types, signs, sizes and non-finite numbers
NASTY: tuple[Any, ...] = (
    -1, -4.0, 0, 1, 0.5, 10**30, 10**400, 2**63, 2**64, -(2**63) - 1, 1e30, 1e308, float("nan"),
    float("inf"), float("-inf"), True, False, None, "", "abc", "a", "f", "param:x", "input:0",
    [], {}, [[]], [None], {"a": 1}, [0, 1], ["a", 0], ["f", 0, 0], ["a", 0, 10**30],
)


def paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside ``doc``, ``doc`` itself first."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(paths(v, (*prefix, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(paths(v, (*prefix, i)))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def mutate(doc: Any, rng: random.Random, n: int = 1) -> tuple[Any, list[str]]:
    """A damaged deep copy of ``doc`` (``n`` random changes) and what was done, one line per
    change (e.g. ``"set ('nodes', 3, 'time_s') = -4.0"``)."""
    doc = copy.deepcopy(doc)
    done = []
    for _ in range(n):
        all_paths = paths(doc)
        # prefer leaves deep in the document: that is where the fields are
        path = rng.choice(all_paths[1:] or all_paths)
        kind = rng.choice(("set", "set", "set", "number", "delete", "duplicate", "nest",
                           "copy"))
        value = _get(doc, path)
        if kind == "set":
            new = copy.deepcopy(rng.choice(NASTY))
        elif kind == "number":
            new = rng.choice((-1, 1, 2, 10, 1 << 40)) * (value if isinstance(value, (int, float))
                                                       and not isinstance(value, bool) else 1)
            # (an int past float's range, e.g. after repeated scaling, has no float form)
            as_float = (float(new),) if abs(new) < 2 ** 1023 else ()
            new = rng.choice((new, -new, new + 1) + as_float)
        elif kind == "nest":
            new = value
            for _ in range(rng.choice((1, 2, 50))):
                new = [new]
        elif kind == "copy":
            new = copy.deepcopy(_get(doc, rng.choice(all_paths)))
        else:
            parent = _get(doc, path[:-1]) if path else None
            if kind == "delete" and isinstance(parent, (dict, list)):
                del parent[path[-1]]
                done.append(f"delete {path}")
                continue
            if kind == "duplicate" and isinstance(parent, list):
                parent.insert(path[-1], copy.deepcopy(value))
                done.append(f"duplicate {path}")
                continue
            new = copy.deepcopy(rng.choice(NASTY))
        doc = _set(doc, path, new)
        done.append(f"set {path} = {new!r:.60}")
    return doc, done
