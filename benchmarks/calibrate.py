"""Issue 37's "Calibrate against what runs": node times and predicted steps beside measured ones.

    python benchmarks/calibrate.py --write                # GPT, U-Net, HF GPT-2; 5 rounds
    python benchmarks/calibrate.py --compiled --write     # with torch.compile rows (slow)
    python benchmarks/calibrate.py --quick --examples gpt # a smoke test: tiny sizes, 1 round

For each example (`peers.EXAMPLES`: the GPT example, the U-Net, Hugging Face GPT-2 at their
default sizes; ``--quick``: `peers.QUICK`'s tiny ones) the step is profiled three ways, on one
torch thread: (a) for real (``mode="real"``, node times measured in the step), (b) under fake
tensors with ``times="isolated"`` (each node run alone at full size) and (c) with
``times="roofline"`` on this machine's roofline, measured first (`_calibrate_kinds.
measure_spec`: peak FLOP/s of a float32 ``mm``, bandwidth of a large copy, the cost of a
one-element op).

Op kinds: the nodes of each profile, matched by name (nodes missing from any profile are
left out and counted in the title), grouped by op kind (a module call's class, a function's
or method's name; `_calibrate_kinds.op_kind`), with each kind's forward and backward seconds
added up in each profile and the isolated and roofline totals over the real ones. The kinds
with the most real time are shown, the rest as ``other``, then the total; the title gives
each profile's unscheduled step, which also holds backward work outside the nodes.

Predicted step against measured: the real and the isolated profile are each solved
(`scheduler.solve_graph`, ``--time-limit`` seconds) at 50%, 70% and 90% of the real profile's
unscheduled predicted peak, and beside them ``none`` (`Schedule.none`); each plan applied
(`scheduler.apply`). All plans of an example are timed in ``--rounds`` interleaved rounds of
one training step each (zero gradients, forward, the default loss the profile used,
backward; `_peers_variants.time_rounds`), and each plan's median measured step is shown
beside its predicted step (`Estimate.step_s`: the profile's unscheduled step plus the
plan's recompute). With ``--compiled``, the real profile is also solved for compiled
execution (``execution="compiled"``) and each plan run as ``torch.compile(plan)``: its
predicted step is the measured step of the compiled unscheduled plan plus the plan's
compiled recompute in this run's seconds (`peers.compiled_step_ratios`). Inductor takes one
to two minutes a plan on a 2-core CPU, and each example compiles four (the base and three
budgets): about 2 minutes in all at the ``--quick`` sizes, where only 90% is feasible.

Nothing is asserted; timings are comparable only within one run on an otherwise idle
machine. ``--write`` replaces the ``calibrate`` section of ``docs/benchmarks.md``
(`_record.record`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path
import _record
from _calibrate_kinds import KindTimes, kind_times, measure_spec, op_kind
from _peers_variants import Variant, compiled, fresh_compiles, time_rounds
from peers import EXAMPLES, QUICK, compiled_step_ratios

import scheduler
from scheduler.cost.compiled import compiled_costs
from scheduler.quantities import format_bytes, format_seconds

#: the examples run by default (`peers.EXAMPLES` keys)
DEFAULT_EXAMPLES = ("gpt", "unet", "hf_gpt2")
BUDGETS = ("50%", "70%", "90%")
#: the profiles whose plans are measured
SOLVED = ("real", "isolated")
#: op kinds shown by name; the rest are added up as "other"
TOP = 8
#: a prediction this close to the measured step counts as calibrated
WITHIN = 0.10


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", default=",".join(DEFAULT_EXAMPLES),
                    help=f"comma-separated, of {', '.join(EXAMPLES)} "
                         f"(default: {','.join(DEFAULT_EXAMPLES)})")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds (one step of every plan each); default 5, quick 1")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed steps per profile (default 3, quick 1)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds per solve (default 20, quick 2)")
    ap.add_argument("--compiled", action="store_true",
                    help="also plans for execution='compiled', run under torch.compile (slow)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, 1 round, short solves: a smoke test, not a result")
    _record.add_write_option(ap)
    args = ap.parse_args(argv)
    args.keys = [k.strip() for k in args.examples.split(",") if k.strip()]
    unknown = [k for k in args.keys if k not in EXAMPLES]
    if unknown:
        ap.error(f"unknown example {unknown[0]!r}; choose from {', '.join(EXAMPLES)}")
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.time_limit = args.time_limit or (2.0 if args.quick else 20.0)
    for name, v in (("--rounds", args.rounds), ("--repeats", args.repeats)):
        if v < 1:
            ap.error(f"{name} must be at least 1, got {v}")
    return args


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Profile, solve, apply and time every example: ``{"spec": DeviceSpec, "examples":
    [one dict per example]}``."""
    import torch

    torch.set_num_threads(1)
    if args.compiled:
        fresh_compiles()
    say("measuring this machine's roofline")
    spec = measure_spec(quick=args.quick)
    profiles = [("real", {"mode": "real"}),
                ("isolated", {"mode": "fake", "times": "isolated"}),
                ("roofline", {"mode": "fake", "times": "roofline", "device_spec": spec})]
    out = []
    for key in args.keys:
        label = f"{key} (quick sizes)" if args.quick else EXAMPLES[key][0]
        if key == "hf_gpt2" and importlib.util.find_spec("transformers") is None:
            say(f"{label}: skipped (pip install transformers)")
            continue
        model, inputs = importlib.import_module(EXAMPLES[key][1]).build(
            **(QUICK[key] if args.quick else EXAMPLES[key][2]))
        graphs, failed = {}, {}
        for name, opts in profiles:
            say(f"{label}: profiling ({name})")
            try:
                graphs[name] = scheduler.profile(model, inputs, repeats=args.repeats,
                                                 units=None, **opts)
            except scheduler.FakeProfileError as e:  # e.g. a graph that depends on the batch
                failed[name] = str(e).split(";")[0]
        ex = {"label": label, "graphs": graphs, "failed": failed, "plans": []}
        kind = op_kind(model)
        names = [{n.name for n in g.nodes} for g in graphs.values()]
        common = set.intersection(*names)
        ex["unmatched"] = {p: len(n - common) for p, n in zip(graphs, names) if n - common}
        ex["kinds"] = {p: kind_times(g, kind, common) for p, g in graphs.items()}
        unscheduled = scheduler.simulate(graphs["real"], scheduler.Schedule.none(graphs["real"]))
        for profile in [p for p in SOLVED if p in graphs]:
            ex["plans"] += plans(model, inputs, graphs[profile], profile, unscheduled.peak_bytes,
                                 args, label)
        if args.compiled:
            ex["plans"] += plans(model, inputs, graphs["real"], "real", unscheduled.peak_bytes,
                                 args, label, execution="compiled")
        timed = [p for p in ex["plans"] if p["variant"] is not None]
        say(f"{label}: timing {len(timed)} plans")
        steps = [statistics.median(ts) for ts in
                 time_rounds([p["variant"] for p in timed], args.rounds, say)]
        for p, s in zip(timed, steps):
            p["measured_s"] = s
        if args.compiled:  # the compiled plans' predictions start from the compiled base's step
            none = next(i for i, p in enumerate(timed) if p["profile"] == "real")
            order = [none] + [i for i, p in enumerate(timed) if p["execution"] == "compiled"]
            vs = [timed[i]["variant"] for i in order]
            compiled_step_ratios(vs, [steps[i] for i in order], graphs["real"].measured_step_s)
            for i, v in zip(order[1:], vs[1:]):
                timed[i]["predicted_s"] = v.predicted["step_ratio"] * steps[none]
        out.append(ex)
    return {"spec": spec, "examples": out}


def plans(model: Any, inputs: tuple[Any, ...], graph: Any, profile: str, peak_bytes: int,
          args: argparse.Namespace, label: str, execution: str = "eager") -> list[dict[str, Any]]:
    """``none`` and a plan at each of `BUDGETS` of ``peak_bytes``, solved on ``graph`` for
    ``execution`` and applied to ``model``: dicts with the predicted step (None for a compiled
    plan until its base is timed) and the `Variant` to time (None when infeasible)."""
    out = []
    for budget in ("none", *BUDGETS):
        row = {"profile": profile, "execution": execution, "budget": budget,
               "budget_bytes": None, "status": "", "predicted_s": None, "measured_s": None}
        if budget == "none":
            schedule = scheduler.Schedule.none(graph)
            row["predicted_s"] = scheduler.simulate(graph, schedule).step_s
        else:
            row["budget_bytes"] = scheduler.parse_budget(budget, peak_bytes)
            say(f"{label}: solving {profile} at {budget}" + (f" ({execution})"
                                                             if execution != "eager" else ""))
            try:
                result = scheduler.solve_graph(graph, row["budget_bytes"], execution=execution,
                                               time_limit_s=args.time_limit)
            except scheduler.InfeasibleBudgetError:
                out.append({**row, "status": "INFEASIBLE", "variant": None})
                continue
            schedule, row["status"] = result.schedule, result.status
            row["predicted_s"] = result.estimate.step_s
        module = scheduler.apply(model, schedule, inputs)
        # (`compiled_step_ratios` finds the compiled base by this name)
        name = ("ours none compiled" if (execution, budget) == ("compiled", "none")
                else f"{profile} {budget} {execution}")
        if execution == "compiled":
            v = Variant(name, "compiled", None, inputs, compiled=True,  # type: ignore[arg-type]
                        predicted={"compiled_recompute_s": scheduler.simulate(
                            compiled_costs(graph), schedule, timeline=False).recompute_s})
            v.module = compiled(module, None, v.graphs)
            row["predicted_s"] = None
        else:
            v = Variant(name, "eager", module, inputs)
        out.append({**row, "variant": v})
    return out


def ratio(x: float, real: float) -> str:
    return f"{x / real:.2f}" if real > 0 else "-"


def kinds_table(ex: dict[str, Any]) -> Any:
    """Table 1 for one example: node times by op kind in each profile."""
    from rich.table import Table

    kinds, graphs = ex["kinds"], ex["graphs"]
    profiles = list(kinds)
    real = kinds["real"]
    order = sorted(real, key=lambda k: -real[k].total_s)
    shown, rest = order[:TOP], order[TOP:]
    steps = ", ".join(f"{p} {format_seconds(g.measured_step_s)}" for p, g in graphs.items())
    unmatched = ("; nodes not in every profile, left out: " + ", ".join(
        f"{p} {n}" for p, n in ex["unmatched"].items())) if ex["unmatched"] else (
        "; the profiles' node names match")
    t = Table(title=f"{ex['label']}: node times by op kind (forward / backward, added up over "
                    f"the kind's nodes); unscheduled steps: {steps}{unmatched}",
              title_justify="left")
    t.add_column("op kind", justify="left")
    t.add_column("nodes", justify="right")
    for p in profiles:
        t.add_column(f"{p} fwd / bwd", justify="right")
        if p != "real":
            t.add_column(f"{p} / real", justify="right")

    def add(name: str, per: dict[str, KindTimes]) -> None:
        cells = [name, str(per["real"].count)]
        for p in profiles:
            k = per[p]
            cells.append(f"{format_seconds(k.fwd_s)} / {format_seconds(k.bwd_s)}")
            if p != "real":
                cells.append(ratio(k.total_s, per["real"].total_s))
        t.add_row(*cells)

    def summed(names: list[str]) -> dict[str, KindTimes]:
        return {p: KindTimes(sum(kinds[p][k].count for k in names),
                             sum(kinds[p][k].fwd_s for k in names),
                             sum(kinds[p][k].bwd_s for k in names)) for p in profiles}

    for k in shown:
        add(k, {p: kinds[p].get(k, KindTimes()) for p in profiles})
    if rest:
        add(f"other ({len(rest)} kinds)", summed(rest))
    add("total", summed(order))
    return t


def steps_table(examples: list[dict[str, Any]], rounds: int) -> Any:
    """Table 2: each plan's predicted step beside its measured one."""
    from rich.table import Table

    t = Table(title=f"Predicted step against measured (median of {rounds} interleaved "
                    f"round(s), 1 thread)", title_justify="left")
    for col in ("example", "profile", "budget", "status", "predicted step", "measured step",
                "predicted / measured", f"within {WITHIN:.0%}"):
        t.add_column(col, justify="left" if col in ("example", "profile", "status") else "right")
    for ex in examples:
        for p in ex["plans"]:
            base = p["execution"] == "compiled" and p["budget"] == "none"
            budget = p["budget"] + (" (base)" if base else "") + (
                f" ({format_bytes(p['budget_bytes'])})" if p["budget_bytes"] else "")
            profile = p["profile"] + (", compiled" if p["execution"] == "compiled" else "")
            pred, meas = p["predicted_s"], p["measured_s"]
            if pred is None or meas is None:
                t.add_row(ex["label"], profile, budget, p["status"], "-", "-", "-", "-")
                continue
            r = pred / meas
            t.add_row(ex["label"], profile, budget, p["status"], format_seconds(pred),
                      format_seconds(meas), f"{r:.3f}",
                      "-" if base else ("yes" if abs(r - 1) <= WITHIN else "no"))
    return t


def summary(examples: list[dict[str, Any]]) -> str:
    """How many plans' predictions are within `WITHIN` of the measured step, and the worst."""
    rows = [(ex["label"], p) for ex in examples for p in ex["plans"]
            if p["predicted_s"] is not None and p["measured_s"] is not None
            and not (p["execution"] == "compiled" and p["budget"] == "none")]
    if not rows:
        return "No plan was measured."
    within = sum(abs(p["predicted_s"] / p["measured_s"] - 1) <= WITHIN for _, p in rows)
    label, worst = max(rows, key=lambda r: abs(r[1]["predicted_s"] / r[1]["measured_s"] - 1))
    return (f"{within} of {len(rows)} predicted steps are within {WITHIN:.0%} of the measured "
            f"ones; the worst is {worst['predicted_s'] / worst['measured_s']:.3f} ({label}, "
            f"{worst['profile']} profile, {worst['budget']}, {worst['execution']}).")


def report(results: dict[str, Any], args: argparse.Namespace, argv: list[str] | None) -> None:
    """Print the tables and, with ``--write``, record them in ``docs/benchmarks.md``."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    s = results["spec"]
    parts = [f"Roofline of this machine ({s.name}): {s.flops_fp32 / 1e9:.1f} GFLOP/s float32, "
             f"{s.bandwidth / 1e9:.1f} GB/s, {s.per_op_s * 1e6:.1f} us per op."]
    console.print(parts[0])
    tables = [kinds_table(ex) for ex in results["examples"]]
    tables.append(steps_table(results["examples"], args.rounds))
    for t in tables:
        console.print(t)
        parts.append(_record.markdown_table(t))
    failed = [f"{ex['label']} {p}: {why}" for ex in results["examples"]
              for p, why in ex["failed"].items()]
    if failed:
        parts.append("Not profiled: " + "; ".join(failed) + ".")
    parts.append(summary(results["examples"]))
    for line in parts[len(tables) + 1:]:
        console.print(line)
    if args.write:
        path = _record.record("calibrate", "\n\n".join(parts), device="cpu",
                              command=_record.command_line(__file__, argv))
        say(f"updated {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report(collect(args), args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
