"""One deadline that every phase of a solve checks: ``time_limit_s`` is a promise.

`plan.solve_graph` (through `stash.solve_with_rng_stash` and `certify.solve_and_certify`),
`plan.solve` (around its solve phase), `auto` and `floor.floor` open a deadline (`within`)
for their time limit; whatever they call (the block tables, `dp`'s
region table, CP-SAT, the relaxation, `repair`, the certifying bound) takes no longer than
what is left of it: a phase given its own limit gets at most what is left (`clamp`), and the
table builders, which run thousands of simulations, check it between them (`check`) and stop
with `OutOfTime`, which their solver turns into "nothing found" (the caller then answers the
best it has). A nested `within` never extends the deadline of the one around it.

The deadline lives in a `contextvars.ContextVar`, so a solve in one thread does not limit a
solve in another, and no solver signature changes. What a solve does after its last check is
bounded and small: simulate the schedule it returns, stamp it (`base.finish`); the tests
hold a solve to its limit plus that (`tests/solvers/test_time_limit.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["OutOfTime", "check", "clamp", "expired", "left", "within"]

_DEADLINE: ContextVar[float | None] = ContextVar("scheduler_solve_deadline", default=None)


class OutOfTime(TimeoutError):
    """The shared deadline passed in the middle of a phase (a table half built): the phase
    has nothing to answer; its solver answers "nothing found". ``partial``: what the phase had
    found by then, where that means something (the floor's offers)."""

    def __init__(self, message: str, partial: object = None):
        super().__init__(message)
        self.partial = partial


@contextmanager
def within(time_limit_s: float | None) -> Iterator[float | None]:
    """Run the block under a deadline ``time_limit_s`` from now (None: no new limit), or the
    enclosing one where that comes first. Yields the deadline (a `time.perf_counter` value, or
    None)."""
    outer = _DEADLINE.get()
    mine = None if time_limit_s is None else time.perf_counter() + time_limit_s
    deadline = mine if outer is None else outer if mine is None else min(outer, mine)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def left() -> float | None:
    """Seconds left until the shared deadline (negative once past it); None: no deadline."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.perf_counter()


def expired() -> bool:
    """Whether the shared deadline has passed."""
    deadline = _DEADLINE.get()
    return deadline is not None and time.perf_counter() >= deadline


def check(what: str = "the solve") -> None:
    """Raise `OutOfTime` once the shared deadline has passed."""
    if expired():
        raise OutOfTime(f"{what}: out of time (the solve's time limit passed)")


def clamp(time_limit_s: float | None) -> float | None:
    """A phase's own limit, cut to what is left of the shared deadline (at least 0): None only
    when neither limits it."""
    rest = left()
    if rest is None:
        return time_limit_s
    rest = max(0.0, rest)
    return rest if time_limit_s is None else min(time_limit_s, rest)
