"""Live bytes and their peak, as the simulator counts them event by event."""

from __future__ import annotations

import heapq

__all__ = ["LiveBytes"]


class LiveBytes:
    """Live bytes and their peak; optionally split by owning region, with each region's local
    peak and the range of what it holds while later regions run.

    Equivalent to recording, after every `add`, ``cur - sum(own[:phase])`` into the current
    phase's local peak and ``own[k]`` (every k < phase) into k's held range; done
    incrementally (solvers call it millions of times): the sum of earlier owners is kept for
    the current phase, and ``own[k]`` is recorded when it changes in a later phase, and at a
    phase's first `add` for the earlier owners not recorded yet or changed since (a heap of
    them: with a thousand owners, recording all earlier ones at every phase's start took
    most of a simulation). `add_many` is `add` on each of a list of events in turn, without
    a call each.

    Events that change no earlier owner (owner None, or not before the phase) record nothing
    in between but the running total, so a run of them acts as two: the highest running total,
    then the rest of the way to where they end (the simulator folds gradient steps and
    replays so)."""

    def __init__(self, n_owners: int, *, track: bool):
        self.cur = 0
        self.peak = 0
        self.phase = 0
        self.track = track
        if track:
            self.own = [0] * n_owners
            self.local = [0] * n_owners
            self.held_lo = [0] * n_owners
            self.held_hi = [0] * n_owners
            self._seen = [False] * n_owners
            self._early = 0  # sum(own[:phase])
            self._fresh = False  # no add yet in this phase
            self._init = 0  # the owners below it were recorded once at least
            self._dirty: list[int] = []  # a heap: owners changed since they were recorded
            self._is_dirty = [False] * n_owners

    def set_phase(self, phase: int) -> None:
        if phase != self.phase:
            self.phase = phase
            if self.track:
                self._early = sum(self.own[:phase])
                self._fresh = True

    def _hold(self, k: int) -> None:
        v = self.own[k]
        if not self._seen[k]:
            self.held_lo[k] = self.held_hi[k] = v
            self._seen[k] = True
        elif v < self.held_lo[k]:
            self.held_lo[k] = v
        elif v > self.held_hi[k]:
            self.held_hi[k] = v

    def add(self, b: int, owner: int | None) -> None:
        cur = self.cur = self.cur + b
        if cur > self.peak:
            self.peak = cur
        if not self.track:
            return
        j = self.phase
        if owner is not None:
            self.own[owner] += b
            if owner < j:
                self._early += b
            if owner < j and not self._fresh:
                self._hold(owner)
            elif not self._is_dirty[owner]:
                self._is_dirty[owner] = True
                heapq.heappush(self._dirty, owner)
        v = cur - self._early
        if v > self.local[j]:
            self.local[j] = v
        if self._fresh:
            self._fresh = False
            for k in range(self._init, j):
                self._hold(k)
            if j > self._init:
                self._init = j
            dirty = self._dirty
            while dirty and dirty[0] < j:
                k = heapq.heappop(dirty)
                self._is_dirty[k] = False
                self._hold(k)

    def add_many(self, events: list[tuple[int, int | None]]) -> None:
        """`add(b, owner)` for each ``(b, owner)`` of ``events`` in order."""
        if not events:
            return
        it = iter(events)
        if self.track and self._fresh:
            self.add(*next(it))  # the phase's first add records every earlier owner
        cur, peak = self.cur, self.peak
        if not self.track:
            for b, _ in it:
                cur += b
                if cur > peak:
                    peak = cur
            self.cur, self.peak = cur, peak
            return
        # as `add`, with no fresh phase: every earlier owner was recorded already (seen)
        j = self.phase
        own, lo, hi = self.own, self.held_lo, self.held_hi
        dirty, is_dirty = self._dirty, self._is_dirty
        early, top = self._early, self.local[j]
        for b, owner in it:
            cur += b
            if cur > peak:
                peak = cur
            if owner is not None:
                own[owner] += b
                if owner < j:
                    early += b
                    v = own[owner]
                    if v < lo[owner]:
                        lo[owner] = v
                    elif v > hi[owner]:
                        hi[owner] = v
                elif not is_dirty[owner]:
                    is_dirty[owner] = True
                    heapq.heappush(dirty, owner)
            if cur - early > top:
                top = cur - early
        self.cur, self.peak = cur, peak
        self._early, self.local[j] = early, top
