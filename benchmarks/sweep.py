"""Every model the project knows, planned at 90%, 70% and 50% and checked: one row per model and
budget.

    python benchmarks/sweep.py                          # every model, prints the table
    python benchmarks/sweep.py --models mlp,llama       # a subset (names: --list)
    python benchmarks/sweep.py --write                  # also docs/benchmarks.md's section
    python benchmarks/sweep.py --models mlp --out x.md  # ... or another file's

The models are `_models.ALL`'s: the examples at their test sizes, the configurations of the
recorded graphs (``graphs/*.json``), the tiny Hugging Face architectures the tests build and
torchtitan's Llama 3 debug model. Each is traced and profiled once (one timed repeat); then,
for each budget (a fraction of the unscheduled predicted peak), solved (``auto``, time-limited),
applied, measured for one step (`scheduler.measure` with ``allocator=True``: the storage
tracker's count of the tensors, and the allocator's count from the profiler's memory events,
which also sees kernels' scratch) and trained for one step against the unmodified model (loss
and every gradient, random ops seeded alike).

A row's verdict is ``ok`` when the plan traced, solved, fits its budget by both counts and
gives the unmodified model's loss and gradients bit for bit (a replay runs the same CPU
kernels on the same inputs: any difference is a bug), or, where the traced graph itself
rounds otherwise than the eager model (the `torch.export` path's SDPA), the traced step's
without checkpointing bit for bit (the verdict says so, with that difference); ``below floor`` when the solver proves
no schedule fits (the floor is named: that is an answer, not a failure); ``skipped`` when an
optional package is missing; ``FAIL: why`` otherwise. The exit status is 1 when a row fails.
Warnings raised along the way are named in their own column. With ``--write`` (or ``--out``)
the table replaces the ``sweep`` section of docs/benchmarks.md (`_record.record`: date,
machine, command line).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md, the models
import _models  # noqa: E402
import _record  # noqa: E402

__all__ = ["BUDGETS", "Row", "main", "markdown", "sweep_model"]

#: the budgets, as fractions of the unscheduled predicted peak
BUDGETS = ("90%", "70%", "50%")
SECTION = "sweep"


@dataclass
class Row:
    """One model at one budget (``budget`` is ``"-"`` where the model did not get that far)."""

    model: str
    budget: str
    tracer: str = "-"  # "fx" / "export", or what stopped the trace
    status: str = "-"
    solver: str = "-"
    budget_bytes: int | None = None
    tensors_bytes: int | None = None  # the storage tracker's peak
    allocator_bytes: int | None = None  # the allocator's peak
    grad_diff: float | None = None  # max |grad - the unmodified model's grad| over parameters
    loss_diff: float | None = None
    # where loss or gradients differ from the model's: whether they are, bit for bit, those of
    # the traced step without checkpointing (the tracer's own rounding, not the plan's)
    traced_same: bool | None = None
    traced_diff: float | None = None
    verdict: str = "ok"
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.verdict.startswith("FAIL")


def _short(e: BaseException, width: int = 160) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= width else text[:width - 3] + "..."


def _call(module: Any, inputs: Any) -> Any:
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


def _train_step(module: Any, params: list[Any], inputs: Any, loss_of: Callable[[Any], Any]
                ) -> tuple[Any, list[Any]]:
    """One step's loss and every parameter's gradient (None where it got none), with the
    random ops seeded alike for every module."""
    import torch

    for p in params:
        p.grad = None
    torch.manual_seed(0)
    loss = loss_of(_call(module, inputs))
    loss.backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach().clone(), grads


def _max_diff(got: list[Any], want: list[Any]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if (g is None) != (w is None):
            return math.inf
        if g is not None:
            worst = max(worst, (g.float() - w.float()).abs().max().item())
    return worst


def _budget_cell(measured: int | None, budget: int | None) -> str:
    if measured is None or budget is None:
        return "-"
    return f"{measured:,} / {budget:,} ({measured / budget:.1%})"


def sweep_model(name: str, build: Callable[[], Any], *, budgets: tuple[str, ...] = BUDGETS,
                time_limit_s: float = 10.0) -> list[Row]:
    """The rows of one model: trace and profile it once, then plan, measure and train it at
    each budget. Never raises for the model's sake: what went wrong is the row's verdict."""
    import torch

    import scheduler
    from scheduler.budget import InfeasibleBudgetError
    from scheduler.capture.trace import default_loss_recipe
    from scheduler.plan import solve_graph

    seen: list[str] = []

    def caught(ws: list[Any]) -> None:
        for w in ws:
            name_ = w.category.__name__
            if name_ not in seen and not issubclass(w.category, DeprecationWarning):
                seen.append(name_)

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        try:
            model, inputs = build()
        except _models.Unavailable as e:
            return [Row(name, "-", verdict=f"skipped: {_short(e, 120)}")]
        except Exception as e:  # noqa: BLE001 - a row, not a crash of the sweep
            return [Row(name, "-", verdict=f"FAIL: building it raised {_short(e)}")]
        try:
            graph = scheduler.profile(model, inputs, repeats=1, units=None)
        except Exception as e:  # noqa: BLE001
            return [Row(name, "-", tracer=f"failed: {_short(e, 100)}",
                        verdict=f"FAIL: tracing/profiling raised {_short(e)}")]
        tracer = str(graph.meta.get("tracer", "?"))
        params = [p for p in model.parameters() if p.requires_grad]
        try:
            out = _call(model, inputs)
            loss_of = default_loss_recipe(out)
            del out
            want_loss, want_grads = _train_step(model, params, inputs, loss_of)
        except Exception as e:  # noqa: BLE001
            return [Row(name, "-", tracer=tracer,
                        verdict=f"FAIL: the unmodified model's step raised {_short(e)}")]
    caught(ws)
    unplanned: list[Any] = []  # (the traced step's loss and gradients, once, where needed)

    def traced_step() -> tuple[Any, list[Any]]:
        if not unplanned:
            module = scheduler.apply(model, scheduler.Schedule.none(graph), inputs)
            unplanned.append(_train_step(module, params, inputs, loss_of))
        return unplanned[0]

    rows = []
    for budget in budgets:
        row = Row(name, budget, tracer=tracer)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            try:
                result = solve_graph(graph, budget, time_limit_s=time_limit_s)
                row.status, row.solver = result.status, result.solver
                row.budget_bytes = result.budget_bytes
                module = scheduler.apply(model, result.schedule, inputs)
                m = scheduler.measure(module, inputs, repeats=1, warmup=0, allocator=True)
                row.tensors_bytes, row.allocator_bytes = m.peak_bytes, m.allocator_peak_bytes
                loss, grads = _train_step(module, params, inputs, loss_of)
                row.loss_diff = abs(loss.float() - want_loss.float()).item()
                row.grad_diff = _max_diff(grads, want_grads)
                if row.loss_diff or row.grad_diff:
                    t_loss, t_grads = traced_step()
                    row.traced_same = bool(torch.equal(loss, t_loss)) and _max_diff(
                        grads, t_grads) == 0
                    row.traced_diff = _max_diff(t_grads, want_grads)
                row.verdict = _verdict(row)
            except InfeasibleBudgetError as e:
                row.status = "INFEASIBLE"
                row.verdict = (f"below floor: the smallest budget that fits is "
                               f"{e.min_feasible_bytes:,} B")
            except Exception as e:  # noqa: BLE001
                row.verdict = f"FAIL: {_short(e)}"
                traceback.print_exc(file=sys.stderr)
        row.warnings = [w.category.__name__ for w in ws
                        if not issubclass(w.category, DeprecationWarning)]
        row.warnings = list(dict.fromkeys(seen + row.warnings))
        row.seconds = time.perf_counter() - t0
        rows.append(row)
    rows[0].seconds += time.perf_counter() - start - sum(r.seconds for r in rows)
    return rows


def _verdict(row: Row) -> str:
    why = []
    if row.tensors_bytes is not None and row.tensors_bytes > row.budget_bytes:
        why.append("over budget by the tensors' count")
    if row.allocator_bytes is not None and row.allocator_bytes > row.budget_bytes:
        why.append(f"over budget by the allocator's count "
                   f"(+{row.allocator_bytes - row.budget_bytes:,} B)")
    differs = bool(row.loss_diff or row.grad_diff)
    if differs and not row.traced_same:
        why.append("loss differs" if row.loss_diff else "gradients differ")
    if why:
        return "FAIL: " + "; ".join(why)
    if differs:  # (the plan is exact; the traced graph rounds otherwise than eager does)
        return (f"ok: the traced step's own rounding (without checkpointing it differs from "
                f"the model by {row.traced_diff:.3g} too; the plan equals it bit for bit)")
    return "ok"


HEADERS = ("model", "tracer", "budget", "status", "solver", "tensors: measured / budget",
           "allocator: measured / budget", "grad diff", "verdict", "warnings", "seconds")


def markdown(rows: list[Row]) -> str:
    """The rows as a GitHub markdown table."""
    def diff(x: float | None) -> str:
        return "-" if x is None else ("0" if x == 0 else f"{x:.3g}")

    def cell(text: Any) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    align = [":---"] * 5 + ["---:"] * 3 + [":---"] * 2 + ["---:"]
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        cells = (r.model, r.tracer, r.budget, r.status, r.solver,
                 _budget_cell(r.tensors_bytes, r.budget_bytes),
                 _budget_cell(r.allocator_bytes, r.budget_bytes), diff(r.grad_diff), r.verdict,
                 ", ".join(r.warnings) or "-", f"{r.seconds:.0f}")
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """One paragraph: how many rows passed, failed, were below the floor or skipped."""
    n = len(rows)
    failed = [r for r in rows if r.failed]
    below = sum(r.verdict.startswith("below floor") for r in rows)
    skipped = sum(r.verdict.startswith("skipped") for r in rows)
    text = (f"{n} rows: {n - len(failed) - below - skipped} ok, {len(failed)} failing, "
            f"{below} below the floor, {skipped} skipped.")
    if failed:
        text += " Failing: " + "; ".join(f"{r.model} at {r.budget}" for r in failed) + "."
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="",
                    help="comma-separated model names (default: every model; see --list)")
    ap.add_argument("--list", action="store_true", help="print the model names and exit")
    ap.add_argument("--budgets", default=",".join(BUDGETS),
                    help="comma-separated budgets (default: 90%%,70%%,50%%)")
    ap.add_argument("--time-limit", type=float, default=10.0,
                    help="the solver's time limit per budget, seconds (default 10)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: steadier on a shared machine)")
    _record.add_write_option(ap)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the section into this markdown file instead of "
                         "docs/benchmarks.md (implies --write)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(_models.ALL))
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()] or list(_models.ALL)
    unknown = [n for n in names if n not in _models.ALL]
    if unknown:
        ap.error(f"no model {unknown[0]!r}; the models are: {', '.join(_models.ALL)}")
    import torch

    torch.set_num_threads(args.threads)
    budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
    rows: list[Row] = []
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        new = sweep_model(name, _models.ALL[name], budgets=budgets, time_limit_s=args.time_limit)
        for r in new:
            print(f"   {r.budget}: {r.verdict}", file=sys.stderr, flush=True)
        rows += new
    table = markdown(rows)
    print(table)
    print(summary(rows))
    if args.write or args.out is not None:
        body = (f"{summary(rows)} Budgets are fractions of each model's unscheduled predicted "
                f"peak; solver time limit {args.time_limit:g} s; grad diff is the largest "
                f"absolute difference of any gradient from the unmodified model's (0: bit for "
                f"bit); seconds: profiling (first row) and each budget's solve, measure and "
                f"step.\n\n{table}")
        path = _record.record(SECTION, body, device="cpu",
                              command=_record.command_line(__file__, argv), path=args.out)
        print(f"updated {path}", file=sys.stderr)
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
