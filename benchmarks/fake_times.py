"""Issue 21's "Times that rank plans right": plans from fake-profile times, measured.

    python benchmarks/fake_times.py                   # every example, 50% and 70%
    python benchmarks/fake_times.py --rounds 7 --write
    python benchmarks/fake_times.py --quick           # tiny configurations, 1 round (a smoke test)

For each example (the GPT example at its default size and a larger one, the U-Net, Hugging
Face GPT-2) the step is profiled three ways: (a) for real (``mode="real"``, measured node
times), (b) under fake tensors with ``times="isolated"`` (each node alone at full size) and
(c) with ``times="scaled"`` (a real profile at half the batch, scaled by each node's work).
The memory of the three is the same, so each budget (a fraction of the unscheduled predicted
peak) is the same number of bytes for all of them. Each profile is solved at each budget by
the same solver (``--solver``, default ``auto``, ``--time-limit`` seconds) and the schedule
applied; then every plan's real training step is measured with `scheduler.measure`, one step
each in turns for ``--rounds`` rounds (torch at ``--threads`` threads, default 1), and each
plan's step time is divided by that of the real profile's plan at the same budget measured in
the same round. The table shows the median of those ratios over the rounds (the target:
within 5%, 0.95 to 1.05; below 1 the fake times gave a faster plan), beside whether the
schedule is the real profile's own, the predicted overhead, the measured peak against the
budget and the profile's wall time.

Nothing is asserted, and timings are only comparable within one run on an otherwise idle
machine. With ``--write`` the table also replaces the ``fake_times`` section of
``docs/benchmarks.md`` (`_record.record`: with the date, the machine and this command line).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record

#: (label, example module, build arguments): the full run and ``--quick``
EXAMPLES = [
    ("GPT (default)", "gpt", {}),
    ("GPT (8 layers, 256 wide, batch 8 x 256)", "gpt",
     {"n_layer": 8, "n_embd": 256, "batch": 8, "block_size": 256}),
    ("U-Net (default)", "unet", {}),
    # (batch 4: at the default batch 2, the scaled profile's batch 1 exports another graph)
    ("HF GPT-2 (batch 4)", "hf_gpt2", {"batch": 4}),
]
QUICK = [
    ("GPT (tiny)", "gpt", {"batch": 8, "block_size": 32, "n_layer": 2, "n_head": 2,
                           "n_embd": 32, "vocab_size": 64}),
    ("U-Net (tiny)", "unet", {"batch": 8, "size": 32, "base": 4}),
    ("HF GPT-2 (tiny)", "hf_gpt2", {"batch": 8, "seq_len": 32, "n_layer": 2, "n_head": 2,
                                    "n_embd": 32, "vocab_size": 64}),
]
#: the profiles compared: (label, profile keyword arguments)
PROFILES = [("real", {"mode": "real"}),
            ("isolated", {"mode": "fake", "times": "isolated"}),
            ("scaled", {"mode": "fake", "times": "scaled"})]
BUDGETS = ("50%", "70%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5,
                    help="measurement rounds (one step of every plan each); default 5")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per profile")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--solver", default="auto")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    ap.add_argument("--budgets", default=",".join(BUDGETS),
                    help="comma-separated budgets (default 50%%,70%%)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny configurations, 1 round, 5 s solves: a smoke test, not a result")
    _record.add_write_option(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.time_limit, args.repeats = 1, 5.0, 1
    for name, v in (("--rounds", args.rounds), ("--repeats", args.repeats),
                    ("--threads", args.threads)):
        if v < 1:
            ap.error(f"{name} must be at least 1, got {v}")

    import importlib

    import torch
    from rich.table import Table

    import scheduler
    from scheduler.capture.timing import checkpoint_costs
    from scheduler.report import console as make_console
    from scheduler.quantities import format_bytes, format_seconds

    torch.set_num_threads(args.threads)
    checkpoint_costs(torch.device("cpu"))  # once a process: not in the first profile's time
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    say = make_console().print
    cases: list[dict[str, Any]] = []  # one per (example, budget, profile)
    failed: dict[tuple[str, str], str] = {}  # (example, profile) -> why it could not run
    for label, module, kwargs in (QUICK if args.quick else EXAMPLES):
        try:
            build = importlib.import_module(f"examples.{module}").build
            model, inputs = build(**kwargs)
        except ImportError as e:  # transformers missing
            say(f"skipping {label}: {e}")
            continue
        graphs = {}
        for kind, opts in PROFILES:
            say(f"{label}: profiling ({kind})")
            t0 = time.perf_counter()
            try:
                graphs[kind] = scheduler.profile(model, inputs, repeats=args.repeats,
                                                 units=None, **opts)
            except scheduler.FakeProfileError as e:  # e.g. a graph that depends on the batch
                say(f"  {e}")
                failed[label, kind] = str(e).split(";")[0]
                continue
            graphs[kind].meta["bench_profile_s"] = time.perf_counter() - t0
        unconstrained = scheduler.simulate(graphs["real"],
                                           scheduler.Schedule.none(graphs["real"])).peak_bytes
        for budget in budgets:
            budget_bytes = scheduler.parse_budget(budget, unconstrained)
            for kind, _ in PROFILES:
                if kind not in graphs:
                    continue
                say(f"{label}: solving {kind} at {budget}")
                case = {"example": label, "budget": budget, "budget_bytes": budget_bytes,
                        "kind": kind, "result": None, "graph": graphs[kind], "module": None,
                        "inputs": inputs, "times": [], "peak": 0}
                try:
                    case["result"] = scheduler.solve_graph(
                        graphs[kind], budget_bytes, solver=args.solver,
                        time_limit_s=args.time_limit)
                except scheduler.InfeasibleBudgetError as e:
                    say(f"  {e}")
                else:
                    case["module"] = scheduler.apply(model, case["result"].schedule, inputs)
                cases.append(case)

    for r in range(args.rounds):
        say(f"measuring: round {r + 1}/{args.rounds}")
        for case in cases:
            if case["module"] is None:
                continue
            m = scheduler.measure(case["module"], case["inputs"], repeats=1, warmup=int(r == 0))
            case["times"].append(m.step_s)
            case["peak"] = max(case["peak"], m.peak_bytes)

    def reference(case: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in cases if c["example"] == case["example"]
                    and c["budget"] == case["budget"] and c["kind"] == "real")

    table = Table(title=f"Plans from fake-profile node times, measured against the real "
                        f"profile's plan at the same budget ({args.solver}, "
                        f"{args.time_limit:g} s solves, {args.rounds} round(s), "
                        f"{torch.get_num_threads()} thread(s))", title_justify="left")
    for col in ("example", "budget", "times", "status", "same schedule", "predicted overhead",
                "measured step", "/ real plan", "peak measured", "fits", "profile time"):
        table.add_column(col, justify="left" if col in ("example", "times", "status")
                         else "right")
    for case in cases:
        ref, res = reference(case), case["result"]
        row = [case["example"], f"{case['budget']} ({format_bytes(case['budget_bytes'])})",
               case["kind"]]
        if res is None:
            table.add_row(*row, "INFEASIBLE", *["-"] * 6,
                          format_seconds(case["graph"].meta["bench_profile_s"]))
            continue
        same = ("-" if case is ref else "n/a" if ref["result"] is None else
                "yes" if res.schedule.regions == ref["result"].schedule.regions else "no")
        ratios = [t / rt for t, rt in zip(case["times"], ref["times"])]
        table.add_row(
            *row, res.status, same, f"{res.estimate.overhead:+.1%}",
            format_seconds(statistics.median(case["times"])),
            f"{statistics.median(ratios):.3f}" if ratios else "-",
            format_bytes(case["peak"]), "yes" if case["peak"] <= case["budget_bytes"] else "NO",
            format_seconds(case["graph"].meta["bench_profile_s"]))
    for (label, kind), why in failed.items():
        table.add_row(label, "-", kind, "NOT PROFILED", *["-"] * 6, why[:60])
    make_console().print(table)
    if failed:
        say("not profiled: " + "; ".join(f"{label} {kind}: {why}"
                                          for (label, kind), why in failed.items()))
    if args.write:
        device = next((str(next(c["module"].parameters()).device) for c in cases
                       if c["module"] is not None), "cpu")
        path = _record.record("fake_times", _record.markdown_table(table), device=device,
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
