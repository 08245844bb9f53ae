"""Derived literals and byte sums for `cpsat_model.CpsatModel`: ORs and region frames over the
policy variables, each made once per model, and linear sums of (bytes, literal) pairs."""

from __future__ import annotations

from typing import Any

__all__ = ["Literals", "Terms", "linear"]


class Literals:
    """Literals derived from a model's ``rc[u]`` (unit u is recomputed) and ``cut[c]`` (a
    region boundary at point c; None at both ends), each made once."""

    def __init__(self, m: Any, rc: list[Any], cut: list[Any]):
        self.m, self.rc, self.cut = m, rc, cut
        self._cache: dict[Any, Any] = {}

    def frame(self, pu: int, ru: int) -> Any:
        """Literal: unit ``ru`` is recomputed and a region boundary separates it from ``pu``."""
        key = ("frame", pu, ru)
        if key not in self._cache:
            lo, hi = sorted((pu, ru))
            v = self.m.NewBoolVar(f"frame{pu}_{ru}")
            cuts = [self.cut[c] for c in range(lo + 1, hi + 1)]
            # v -> rc[ru] and v -> some cut; and rc[ru] and a cut -> v
            self.m.AddImplication(v, self.rc[ru])
            self.m.AddBoolOr(cuts).OnlyEnforceIf(v)
            for c in cuts:
                self.m.AddBoolOr([self.rc[ru].Not(), c.Not(), v])
            self._cache[key] = v
        return self._cache[key]

    def any_of(self, lits: list[Any]) -> Any:
        """A literal that is true when any of ``lits`` is (True/False for constants)."""
        if any(x is True for x in lits):
            return True
        lits = [x for x in lits if x is not False]
        if not lits:
            return False
        if len(lits) == 1:
            return lits[0]
        key = ("or", tuple(sorted(x.Index() for x in lits)))
        if key not in self._cache:
            v = self.m.NewBoolVar("or")
            for x in lits:
                self.m.AddImplication(x, v)
            self.m.AddBoolOr(lits).OnlyEnforceIf(v)
            self._cache[key] = v
        return self._cache[key]


class Terms:
    """A linear sum of literals, by literal: (bytes, literal) pairs merged."""

    def __init__(self) -> None:
        self.by: dict[int, list[Any]] = {}

    def add(self, lit: Any, b: int) -> None:
        entry = self.by.setdefault(lit.Index(), [0, lit])
        entry[0] += b
        if entry[0] == 0:
            del self.by[lit.Index()]

    def pairs(self) -> list[tuple[int, Any]]:
        return [(b, lit) for b, lit in self.by.values()]


def linear(pairs: list[tuple[int, Any]]) -> Any:
    """``sum(b * lit)`` as one CP-SAT expression (built in C++, not term by term)."""
    from ortools.sat.python import cp_model

    return cp_model.LinearExpr.WeightedSum([lit for _, lit in pairs], [b for b, _ in pairs])
