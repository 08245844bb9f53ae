"""`max_batch`: the largest batch size (or sequence length, ...) whose optimal plan fits.

The factory builds the model and inputs at a size, given as a keyword (``build(batch=8)``).
A size *fits* when the optimal checkpointing plan's predicted peak is within the budget less
headroom (and its predicted overhead within ``max_overhead``). Sizes are profiled at most once
each. The first two profiles (the factory's default size and twice it) give the smallest peak
any schedule reaches at each; where that grows linearly with the size (batch: activations
scale with it, parameters do not), the line through them brackets the answer, so that only
sizes near it are profiled and solved. A search over sizes then finds ``n`` that fits with
``n + 1`` that does not, and ``n``'s plan is measured; should the measurement exceed the
budget less headroom, the search goes on below it.

With ``parallel`` (``"ddp"``, ``"fsdp2:8"``, ...; `parallel.parse_parallel`) the sizes are
profiled as `solve` profiles them for one rank of that engine (`units.profile_units`), so the
budget is a rank's; the answer is then predicted, not measured (one rank's step runs only
under the engine, on all its ranks).
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch.nn as nn

from ..budget import InfeasibleBudgetError
from ..capture.profile import profile_traced
from ..capture.trace import as_tuple, trace
from ..cost.simulate import simulate
from ..ir.graph import CostGraph
from ..ir.schedule import Schedule
from ..distributed import process_group
from ..measurement.step import Measurement, measure
from ..parallel import parse_parallel
from ..plan import Plan, solve_graph
from ..rewrite import rewrite
from ..solvers.base import SolveResult, get_solver
from ..quantities import check_time_limit, format_bytes
from ..units.apply import stamped
from ..units.step import planned_module, profile_units
from .advise import check_headroom, parse_memory

__all__ = ["MaxBatch", "Probe", "check_factory", "max_batch"]


@dataclass(frozen=True)
class Probe:
    """One size tried: whether its optimal plan fits, and why not."""

    size: int
    fits: bool
    reason: str  # why it does not fit ("" when it does)
    min_peak_bytes: int | None  # the least predicted peak any schedule reaches, where known
    peak_bytes: int | None  # the plan's predicted peak, where a plan fits the budget
    overhead: float | None  # the plan's predicted overhead, where a plan fits the budget


@dataclass(eq=False)
class MaxBatch:
    """What `max_batch` found.

    Attributes:
        dim: the factory keyword that was varied.
        size: the largest size that fits (0 when not even size 1 does).
        budget_bytes / headroom / usable_bytes: ``usable = budget * (1 - headroom)`` is what a
            plan's peak must stay within.
        plan: the optimal plan at ``size`` (its module runs on a fresh model from the factory).
        measured: that plan's module measured (`Measurement`), confirming it fits; None for
            a plan of one rank (``parallel``), which is predicted only.
        next: the probe of ``size + 1``, saying why it does not fit.
        probes: every size profiled, in the order tried.
        predicted_size: the size the first two profiles extrapolated to (None where the peak
            did not grow with the size).
        parallel: the engine one rank of which was planned (its `describe`), or None for
            one device.
    """

    dim: str
    size: int
    budget_bytes: int
    headroom: float
    usable_bytes: int
    max_overhead: float | None
    plan: Plan | None
    measured: Measurement | None
    next: Probe
    probes: list[Probe] = field(default_factory=list)
    predicted_size: int | None = None
    parallel: str | None = None

    @property
    def measured_peak_bytes(self) -> int | None:
        return None if self.measured is None else self.measured.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the answer, its plan's estimate and schedule, the measured
        peak and step time, and every probe."""
        return {
            "dim": self.dim, "size": self.size, "budget_bytes": self.budget_bytes,
            "headroom": self.headroom, "usable_bytes": self.usable_bytes,
            "max_overhead": self.max_overhead, "predicted_size": self.predicted_size,
            "estimate": None if self.plan is None else self.plan.estimate.to_dict(),
            "schedule": None if self.plan is None else self.plan.schedule.to_dict(),
            "measured_peak_bytes": self.measured_peak_bytes,
            "measured_step_s": None if self.measured is None else self.measured.step_s,
            "next": asdict(self.next), "probes": [asdict(p) for p in self.probes],
            "parallel": self.parallel,
        }

    def summary(self) -> str:
        """A few lines: the answer, its plan, its measured peak, why one more does not fit."""
        if self.plan is None:
            return f"no {self.dim} fits: {self.next.reason}"
        e = self.plan.estimate
        rank = f" per rank of {self.parallel}" if self.parallel else ""
        measured = (format_bytes(self.measured_peak_bytes) if self.measured is not None else
                    "not measured (one rank's step runs only under the engine)")
        return "\n".join([
            f"largest {self.dim}: {self.size} (budget {format_bytes(self.budget_bytes)}{rank}, "
            f"{format_bytes(self.usable_bytes)} after {self.headroom:.0%} headroom)",
            f"  plan            {self.plan.result.solver} {self.plan.status}, "
            f"{len(self.plan.schedule.recompute_regions)}/{len(self.plan.schedule.regions)} "
            f"regions recomputed, overhead +{e.overhead:.1%}",
            f"  predicted peak  {format_bytes(e.peak_bytes)}",
            f"  measured peak   {measured}",
            f"  {self.dim} {self.next.size}: {self.next.reason}",
            f"  profiled sizes  {', '.join(str(p.size) for p in self.probes)}",
        ])


def max_batch(factory: Callable[..., Any], *, budget: int | str,
              max_overhead: float | None = None, dim: str = "batch", headroom: float = 0.1,
              solver: str = "auto", time_limit_s: float | None = 30.0, repeats: int = 1,
              start: int | None = None, limit: int = 1 << 20,
              progress: Callable[[str], None] | None = None, parallel: Any = None) -> MaxBatch:
    """The largest ``dim`` whose optimal checkpointing plan fits ``budget`` less headroom.

    Args:
        factory: ``factory(**{dim: n})`` returns ``(model, inputs)`` or
            ``(model, inputs, loss_fn)`` at size ``n`` (e.g. ``examples/gpt.py:build``).
        budget: peak bytes of one forward + backward step (``"8GiB"`` or an int), as in
            `solve`: the optimizer state is not part of it (leave room for it, see `advise`).
        max_overhead: the most predicted recompute overhead allowed, a fraction (0.3 for
            +30%); None for no limit.
        dim: the factory keyword to vary: ``"batch"``, or e.g. ``"block_size"`` for sequence
            length.
        headroom: fraction of the budget held back; default 0.1. In [0, 1).
        solver, time_limit_s: passed to `solve_graph`.
        repeats: timed steps per profile and measurement.
        start: the first size to profile; default the factory's default for ``dim``, else 1.
        limit: the largest size considered.
        progress: called with a short message as each phase starts.
        parallel: plan one rank of data-parallel training, as `solve` does (``"ddp"``,
            ``"fsdp2:8"``, ``"fsdp2:8+adamw"``, `parallel.DDP`, `parallel.FSDP2`): the budget
            is then a rank's, and the answer predicted only (``measured`` is None).

    Returns:
        A `MaxBatch`: ``.size``, ``.plan``, ``.measured`` and ``.next`` (why ``size + 1``
        does not fit). ``size`` is 0, with ``plan`` None, when not even size 1 fits.

    Raises:
        ValueError: a bad budget, headroom or max_overhead, a factory without the ``dim``
            keyword, or sizes up to ``limit`` that all fit.

    Running time: about ``log2`` of the distance between the extrapolated and the true answer
    profiles and solves, plus two to start and one measurement.
    """
    budget_bytes = parse_memory(budget, "budget")
    headroom = check_headroom(headroom)
    if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(
            max_overhead, numbers.Real) or not max_overhead >= 0):
        raise ValueError(f"max_overhead must be a fraction >= 0 of the step time (0.3 for "
                         f"+30%) or None, got {max_overhead!r}")
    get_solver(solver)
    check_time_limit(time_limit_s)
    engine = parse_parallel(parallel, *process_group())
    first = check_factory(factory, dim, start)
    search = _Search(factory, dim, int(budget_bytes * (1 - headroom)), max_overhead, solver,
                     time_limit_s, repeats, progress or (lambda _msg: None), parallel)
    predicted = search.bracket(first)
    size = search.run(predicted, limit)
    rank = engine.describe() if engine is not None else None
    while True:
        if size == 0:
            return MaxBatch(dim, 0, budget_bytes, headroom, search.usable, max_overhead, None,
                            None, search.probe(1), search.tried(), predicted, rank)
        plan, measured = search.confirm(size, budget_bytes)
        if measured is None or measured.peak_bytes <= search.usable:
            return MaxBatch(dim, size, budget_bytes, headroom, search.usable, max_overhead,
                            plan, measured, search.probe(size + 1), search.tried(), predicted,
                            rank)
        size = search.run(size - 1, limit)


def check_factory(factory: Callable[..., Any], dim: str, start: int | None) -> int:
    """The first size to try; a clear error when the factory cannot take ``dim``."""
    if not callable(factory):
        raise ValueError(f"factory must be callable, got {type(factory).__name__}")
    name = getattr(factory, "__name__", repr(factory))
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    p = params.get(dim)
    takes_kwargs = any(q.kind is q.VAR_KEYWORD for q in params.values())
    if (p is None or p.kind is p.POSITIONAL_ONLY) and not takes_kwargs:
        raise ValueError(
            f"factory {name!r} takes no keyword {dim!r} (its parameters: "
            f"{', '.join(params) or 'none'}); give it one, e.g. def {name}({dim}=8): ..., "
            f"or name the keyword that sets the size with dim= (--dim on the command line)")
    if start is not None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise ValueError(f"start must be a positive int, got {start!r}")
        return start
    default = None if p is None else p.default
    return default if isinstance(default, int) and not isinstance(default, bool) \
        and default >= 1 else 1


class _Search:
    """Profiles sizes (each once), decides whether they fit, and searches."""

    def __init__(self, factory: Callable[..., Any], dim: str, usable: int,
                 max_overhead: float | None, solver: str, time_limit_s: float | None,
                 repeats: int, say: Callable[[str], None], parallel: Any = None):
        self.factory, self.dim, self.usable, self.max_overhead = factory, dim, usable, max_overhead
        self.solver, self.time_limit_s, self.repeats, self.say = solver, time_limit_s, repeats, say
        self.parallel = parallel
        self.probes: dict[int, Probe] = {}
        self.graphs: dict[int, CostGraph] = {}
        self.results: dict[int, SolveResult] = {}
        self.order: list[int] = []

    def tried(self) -> list[Probe]:
        return [self.probes[n] for n in self.order]

    def build(self, n: int) -> tuple[nn.Module, tuple[Any, ...], Any]:
        out = self.factory(**{self.dim: n})
        if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
            raise ValueError(f"factory({self.dim}={n}) returned {type(out).__name__}; expected "
                             "(model, inputs) or (model, inputs, loss_fn)")
        return out[0], as_tuple(out[1]), out[2] if len(out) == 3 else None

    def graph(self, n: int) -> CostGraph:
        if n not in self.graphs:
            self.say(f"profiling {self.dim}={n}")
            model, inputs, loss_fn = self.build(n)
            if self.parallel is None:
                gm = trace(model, inputs, loss_fn=loss_fn)
                self.graphs[n] = profile_traced(gm, model, inputs, repeats=self.repeats,
                                                name=type(model).__name__)
            else:
                self.graphs[n] = self.per_rank(model, inputs, loss_fn)[1]
        return self.graphs[n]

    def per_rank(self, model: nn.Module, inputs: tuple[Any, ...], loss_fn: Any) -> Any:
        """`profile_units` of one rank, as `solve` profiles it: (step, graph, inputs, units)."""
        return profile_units(model, inputs, "default", parallel=self.parallel,
                             loss_fn=loss_fn, repeats=self.repeats, name=type(model).__name__)

    def min_peak(self, n: int) -> int:
        """The least predicted peak any schedule reaches at size ``n``."""
        p = self.probe(n)
        if p.min_peak_bytes is not None:
            return p.min_peak_bytes
        try:
            solve_graph(self.graph(n), 1, solver=self.solver, time_limit_s=self.time_limit_s)
            least = 1
        except InfeasibleBudgetError as e:
            least = e.min_feasible_bytes
        self.probes[n] = Probe(p.size, p.fits, p.reason, least, p.peak_bytes, p.overhead)
        return least

    def probe(self, n: int) -> Probe:
        if n in self.probes:
            return self.probes[n]
        g = self.graph(n)
        self.say(f"solving {self.dim}={n}")
        try:
            r = solve_graph(g, self.usable, solver=self.solver, time_limit_s=self.time_limit_s)
        except InfeasibleBudgetError as e:
            p = Probe(n, False, f"no schedule fits: the least peak is "
                      f"{format_bytes(e.min_feasible_bytes)} > {format_bytes(self.usable)}",
                      e.min_feasible_bytes, None, None)
        else:
            est = r.estimate
            self.results[n] = r
            over = self.max_overhead is not None and est.overhead > self.max_overhead
            p = Probe(n, not over, f"the plan that fits needs +{est.overhead:.1%} overhead > "
                      f"the limit +{self.max_overhead:.1%}" if over else "", None,
                      est.peak_bytes, est.overhead)
        self.probes[n] = p
        self.order.append(n)
        return p

    def bracket(self, first: int) -> int | None:
        """The size where the line through the least peaks at ``first`` and ``2 * first``
        meets the usable budget (None when the peak does not grow with the size)."""
        a, b = first, 2 * first
        ma, mb = self.min_peak(a), self.min_peak(b)
        if mb <= ma:
            return None
        slope = (mb - ma) / (b - a)
        return max(1, int(a + (self.usable - ma) / slope))

    def run(self, guess: int | None, limit: int) -> int:
        """The largest fitting size, by a galloping search from ``guess`` and bisection over
        the sizes known to fit and not to fit."""
        known = [n for n, p in self.probes.items() if n <= limit]
        lo = max([n for n in known if self.probes[n].fits], default=0)
        hi = min([n for n in known if not self.probes[n].fits and n > lo], default=None)
        g = min(max(1, guess or lo or 1), limit)
        if (hi is None or lo < g < hi) and g not in self.probes:
            if self.probe(g).fits:
                lo = g
            else:
                hi = g
        step = 1
        while hi is not None and hi - lo > 1:  # gallop down from a failed guess
            n = max(lo + 1, hi - step)
            if self.probe(n).fits:
                lo = n
                break
            hi, step = n, step * 2
        step = 1
        while hi is None:  # gallop up
            n = lo + step
            if n > limit:
                raise ValueError(f"every {self.dim} up to limit={limit} fits the budget; "
                                 "raise limit or lower the budget")
            if self.probe(n).fits:
                lo, step = n, step * 2
            else:
                hi = n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.probe(mid).fits:
                lo = mid
            else:
                hi = mid
        return lo

    def confirm(self, n: int, budget_bytes: int) -> tuple[Plan, Measurement | None]:
        """``n``'s plan on a fresh model, measured; a measured peak over the usable budget
        marks ``n`` as not fitting. A plan of one rank is built as `solve` builds it (profiled
        again, on the fresh model) and not measured."""
        r, g = self.results[n], self.graphs[n]
        model, inputs, loss_fn = self.build(n)
        units = None
        if self.parallel is None:
            module = rewrite(trace(model, inputs, loss_fn=loss_fn), r.schedule, model)
        else:
            self.say(f"building the plan of {self.dim}={n}")
            gm, graph, inputs, units = self.per_rank(model, inputs, loss_fn)
            r = replace(r, schedule=stamped(r.schedule, gm, units))
            module = planned_module(gm, graph, r.schedule, model, inputs, why=units.why)
        plan = Plan(module=module, schedule=r.schedule,
                    estimate=r.estimate, status=r.status, gap=r.gap, solve_s=r.solve_s,
                    graph=g, result=r, budget_bytes=budget_bytes,
                    unconstrained_peak_bytes=simulate(g, Schedule.none(g)).peak_bytes,
                    **({"units": units} if units is not None else {}))
        if self.parallel is not None:
            return plan, None
        self.say(f"measuring {self.dim}={n}")
        m = measure(plan.module, inputs, loss_fn=loss_fn, repeats=self.repeats)
        if m.peak_bytes > self.usable:
            p = self.probes[n]
            self.probes[n] = Probe(n, False, f"measured peak {format_bytes(m.peak_bytes)} > "
                                   f"{format_bytes(self.usable)}", p.min_peak_bytes,
                                   p.peak_bytes, p.overhead)
        return plan, m
