"""The GPT example's comparison: the README's results table and plot, and its full table.

    python benchmarks/readme_compare.py                            # prints the table, writes the PNG
    python benchmarks/readme_compare.py --readme README.md --write

Runs ``scheduler.compare`` on ``examples/gpt.py:build`` (default size) at 70% and 50% of the
unscheduled predicted peak, every strategy, measured; writes ``docs/compare_gpt.png`` and prints
the full table as markdown. ``--readme`` replaces the text between the README's
``<!-- compare:begin -->`` and ``<!-- compare:end -->`` markers with a short form of the table
(`README_COLUMNS`) and the date, machine and command; ``--write`` replaces the ``compare``
section of ``docs/benchmarks.md`` with the full table (`_record.record`). Timings depend on how
busy the machine is: run it on an idle one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

# this script's folder is on sys.path: the shared writer of docs/benchmarks.md
import _record

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
COMMAND = "scheduler compare examples/gpt.py:build --budget 70% --budget 50%"
#: the columns of the comparison table that the README shows
README_COLUMNS = ("strategy", "budget", "status", "peak measured", "overhead predicted",
                  "overhead measured")


def select_columns(markdown: str, headers: tuple[str, ...]) -> str:
    """The columns ``headers`` of a markdown table (header row, rule, rows), in that order.

    Raises:
        KeyError: a header the table does not have (the message lists those it has).
    """
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in markdown.strip().splitlines()]
    have = rows[0]
    missing = [h for h in headers if h not in have]
    if missing:
        raise KeyError(f"the table has no column {missing[0]!r}; it has {have}")
    at = [have.index(h) for h in headers]
    out = ["| " + " | ".join(r[i] for i in at) + " |" for r in rows]
    out[1] = "|" + "|".join(rows[1][i] for i in at) + "|"
    return "\n".join(out)


def caption(comparison: Any, stamp: str) -> str:
    """The paragraph above a table: when, where and how it ran (``stamp``), what ran, and how
    to read it."""
    from scheduler.quantities import format_bytes, format_seconds

    ref = comparison.reference
    return (f"{stamp}{' ' if stamp else ''}Every strategy, as `{COMMAND}`; {comparison.model} "
            f"on {comparison.device}: unscheduled peak "
            f"{format_bytes(comparison.unconstrained_peak_bytes)} predicted, step "
            f"{format_seconds(ref.step_s)} measured. Status is predicted (INFEASIBLE: over the "
            f"budget); measured overheads are medians of one run.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", action="append", default=None,
                        help="budgets (default: 70%% and 50%%)")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "compare_gpt.png")
    parser.add_argument("--readme", type=Path, default=None,
                        help="replace the section between the markers in this README")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: steadier on a shared machine)")
    _record.add_write_option(parser)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    import scheduler
    from examples.gpt import build

    model, inputs = build()
    comparison = scheduler.compare(model, inputs, budgets=args.budget or ["70%", "50%"],
                                   repeats=args.repeats)
    comparison.plot(args.png)
    full = comparison.to_markdown()
    print(full)
    command = _record.command_line(__file__, argv)
    if args.readme is not None:
        readme = args.readme.read_text()
        if BEGIN not in readme or END not in readme:
            raise SystemExit(f"{args.readme} has no {BEGIN} ... {END} markers; add them where "
                             "the section goes")
        stamp = _record.stamp(device=comparison.device, command=command, inline=True)
        text = (f"{BEGIN}\n{caption(comparison, stamp)}\n\n"
                f"{select_columns(full, README_COLUMNS)}\n{END}")
        head, rest = readme.split(BEGIN, 1)
        args.readme.write_text(head + text + rest.split(END, 1)[1])
        print(f"updated {args.readme}", file=sys.stderr)
    if args.write:
        path = _record.record("compare", f"{caption(comparison, '')}\n\n{full}\n\n"
                                         "![overhead against peak memory](compare_gpt.png)",
                              device=comparison.device, command=command)
        print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
