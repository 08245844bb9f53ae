"""Issue 21's "Too big to run, planned anyway": a GPT whose unscheduled step does not fit the
machine, planned from a fake profile, then one real step of the plan.

    python benchmarks/fake_big.py                          # ~40 GB unscheduled, 8 GB budget
    python benchmarks/fake_big.py --times isolated --write
    python benchmarks/fake_big.py --n-layer 4 --block-size 512 --budget 60%   # a smoke run

The default model (`examples/gpt.py` at batch 2, sequence 2048, 40 layers of width 512 with 8
heads, dropout 0.1) keeps, per layer, the attention weights, their dropout mask and the
dropped weights (``B*H*T^2`` elements each: SDPA with dropout takes the math path on the
CPU), about 1 GB, so the unscheduled step is predicted at about 40 GB, more than a 24 GB
machine has, while one layer at a time fits a few GB: a budget of 8 GB is feasible.

Two phases, each in its own process (``--phase``, not for use by hand), so that each one's
memory is its own:

1. **plan**: build the model, `scheduler.solve` it with ``mode="fake"`` at the budget and save
   the schedule. It reports the predicted unscheduled peak, the plan's predicted peak, the
   profile time (from the start of `solve` to its "solving" step), the solver's time, and the
   process's own peak memory beyond the built model: its peak RSS (``ru_maxrss``) so far less
   its RSS once the model and inputs exist (the parameters, torch and Python). Then
   `scheduler.profile` with ``mode="auto"`` (roofline times: the choice of mode comes before
   the times) shows which profile the default picks by itself: the fake one when the
   unscheduled step does not fit the machine's free memory (at a size that fits it runs the
   step for real, which is why it comes after the peak RSS is read).
2. **run**: build the same model, `scheduler.apply` the saved schedule and run ONE real training
   step under a `StorageTracker` (live tensor storages, parameters and inputs included: what
   `scheduler.measure` reports on the CPU, which would run two steps or more), timed; also its
   process's peak RSS. The step time includes the tracker's bookkeeping per op.

The table says, for each acceptance, whether it holds: the unscheduled peak exceeds the
machine's memory; the profiler's own peak is within 2 GiB beyond the parameters; the measured
peak is within the budget. With ``--write`` the table replaces the ``fake_big`` section of
``docs/benchmarks.md`` (`_record.record`: with the date, the machine and this command line).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record

#: the profiler's own memory beyond the model's parameters that the acceptance allows
OWN_LIMIT = 2 << 30


def rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc/self/statm``; else its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def available_bytes() -> int | None:
    """The machine's available memory (`measurement.storage.free_bytes` of the CPU)."""
    import torch

    from scheduler.measurement.storage import free_bytes

    return free_bytes(torch.device("cpu"))


def total_bytes() -> int | None:
    """The machine's physical memory, None where it is not known."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan_phase(config: dict[str, Any], *, budget: str, times: str, device_spec: str,
               schedule: str, threads: int, time_limit: float) -> dict[str, Any]:
    """Build the model, solve it from a fake profile, save the schedule; what it measured."""
    import torch

    import scheduler
    from examples.gpt import build

    torch.set_num_threads(threads)
    model, inputs = build(**config)
    after_build = rss_bytes()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    marks: dict[str, float] = {}

    def progress(msg: str) -> None:
        if msg.startswith("solving") and "solving" not in marks:
            marks["solving"] = time.perf_counter()

    spec = device_spec if times == "roofline" else None
    solve, profile = scheduler.solve, scheduler.profile  # (imported now, not timed)
    t0 = time.perf_counter()
    plan = solve(model, inputs, budget=budget, mode="fake", times=times, device_spec=spec,
                 time_limit_s=time_limit, progress=progress)
    total_s = time.perf_counter() - t0
    plan.save(schedule)
    peak_rss = peak_rss_bytes()  # (before the auto profile, which may run the step for real)
    t1 = time.perf_counter()
    auto = profile(model, inputs, mode="auto", times="roofline", device_spec="cpu")
    auto_s = time.perf_counter() - t1
    auto_unscheduled = scheduler.simulate(auto, scheduler.Schedule.none(auto)).peak_bytes
    return {
        "param_bytes": params,
        "rss_after_build": after_build,
        "peak_rss": peak_rss,
        "auto_peak_rss": peak_rss_bytes(),
        "auto_s": auto_s,
        "unscheduled": plan.unconstrained_peak_bytes,
        "budget": plan.budget_bytes,
        "predicted_peak": plan.estimate.peak_bytes,
        "predicted_overhead": plan.estimate.overhead,
        "predicted_step_s": plan.estimate.step_s,
        "profile_s": marks.get("solving", t0 + total_s) - t0,
        "solve_s": plan.solve_s,
        "total_s": total_s,
        "solver": plan.result.solver,
        "status": plan.status,
        "regions": len(plan.schedule.regions),
        "recomputed": len(plan.schedule.recompute_regions),
        "nodes": len(plan.graph.nodes),
        "profile": plan.graph.meta.get("profile", {}),
        "times": plan.graph.meta.get("times"),
        "auto_profile": auto.meta.get("profile", {}),
        "auto_unscheduled": auto_unscheduled,
    }


def run_phase(config: dict[str, Any], *, schedule: str, threads: int) -> dict[str, Any]:
    """Build the model, apply the saved schedule and run one real training step, tracked."""
    import torch

    import scheduler
    from examples.gpt import build
    from scheduler.measurement.storage import StorageTracker, state_tensors

    torch.set_num_threads(threads)
    model, inputs = build(**config)
    module = scheduler.apply(model, schedule, inputs)
    after_build = rss_bytes()
    params = list(module.parameters())
    tracker = StorageTracker()
    for t in state_tensors(module, inputs):
        tracker.register(t)
    base = tracker.current_bytes
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    with tracker:
        loss = module(*inputs)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise TypeError(f"the planned GPT returned {type(loss).__name__}, not a scalar loss")
        loss.backward()
    step_s = time.perf_counter() - t0
    grads = sum(p.grad is not None for p in params)
    return {"measured_peak": tracker.peak_bytes, "base_bytes": base, "step_s": step_s,
            "loss": float(loss.detach()), "grads": grads, "params": len(params),
            "rss_after_build": after_build, "peak_rss": peak_rss_bytes()}


def phase_result(phase: str, args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    """Run one phase (``"plan"`` or ``"run"``) in this process, with the options ``args``."""
    if phase == "plan":
        return plan_phase(config_of(args), budget=args.budget, times=args.times,
                          device_spec=args.device_spec, schedule=schedule,
                          threads=args.threads, time_limit=args.time_limit)
    return run_phase(config_of(args), schedule=schedule, threads=args.threads)


def run_child(phase: str, args: argparse.Namespace, schedule: str) -> dict[str, Any]:
    """Run one phase of this script in a fresh Python process; its result (JSON)."""
    with tempfile.TemporaryDirectory(prefix="fake_big.") as tmp:
        out = Path(tmp) / "result.json"
        model = [x for k, v in config_of(args).items()
                 for x in (f"--{k.replace('_', '-')}", str(v))]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, *model,
               "--schedule", schedule, "--result", str(out), "--budget", args.budget,
               "--times", args.times,
               "--device-spec", args.device_spec, "--threads", str(args.threads),
               "--time-limit", str(args.time_limit)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"fake_big: the {phase} phase failed (exit code "
                             f"{proc.returncode}; its output is above)")
        return json.loads(out.read_text())


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """The `examples.gpt.build` keyword arguments the options give."""
    return {"batch": args.batch, "block_size": args.block_size, "n_layer": args.n_layer,
            "n_head": args.n_head, "n_embd": args.n_embd, "vocab_size": args.vocab_size,
            "dropout": args.dropout}


def table_of(args: argparse.Namespace, plan: dict[str, Any], run: dict[str, Any] | None,
             note: str = "") -> Any:
    """The results as a rich ``Table``: quantity, value, and the acceptance it is held to."""
    from rich.table import Table

    from scheduler.quantities import format_bytes, format_seconds

    c = config_of(args)
    title = (f"examples/gpt.py at batch {c['batch']}, sequence {c['block_size']}, "
             f"{c['n_layer']} layers, width {c['n_embd']}, {c['n_head']} heads, dropout "
             f"{c['dropout']}; times={plan['times']!r}; real step on {args.threads} torch "
             f"thread(s)")
    table = Table(title=title, title_justify="left")
    for col, justify in (("quantity", "left"), ("value", "right"), ("acceptance", "left")):
        table.add_column(col, justify=justify)
    machine = total_bytes()
    # (ru_maxrss and the current RSS are read differently: a few KiB apart when nothing grew)
    own = max(0, plan["peak_rss"] - plan["rss_after_build"])
    rows = [
        ("predicted unscheduled peak", format_bytes(plan["unscheduled"]),
         "" if machine is None else
         f"> machine's {format_bytes(machine)}: "
         f"{'yes' if plan['unscheduled'] > machine else 'NO'}"),
        ("budget", format_bytes(plan["budget"]), ""),
        ("model parameters", format_bytes(plan["param_bytes"]), ""),
        ("profiler's own peak (peak RSS beyond the built model)", format_bytes(own),
         f"<= {format_bytes(OWN_LIMIT)}: {'yes' if own <= OWN_LIMIT else 'NO'}"),
        ("profiler's peak RSS (all)", format_bytes(plan["peak_rss"]), ""),
        ("profile time (fake, trace + record + node times)", format_seconds(plan["profile_s"]),
         ""),
        ("solve time", format_seconds(plan["solve_s"]),
         (f"{plan['solver']}, {plan['status']}, {plan['recomputed']}/{plan['regions']} "
          f"regions recomputed, {plan['nodes']} nodes")),
        ("predicted peak of the plan", format_bytes(plan["predicted_peak"]),
         f"predicted recompute +{plan['predicted_overhead']:.1%}"),
        ("mode='auto' picks", plan["auto_profile"].get("mode", "?"),
         (f"{plan['auto_profile'].get('why', '')}; profiled in "
          f"{format_seconds(plan['auto_s'])}, unscheduled "
          f"{format_bytes(plan['auto_unscheduled'])}")),
    ]
    if run is None:
        rows.append(("measured peak (one real step)", "not run", note))
    else:
        fits = run["measured_peak"] <= plan["budget"]
        rows += [
            ("measured peak (one real step)", format_bytes(run["measured_peak"]),
             (f"<= budget: {'yes' if fits else 'NO'}; "
              f"{run['measured_peak'] / plan['predicted_peak']:.3f}x predicted")),
            ("step time (one real step)", format_seconds(run["step_s"]),
             f"predicted {format_seconds(plan['predicted_step_s'])} ({plan['times']})"),
            ("real step's peak RSS (all)", format_bytes(run["peak_rss"]), ""),
        ]
    for row in rows:
        table.add_row(*row)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=2048, help="sequence length")
    ap.add_argument("--n-layer", type=int, default=40)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--dropout", type=float, default=0.1,
                    help="(0 lets the CPU's SDPA take its flash path, which saves no B*H*T^2)")
    ap.add_argument("--budget", default="8GB", help="the budget (default 8GB, 8e9 bytes)")
    ap.add_argument("--times", default="roofline", choices=("roofline", "isolated", "scaled"),
                    help="the fake profile's node times (default roofline)")
    ap.add_argument("--device-spec", default="cpu", help="for --times roofline (default cpu)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="the solver's time limit")
    ap.add_argument("--plan-only", action="store_true", help="skip the real step")
    _record.add_write_option(ap)
    ap.add_argument("--phase", choices=("plan", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--schedule", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be at least 1, got {args.threads}")

    if args.phase is not None:  # a child process: one phase, its result as JSON
        out = phase_result(args.phase, args, args.schedule)
        Path(args.result).write_text(json.dumps(out))
        return 0

    from scheduler.report import console as make_console
    from scheduler.quantities import format_bytes

    with tempfile.TemporaryDirectory(prefix="fake_big.") as tmp:
        schedule = str(Path(tmp) / "schedule.json")
        print("planning (fake profile) in a subprocess ...", file=sys.stderr)
        plan = run_child("plan", args, schedule)
        run, note = None, "--plan-only"
        available = available_bytes()
        # the step's tensors, plus about 1 GiB for torch, Python and the allocator
        needed = plan["predicted_peak"] + (1 << 30)
        if not args.plan_only and available is not None and available < needed:
            note = (f"the machine has {format_bytes(available)} available, the planned step "
                    f"needs about {format_bytes(needed)} (its predicted peak and 1 GiB)")
            print(f"fake_big: not running the real step: {note}", file=sys.stderr)
        elif not args.plan_only:
            print("running one real step of the plan in a subprocess ...", file=sys.stderr)
            run = run_child("run", args, schedule)
    table = table_of(args, plan, run, note)
    make_console().print(table)
    if args.write:
        path = _record.record("fake_big", _record.markdown_table(table), device="cpu",
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
