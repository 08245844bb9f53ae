"""Our plans raced against what a PyTorch user would pick instead, at matched measured peaks.

    python benchmarks/peers.py --write                 # the full race: docs/benchmarks.md, docs/peers.png
    python benchmarks/peers.py --quick --no-compile    # a smoke test: tiny models, one round
    python benchmarks/peers.py --examples gpt --device cuda --rounds 5   # the race on CUDA

For each example (the GPT example at its default size and at 8 layers, width 256, batch 8 x
256; Hugging Face GPT-2 from a config with random weights; the U-Net; a tiny Hugging Face
Llama, 4 layers, width 64, batch 2 x 128, SDPA attention, `_hf_llama`) it builds these
training steps, all on one torch thread:

* ``none``: the model as it is; ``every_block``: ``torch.utils.checkpoint`` around each
  repeated block, by hand; ``sqrt``: ``checkpoint_sequential``-style, sqrt(n) segments of
  blocks, the last kept (our ``sqrt`` baseline's schedule, applied); ``selective AC``: each
  block under ``checkpoint`` with torchtitan's selective policy (save matmul and attention
  outputs, every second ``mm`` recomputed, recompute the rest; `_peers_variants.titan_policy`);
* ``compile B``: ``torch.compile`` (inductor) with ``activation_memory_budget`` B, for B in 1.0,
  0.8, 0.6, 0.4, 0.2, 0.0; and ``compile B twin``, the first of them compiled again apart:
  the same step, whose time differs from its first's by the race's own spread;
* ``ours B``: our plan (``solve_graph``, solver ``auto``) at a budget B equal to each measured
  peak of the compiled variants, at 85% and 70% of the lowest of them, and at the measured
  peaks of ``every_block``, ``sqrt`` and ``selective AC`` (budgets within 1% of each other
  merged into the lower), run eagerly; a plan whose eager peak measures above its budget is
  solved again at the budget less the excess (`our_plan`);
* ``ours B compiled``: at the compile peaks and below them, our plan for compiled execution
  run as ``torch.compile(plan.module)``, found as ``solve(..., execution="compiled")`` finds
  it: a few candidate plans compiled and measured, the fastest whose compiled peak measures
  within B kept (`our_compiled_plan`, `scheduler.compiled_fit.fit_compiled_form`; tried where
  no eager plan fits B too); and ``ours none compiled``, our module without checkpointing
  compiled, the compiled base whose measured step the compiled plans' predictions start from
  (`compiled_step_ratios`).

Step times are medians over ``--rounds`` interleaved rounds (each round runs every variant
once) and are given over ``none``'s. Against each other choice, our fastest compiled plan at
no higher peak is also given round by round: the lowest and highest of its step over the
choice's in the same round, and read as ``faster`` (at the medians), ``within spread``
(slower at the medians, but not in every round or by no more than the twins differ) or
``slower`` (`_peers_report`). Every variant's peak is measured the same way, from the
profiler's memory events (`measurement.compiled.compiled_peak`: it sees inductor's
allocations); for the eager variants the storage tracker's peak (`scheduler.measure`) is
shown beside it. Where our cost model has a schedule for a variant (``none``, ``every_block``
as our ``every_block`` schedule, ``sqrt``, our plans) its predicted peak and predicted step
(over the predicted unscheduled step) are shown beside the measured ones; for a compiled plan
the predicted peak is the eager step's (the cost model does not predict inductor's buffers)
and the predicted step is the compiled base's measured step plus the plan's compiled
replays. The FX-graph and
AOT-autograd caches are off and each compiled variant has its own backend and module copy, so
no budget reuses another's graph; the ``graphs`` column counts the graphs each compiled.

Compiling takes one to two minutes a graph on a loaded 2-core CPU and each example compiles
about a dozen (the GPT example at its default size took 22 minutes in all, load average about
5), so the full race runs for one to two hours; ``--examples`` runs some of them. ``--write`` replaces the ``peers``
section of ``docs/benchmarks.md`` (``peers_cuda`` with ``--device cuda``; `_record.record`)
and writes the plot (``--png``).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo as dynamo
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path
import _record
from _peers_report import matched, mib, plot, table
from _peers_variants import (
    Variant,
    block_paths,
    compiled,
    fresh_compiles,
    peaks,
    time_rounds,
    titan_policy,
    wrap_blocks,
)

import scheduler
from scheduler.budget import InfeasibleBudgetError
from scheduler.compiled_fit import fit_compiled_form
from scheduler.cost.compiled import compiled_costs
from scheduler.cost.simulate import simulate
from scheduler.ir.schedule import Schedule
from scheduler.solvers import get_solver

#: key -> (label, example module, build keywords)
EXAMPLES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt": ("GPT (default)", "examples.gpt", {}),
    "gpt_large": ("GPT (8 layers, 256 wide, batch 8 x 256)", "examples.gpt",
                  dict(n_layer=8, n_embd=256, batch=8, block_size=256)),
    "hf_gpt2": ("HF GPT-2 (random weights)", "examples.hf_gpt2", {}),
    "unet": ("U-Net (default)", "examples.unet", {}),
    "hf_llama": ("HF Llama (4 layers, 64 wide, batch 2 x 128, random weights)", "_hf_llama",
                 {}),
}
#: ``--quick``: tiny sizes (seconds to profile)
QUICK: dict[str, dict[str, Any]] = {
    "gpt": dict(batch=2, block_size=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
    "gpt_large": dict(batch=2, block_size=32, n_layer=3, n_head=2, n_embd=32, vocab_size=64),
    "hf_gpt2": dict(batch=2, seq_len=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
    "unet": dict(batch=2, channels=3, size=16, base=4, classes=2),
    "hf_llama": dict(batch=2, seq_len=16, n_layer=2, hidden=32, vocab_size=64),
}
COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
#: our plans below compile's lowest peak, as fractions of it
BELOW = (0.85, 0.7)
#: how many times `our_plan` solves again when a plan measures above its budget
RESOLVE = 3
#: without compiled variants (``--no-compile``), our plans at these fractions of none's peak
NO_COMPILE = (0.7, 0.5)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def merged(budgets: list[tuple[int, bool]], rel: float = 0.01) -> list[tuple[int, bool]]:
    """``(bytes, compile too)`` budgets sorted, each within ``rel`` above a kept one merged
    into it (the lower budget stands for both; compile too if either is)."""
    out: list[tuple[int, bool]] = []
    for b, c in sorted(budgets):
        if out and b <= out[-1][0] * (1 + rel):
            out[-1] = (out[-1][0], out[-1][1] or c)
        else:
            out.append((b, c))
    return out


def our_plan(graph: Any, model: Any, inputs: tuple[Any, ...], budget: int, *,
             time_limit_s: float, predicted: Any) -> Variant | None:
    """Our plan (``auto``) whose peak, measured by the profiler's memory events, is at most
    ``budget``: solved at ``budget``, and if it measures above (the profiler also counts what
    ops allocate and free inside themselves, which the cost model does not), solved once more
    at ``budget`` less the excess, up to `RESOLVE` times. None when no schedule fits."""
    target, v = budget, None
    for attempt in range(RESOLVE + 1):
        try:
            result = scheduler.solve_graph(graph, target, time_limit_s=time_limit_s)
        except InfeasibleBudgetError:
            return v
        v = Variant(f"ours {budget / 2**20:.3f} MiB", "ours",
                    scheduler.apply(model, result.schedule, inputs), inputs,
                    budget_bytes=budget, predicted=predicted(result.schedule),
                    note="solved again below the budget" if attempt else "")
        v.peaks = peaks(v)
        if v.peaks[0] <= budget:
            break
        target -= v.peaks[0] - budget
    return v


def our_compiled_plan(graph: Any, model: Any, inputs: tuple[Any, ...], budget: int, *,
                      time_limit_s: float, predicted: Any, ceiling: int) -> Variant | None:
    """``torch.compile`` of our plan for compiled execution, found as ``solve(...,
    execution="compiled")`` finds it (`scheduler.compiled_fit.fit_compiled_form`): candidate
    plans (``execution="compiled"``: replays priced as under ``torch.compile``, `cost.compiled`,
    in their compiled form, `cost.compiled_form`, then as solved if no form fits)
    compiled and their peaks measured by the profiler's memory events, the solver's target
    moved by each measurement, the one with the least compiled recompute whose compiled peak
    is at most ``budget`` kept (``ceiling``: the unscheduled predicted peak, the highest
    target worth solving at). None when no plan's compiled peak measures within
    ``budget``."""
    def solve_at(target: int, whole: bool) -> Any:
        return scheduler.solve_graph(graph, target, time_limit_s=time_limit_s,
                                     execution="compiled", measured=whole)

    def build_and_measure(result: Any) -> tuple[Variant, int]:
        c = Variant(f"ours {budget / 2**20:.3f} MiB compiled", "ours compiled", None,  # type: ignore
                    inputs, compiled=True, budget_bytes=budget,
                    predicted=predicted(result.schedule, "compiled"))
        c.module = compiled(scheduler.apply(model, result.schedule, inputs), None, c.graphs)
        c.step()
        c.peaks = peaks(c)
        return c, c.peaks[0]

    try:
        try:
            first = solve_at(budget, True)
        except InfeasibleBudgetError as e:  # (compiled, the least plan may fit: try it)
            if e.min_feasible_bytes is None:
                raise
            first = solve_at(e.min_feasible_bytes, True)
        fit = fit_compiled_form(budget, first, ceiling, solve_at, build_and_measure,
                                progress=say)
    except InfeasibleBudgetError:
        return None
    c: Variant = fit.module
    c.note = f"{len(fit.tries)} plan{'' if len(fit.tries) == 1 else 's'} compiled"
    return c


def race(key: str, *, quick: bool, compile_budgets: tuple[float, ...], rounds: int,
         time_limit_s: float, compile_plans: bool, device: str = "cpu") -> dict[str, Any]:
    """Build, measure and time every variant of one example; returns its rows."""
    label, module_name, kwargs = EXAMPLES[key]
    model, inputs = importlib.import_module(module_name).build(
        **(QUICK[key] if quick else kwargs))
    model = model.to(device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    say(f"{label}: profiling")
    graph = scheduler.profile(model, inputs, repeats=3, units=None)
    unscheduled = simulate(graph, Schedule.none(graph), timeline=False)

    compiled_graph = compiled_costs(graph)

    def predicted(schedule: Any, execution: str = "eager") -> dict[str, float]:
        """The eager cost model's peak, and the eager step over the unscheduled one; or, for
        ``execution="compiled"``, the compiled replays' seconds (`compiled_step_ratios` makes
        a step of them once the compiled base is timed)."""
        if execution == "compiled":  # (the compiled view's peaks are the graph's)
            est = simulate(compiled_graph, schedule, timeline=False)
            return {"peak_bytes": est.peak_bytes, "compiled_recompute_s": est.recompute_s}
        est = simulate(graph, schedule, timeline=False)
        return {"peak_bytes": est.peak_bytes, "step_ratio": est.step_s / unscheduled.step_s}

    def baseline(name: str) -> Any:
        return get_solver(name)(graph, 1 << 62).schedule

    paths = block_paths(graph)
    variants = [
        Variant("none", "user", model, inputs, predicted=predicted(Schedule.none(graph))),
        Variant("every_block", "user", wrap_blocks(model, paths), inputs,
                predicted=predicted(baseline("every_block"))),
        Variant("sqrt", "user", scheduler.apply(model, baseline("sqrt"), inputs), inputs,
                predicted=predicted(baseline("sqrt"))),
        Variant("selective AC", "user", wrap_blocks(model, paths, titan_policy), inputs),
    ]
    dynamo.reset()
    # each compile budget, and the first again (``twin``: the same step compiled apart, whose
    # difference from its first is the race's own spread, `_peers_report.twin_spread`)
    for b, family in [(b, "compile") for b in compile_budgets] + [
            (b, "twin") for b in compile_budgets[:1]]:
        name = f"compile {b:.1f}" + (" twin" if family == "twin" else "")
        v = Variant(name, family, None, inputs, compiled=True)  # type: ignore
        v.module = compiled(copy.deepcopy(model), b, v.graphs)
        say(f"{label}: compiling {name}")
        v.step()
        variants.append(v)
    if compile_plans and compile_budgets:
        # our module with no checkpointing, compiled: the compiled step our plans add their
        # compiled replays to (`compiled_step_ratios`)
        v = Variant("ours none compiled", "ours compiled", None, inputs,  # type: ignore
                    compiled=True, predicted=predicted(Schedule.none(graph), "compiled"))
        v.module = compiled(scheduler.apply(model, Schedule.none(graph), inputs), None, v.graphs)
        say(f"{label}: compiling {v.name}")
        v.step()
        variants.append(v)
    for v in variants:
        say(f"{label}: peak of {v.name}")
        v.peaks = peaks(v)
    # our plans: at each compile peak and below the lowest (eager and compiled), and at the
    # other baselines' peaks (eager)
    wanted = [(v.peaks[0], True) for v in variants if v.family == "compile"]
    if wanted:
        low = min(b for b, _ in wanted)
        wanted += [(int(low * f), True) for f in BELOW]
    else:  # (no compiled variants: fractions of the unscheduled step's measured peak)
        wanted = [(int(variants[0].peaks[0] * f), False) for f in NO_COMPILE]
    wanted += [(v.peaks[0], False) for v in variants if v.family == "user" and v.name != "none"]
    infeasible, no_compiled = [], []
    for budget, with_compiled in merged(wanted):
        say(f"{label}: solving at {budget} bytes")
        ours = our_plan(graph, model, inputs, budget, time_limit_s=time_limit_s,
                        predicted=predicted)
        if ours is None:
            infeasible.append(budget)
        else:
            variants.append(ours)
        if compile_plans and with_compiled:
            say(f"{label}: compiling our plan for {budget} bytes")
            c = our_compiled_plan(graph, model, inputs, budget, time_limit_s=time_limit_s,
                                  predicted=predicted, ceiling=unscheduled.peak_bytes)
            if c is None:
                no_compiled.append(budget)
            else:
                variants.append(c)
    say(f"{label}: timing {len(variants)} variants")
    times = time_rounds(variants, rounds, say)
    base = statistics.median(times[0])  # (none's)
    compiled_step_ratios(variants, [statistics.median(ts) for ts in times],
                         graph.measured_step_s)
    rows = []
    for v, ts in zip(variants, times):
        step = statistics.median(ts)
        rows.append(dict(name=v.name, family=v.family, budget=v.budget_bytes,
                         peak=v.peaks[0], tracked=v.peaks[1], step_s=step, note=v.note,
                         ratio=step / base, graphs=v.graphs[0] if v.compiled else None,
                         round_s=list(ts),
                         **{f"predicted_{k}": x for k, x in v.predicted.items()}))
    return dict(key=key, label=label, rows=rows, infeasible=infeasible,
                no_compiled=no_compiled, rounds=rounds, device=device,
                nodes=len(graph.compute_nodes), blocks=len(paths),
                inputs=graph.meta.get("inputs", ""))


def compiled_step_ratios(variants: list[Variant], steps: list[float],
                         profiled_step_s: float) -> None:
    """Give each compiled plan of ours a predicted step over ``none``'s
    (``predicted["step_ratio"]``): the measured step of our module compiled without
    checkpointing (``ours none compiled``, the compiled base) plus its compiled replays
    (`cost.compiled`), these converted from the profile's seconds to this run's by the ratio
    of ``none``'s step here (``steps[0]``) to the profiled one: the compiled counterpart of
    the eager prediction, which adds replays to the profiled unscheduled step."""
    names = [v.name for v in variants]
    if "ours none compiled" not in names or profiled_step_s <= 0:
        return
    base = steps[names.index("ours none compiled")]
    scale = steps[0] / profiled_step_s
    for v in variants:
        rc = v.predicted.get("compiled_recompute_s")
        if rc is not None:
            v.predicted["step_ratio"] = (base + rc * scale) / steps[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES),
                        help=f"comma-separated, of {', '.join(EXAMPLES)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one round, budgets 1.0 and 0.4: a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7)")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave torch.compile out (no compile variants, no compiled plans; "
                             "our plans at fractions of none's measured peak instead)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="our solver's time limit per budget, seconds (default 30; quick 2)")
    parser.add_argument("--compile-budgets", default=None,
                        help="comma-separated activation_memory_budget values to race (default "
                             f"{','.join(map(str, COMPILE_BUDGETS))}; quick 1.0,0.4): fewer "
                             "compile, for a run that must fit a time limit")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the race runs: cpu (default) or cuda (peaks from "
                             "torch.cuda.max_memory_allocated)")
    parser.add_argument("--png", type=Path, default=None,
                        help="the plot (default: docs/peers.png, docs/peers_cuda.png on CUDA)")
    parser.add_argument("--section", default=None,
                        help="with --write, the section of docs/benchmarks.md to replace "
                             "(default: peers, peers_cuda on CUDA): a run of some examples "
                             "beside the full race")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.examples.split(",") if k.strip()]
    unknown = [k for k in keys if k not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example {unknown[0]!r}; choose from {', '.join(EXAMPLES)}")
    rounds = args.rounds or (1 if args.quick else 7)
    if rounds < 1 or (not args.quick and rounds < 5):
        parser.error(f"--rounds must be >= 5 (>= 1 with --quick), got {rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (torch "
                     f"{torch.__version__}); run it on a machine with one")
    if args.png is None:
        args.png = ROOT / "docs" / ("peers.png" if args.device == "cpu" else "peers_cuda.png")
    torch.set_num_threads(1)
    fresh_compiles()
    budgets = () if args.no_compile else ((1.0, 0.4) if args.quick else COMPILE_BUDGETS)
    if args.compile_budgets is not None and not args.no_compile:
        try:
            budgets = tuple(float(b) for b in args.compile_budgets.split(",") if b.strip())
        except ValueError:
            budgets = ()
        if not budgets or any(not 0 <= b <= 1 for b in budgets):
            parser.error(f"--compile-budgets must be fractions in [0, 1], comma-separated, "
                         f"got {args.compile_budgets!r}")
    results, parts = [], []
    for key in keys:
        if key.startswith("hf_") and importlib.util.find_spec("transformers") is None:
            say(f"{key}: skipped (pip install transformers)")
            parts.append(f"{EXAMPLES[key][0]}: skipped (transformers is not installed)")
            continue
        res = race(key, quick=args.quick, compile_budgets=budgets, rounds=rounds,
                   time_limit_s=args.time_limit or (2.0 if args.quick else 30.0),
                   compile_plans=not args.no_compile, device=args.device)
        results.append(res)
        tables = [table(res), matched(res)]
        for t in tables:
            _print(t)
        note = (f"\n\nNo eager plan fits {', '.join(mib(b) for b in res['infeasible'])} MiB."
                if res["infeasible"] else "")
        if res["no_compiled"]:
            note += (f"\n\nNo compiled plan measured within "
                     f"{', '.join(mib(b) for b in res['no_compiled'])} MiB.")
        parts.append("\n\n".join(_record.markdown_table(t) for t in tables) + note)
    if results:
        plot(results, args.png)
        say(f"wrote {args.png}")
    if args.write:
        section = args.section or ("peers" if args.device == "cpu" else "peers_cuda")
        # (a plot written outside docs/ is not linked from it)
        image = (f"\n\n![peak against step time]({args.png.name})"
                 if args.png.resolve().parent == ROOT / "docs" else "")
        path = _record.record(section, "\n\n".join(parts) + image, device=args.device,
                              command=_record.command_line(__file__, argv))
        say(f"updated {path}")
    return 0


def _print(t: Any) -> None:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(t)


if __name__ == "__main__":
    sys.exit(main())
