"""Predicted against measured time per logical batch of the options `scheduler.advise` prices.

On the GPT example, `advise` is run with a device memory the step does not fit, so that it
prices checkpointing alone and gradient accumulation over 2, 4, ... micro-batches with and
without checkpointing. Each option is then run for real: a training loop over the same logical
batch (``k`` micro-batches, forward + backward each, then one AdamW step), with the option's
checkpointed module where it has one, timed in turns with the other options, as the median of
``--repeats`` logical batches.
The table shows predicted and measured time side by side with their ranks, and Kendall's tau
between the two rankings (1.0: the same order). Nothing is asserted: this is for eyes.

    python benchmarks/accumulation.py
    python benchmarks/accumulation.py --device-fraction 0.6 --repeats 7 --threads 1
    python benchmarks/accumulation.py --threads 1 --write

Timings are only comparable within one run on an otherwise idle machine. With ``--write`` the
table also replaces the ``accumulation`` section of ``docs/benchmarks.md`` (`_record.record`:
with the date, the machine and this command line).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record

GPT = dict(batch=16, block_size=64, n_layer=4, n_head=4, n_embd=64, vocab_size=256)


def runner(model: Any, inputs: tuple[Any, ...], option: Any, schedule: Any
           ) -> Callable[[], float]:
    """A callable that trains one logical batch of ``option`` for real, on its own copy of the
    model, and returns the seconds it took."""
    import torch

    import scheduler
    from scheduler.workflows.advise import slice_inputs

    m = copy.deepcopy(model)
    micro = inputs if option.micro_batches == 1 else slice_inputs(inputs, option.micro_batches)
    module = m if schedule is None else scheduler.apply(m, schedule, micro)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def one() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for _ in range(option.micro_batches):
            loss = module(*micro)
            loss = loss if loss.dim() == 0 else loss.mean()
            loss.backward()
            del loss
        opt.step()
        return time.perf_counter() - t0

    return one


def time_round_robin(runners: list[Callable[[], float]], repeats: int) -> list[float]:
    """Median seconds of each runner, timed in turns (one warm-up turn first), so that a busy
    machine slows every option alike."""
    times: list[list[float]] = [[] for _ in runners]
    for r in range(repeats + 1):
        for i, run in enumerate(runners):
            t = run()
            if r:
                times[i].append(t)
    return [statistics.median(ts) for ts in times]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two lists of scores."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x * y > 0) - (x * y < 0)
    pairs = n * (n - 1) // 2
    return s / pairs if pairs else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Predicted vs measured time per logical batch of the options advise "
                    "prices, on the GPT example.")
    parser.add_argument("--device-fraction", type=float, default=0.7,
                        help="device memory as a fraction of the measured step's peak, "
                             "before headroom (default 0.7)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="logical batches timed per option; the median is reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (1 gives steadier times on a busy machine)")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    if not 0 < args.device_fraction or args.repeats < 1:
        parser.error("--device-fraction must be > 0 and --repeats >= 1")
    import torch
    from rich.console import Console
    from rich.table import Table

    import scheduler
    from examples.gpt import build
    from scheduler.quantities import format_bytes, format_seconds

    if args.threads:
        torch.set_num_threads(args.threads)
    model, inputs = build(**GPT)
    peak = scheduler.advise(model, inputs, device_memory="64GiB", repeats=1).breakdown.peak_bytes
    device = int(peak * args.device_fraction)
    advice = scheduler.advise(model, inputs, device_memory=device, headroom=0.0,
                              repeats=args.repeats)
    # options with a schedule that fits, or none needed
    runnable = [o for o in advice.options if not o.checkpoint or o.name in advice.schedules]
    measured = time_round_robin([runner(model, tuple(inputs), o, advice.schedules.get(o.name))
                                 for o in runnable], args.repeats)
    rows = list(zip(runnable, measured))
    pred = [o.predicted_time_s for o, _ in rows]
    meas = [t for _, t in rows]

    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0] * len(xs)
        for r, i in enumerate(order):
            out[i] = r + 1
        return out

    table = Table(title=f"GPT {GPT}, device {format_bytes(device)} (step peak "
                        f"{format_bytes(peak)}), {torch.get_num_threads()} threads",
                  title_justify="left")
    for col in ("option", "micro-batch", "predicted peak", "fits", "predicted / batch",
                "measured / batch", "rank (pred)", "rank (meas)"):
        table.add_column(col, justify="left" if col == "option" else "right")
    for (o, t), rp, rm in zip(rows, ranks(pred), ranks(meas)):
        table.add_row(o.name, f"{o.micro_batches} x {o.micro_batch_size}",
                      format_bytes(o.predicted_peak_bytes), "yes" if o.fits else "no",
                      format_seconds(o.predicted_time_s), format_seconds(t), str(rp), str(rm))
    lines: list[str] = []
    fitting = [(o, t) for o, t in rows if o.fits]
    if fitting:
        lines.append(f"fastest that fits: predicted "
                     f"{min(fitting, key=lambda x: x[0].predicted_time_s)[0].name}, "
                     f"measured {min(fitting, key=lambda x: x[1])[0].name}")
    lines.append(f"Kendall's tau between predicted and measured ranking: "
                 f"{kendall_tau(pred, meas):+.2f}")
    console = Console(width=132)
    console.print(table)
    for line in lines:
        console.print(line)
    if args.write:
        body = _record.markdown_table(table) + "\n\n" + "\n\n".join(lines)
        path = _record.record("accumulation", body,
                              device=str(next(model.parameters()).device),
                              command=_record.command_line(__file__, argv))
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
