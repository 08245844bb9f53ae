"""Issue 21's CUDA check: plans from fake CUDA profiles, measured on a CUDA device.

    python benchmarks/cuda_check.py                         # every example, 70% and 50%
    python benchmarks/cuda_check.py --models gpt,unet --budgets 0.5
    python benchmarks/cuda_check.py --write                 # also docs/benchmarks.md

Without a CUDA device it prints ``skipped: no CUDA device ...`` and exits 0 (the test suite
runs it that way). On one (a few minutes on an H200) it checks, for each example (the GPT
example at its default size and at a larger one, the U-Net, and the Hugging Face GPT-2 when
``transformers`` is installed):

1. **Memory events, fake against real.** The model on the device is profiled for real
   (``mode="real"``), and under fake tensors twice: built on the CPU and planned for
   ``device="cuda"`` (planning for a device the model is not on), and on the device itself
   (``mode="fake"``). Compared with the real profile: each node's output bytes, the tensors it
   saves (source and bytes), its forward allocations and frees (bytes, in order), each backward
   step's gradient allocations and frees, and the predicted unscheduled peak. PASS when all are
   identical.
2. **Predicted against measured peaks.** The fake profile of the model built on the CPU is
   solved (`scheduler.solve_graph`) at each budget, the schedule applied (`scheduler.apply`)
   to the model moved to the device, and one training step run after one warm-up:
   ``torch.cuda.reset_peak_memory_stats`` right before it, then
   ``torch.cuda.max_memory_allocated``. What is allocated when the step begins beside the
   model's parameters, buffers and inputs (the cuBLAS workspaces, held from the first matmul
   on) is outside any profile, so the step's own peak is how far the allocator rose in the
   step plus those (as `scheduler.measure` counts it on CUDA); the table shows both. PASS
   when the step's own peak is within 3% of the predicted one. The unscheduled step (the
   model itself) is a row too.

The exit code is 1 when anything FAILs. With ``--write`` the tables replace the
``cuda_check`` section of ``docs/benchmarks.md`` (`_record.record`).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record

#: how far a measured peak may be from its prediction
TOLERANCE = 0.03
SKIP_MESSAGE = "skipped: no CUDA device (torch.cuda.is_available() is False)"


def models() -> dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]]:
    """The examples checked, by name: each a function building ``(model, inputs)`` on the CPU."""
    from examples import gpt, unet

    out: dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]] = {
        "gpt": gpt.build,
        "gpt-large": lambda: gpt.build(batch=8, block_size=1024, n_layer=12, n_head=12,
                                       n_embd=768, vocab_size=8192),
        "unet": unet.build,
    }
    if importlib.util.find_spec("transformers") is not None:
        from examples import hf_gpt2
        out["hf_gpt2"] = hf_gpt2.build
    return out


def to_device(inputs: tuple[Any, ...], device: Any) -> tuple[Any, ...]:
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)


def memory_events(graph: Any) -> dict[str, Any]:
    """What a profile records of memory, with storage ids replaced by bytes (ids are the
    recorder's own): per node, output bytes and saved (source, bytes); per node, its forward
    events; per backward step, its node and events. A real profile's kernel scratch, which a
    fake one cannot see, is left out (`scratch.without_scratch`)."""
    from scheduler.capture.scratch import without_scratch

    graph = without_scratch(graph)
    size = {sid: s.bytes for sid, s in graph.storages.items()}
    return {
        "nodes": {n.name: (n.out_bytes, tuple((s.source, s.bytes) for s in n.saved))
                  for n in graph.nodes},
        "fwd": {k: tuple((e[0], size.get(e[1], -1)) for e in v)
                for k, v in graph.fwd_events.items()},
        "bwd": tuple((s.node, tuple((e[0], e[2]) for e in s.events)) for s in graph.bwd_steps),
    }


def differences(real: Any, fake: Any) -> list[str]:
    """Where the fake profile's memory events differ from the real one's (empty: identical)."""
    a, b = memory_events(real), memory_events(fake)
    out = []
    if list(a["nodes"]) != list(b["nodes"]):
        out.append(f"nodes differ: {len(a['nodes'])} real, {len(b['nodes'])} fake")
    for name in a["nodes"]:
        ra, fa = a["nodes"][name], b["nodes"].get(name)
        if fa is not None and ra[0] != fa[0]:
            out.append(f"{name}: output {ra[0]} bytes real, {fa[0]} fake")
        if fa is not None and sorted(ra[1]) != sorted(fa[1]):
            out.append(f"{name}: saved {sum(x[1] for x in ra[1])} bytes in {len(ra[1])} real, "
                       f"{sum(x[1] for x in fa[1])} in {len(fa[1])} fake")
        if a["fwd"].get(name, ()) != b["fwd"].get(name, ()):
            out.append(f"{name}: forward events {a['fwd'].get(name, ())} real, "
                       f"{b['fwd'].get(name, ())} fake")
    if a["bwd"] != b["bwd"]:
        bad = [i for i, (x, y) in enumerate(zip(a["bwd"], b["bwd"])) if x != y]
        first = f", first at step {bad[0]} ({a['bwd'][bad[0]][0]})" if bad else ""
        out.append(f"backward steps differ: {len(a['bwd'])} real, {len(b['bwd'])} fake{first}")
    return out


def step_peaks(module: Any, inputs: tuple[Any, ...], device: Any) -> tuple[int, int]:
    """``(max_memory_allocated, the step's own peak)`` of one training step after a warm-up.

    The step's own peak is how far the allocator rose above where the step began, plus the
    model's parameters, buffers and inputs (what a profile's peak starts from), as
    `scheduler.measure` counts it on CUDA. What else was allocated when the step began (the
    cuBLAS workspaces of the forward and the backward thread, allocated by the first step
    that ran a matmul and held from then on) is in ``max_memory_allocated`` only."""
    import torch

    from scheduler.capture.trace import default_loss_recipe
    from scheduler.measurement.storage import base_bytes

    params = list(module.parameters())
    loss_fn = (getattr(module, "loss_fn", None)
               or getattr(getattr(module, "forward", None), "loss_fn", None))

    def step() -> None:
        for p in params:
            p.grad = None
        out = module(*inputs)
        loss = (loss_fn or default_loss_recipe(out))(out)
        del out
        loss.backward()

    step()  # warm-up
    for p in params:
        p.grad = None
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    raw = torch.cuda.max_memory_allocated(device)
    for p in params:
        p.grad = None
    return raw, raw - start + base_bytes(module, inputs)


def check_model(name: str, build: Callable[[], Any], args: argparse.Namespace, device: Any,
                events: list[list[str]], peaks: list[list[str]]) -> bool:
    """Both checks for one model; appends rows to ``events`` and ``peaks``; whether all passed."""
    import torch

    import scheduler
    from scheduler.quantities import format_bytes, format_seconds

    ok = True
    spec = args.device_spec if args.times == "roofline" else None
    t0 = time.perf_counter()
    model, inputs = build()
    fake = scheduler.profile(model, inputs, mode="fake", device="cuda", times=args.times,
                             device_spec=spec, units=None)
    fake_s = time.perf_counter() - t0
    model = model.to(device)
    dinputs = to_device(inputs, device)
    fake_on = scheduler.profile(model, dinputs, mode="fake", times=args.times, device_spec=spec,
                                units=None)
    t1 = time.perf_counter()
    real = scheduler.profile(model, dinputs, mode="real", units=None)
    real_s = time.perf_counter() - t1
    none_real = scheduler.simulate(real, scheduler.Schedule.none(real)).peak_bytes
    for label, g in (("fake, model on cpu", fake), ("fake, model on cuda", fake_on)):
        diff = differences(real, g)
        none_fake = scheduler.simulate(g, scheduler.Schedule.none(g)).peak_bytes
        passed = not diff and none_fake == none_real
        ok = ok and passed
        events.append([name, label, str(len(g.nodes)), format_bytes(none_fake),
                       format_bytes(none_real), f"{none_fake / none_real:.4f}",
                       str(len(diff)), "; ".join(diff[:3]) or "identical",
                       "PASS" if passed else "FAIL"])
    del fake_on

    cases: list[tuple[str, Any, int]] = [("none", model, scheduler.simulate(
        fake, scheduler.Schedule.none(fake)).peak_bytes)]
    for b in args.budgets:
        try:
            r = scheduler.solve_graph(fake, b, time_limit_s=args.time_limit)
        except scheduler.InfeasibleBudgetError as e:
            peaks.append([name, f"{b:.0%}", "infeasible", "", "", "", "",
                          f"SKIP (smallest feasible {format_bytes(e.min_feasible_bytes)})"])
            continue
        module = scheduler.apply(model, r.schedule, dinputs)
        cases.append((f"{b:.0%} ({r.solver} {r.status})", module, r.estimate.peak_bytes))
    for label, module, predicted in cases:
        gc.collect()
        torch.cuda.empty_cache()
        raw, own = step_peaks(module, dinputs, device)
        passed = abs(own / predicted - 1) <= TOLERANCE
        ok = ok and passed
        peaks.append([name, label, format_bytes(predicted), format_bytes(raw),
                      format_bytes(own), f"{raw / predicted:.4f}", f"{own / predicted:.4f}",
                      "PASS" if passed else "FAIL"])
    print(f"{name}: fake profile {format_seconds(fake_s)}, real profile "
          f"{format_seconds(real_s)}, checked in {format_seconds(time.perf_counter() - t0)}",
          file=sys.stderr)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all",
                    help="comma-separated: gpt, gpt-large, unet, hf_gpt2 (default all)")
    ap.add_argument("--budgets", default="0.7,0.5",
                    help="fractions of the predicted unscheduled peak (default 0.7,0.5)")
    ap.add_argument("--times", default="roofline", choices=("roofline", "isolated", "scaled"),
                    help="the fake profiles' node times (default roofline; they choose the "
                         "schedule, not its memory)")
    ap.add_argument("--device-spec", default="h200", help="for --times roofline (default h200)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="the solver's time limit")
    _record.add_write_option(ap)
    args = ap.parse_args(argv)
    try:
        args.budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets must be comma-separated fractions such as 0.7,0.5, got "
                 f"{args.budgets!r}")
    if not all(0 < b <= 1 for b in args.budgets):
        ap.error(f"--budgets must be fractions in (0, 1], got {args.budgets}")

    import torch

    if not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        return 0

    from rich.table import Table

    from scheduler.report import console as make_console

    available = models()
    names = list(available) if args.models == "all" else args.models.split(",")
    unknown = [n for n in names if n not in available]
    if unknown:
        ap.error(f"unknown or unavailable --models {unknown}; choose from {list(available)}"
                 + ("" if "hf_gpt2" in available else " (hf_gpt2 needs transformers)"))
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = f"{device} ({torch.cuda.get_device_name(device)})"
    events: list[list[str]] = []
    peaks: list[list[str]] = []
    ok = True
    for name in names:
        try:
            ok = check_model(name, available[name], args, device, events, peaks) and ok
        except Exception as e:  # noqa: BLE001 - one model's failure must not hide the others
            ok = False
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)  # (the table keeps 200)
            peaks.append([name, "error", "", "", "", "", "",
                          f"FAIL: {type(e).__name__}: {first[:200]}"])
        gc.collect()
        torch.cuda.empty_cache()

    t_events = Table(title=f"Memory events of fake CUDA profiles against the real one on {gpu}",
                     title_justify="left")
    for col in ("model", "fake profile", "nodes", "unscheduled (fake)", "unscheduled (real)",
                "fake / real", "differences", "first differences", "check"):
        t_events.add_column(col, justify="right" if col in ("nodes", "fake / real",
                                                            "differences") else "left")
    for row in events:
        t_events.add_row(*row)
    t_peaks = Table(title=f"Predicted peaks (fake CUDA profile, model built on the CPU) against "
                          f"torch.cuda.max_memory_allocated on {gpu}; PASS within "
                          f"{TOLERANCE:.0%} (the step's own peak)", title_justify="left")
    for col in ("model", "budget", "predicted", "max_memory_allocated", "step's own peak",
                "max / predicted", "own / predicted", "check"):
        t_peaks.add_column(col, justify="left" if col in ("model", "budget", "check")
                           else "right")
    for row in peaks:
        t_peaks.add_row(*row)
    console = make_console()
    console.print(t_events)
    console.print(t_peaks)
    print("all checks PASS" if ok else "some checks FAIL (see the tables)")
    if args.write:
        body = f"{_record.markdown_table(t_events)}\n\n{_record.markdown_table(t_peaks)}"
        path = _record.record("cuda_check", body, device=gpu,
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
