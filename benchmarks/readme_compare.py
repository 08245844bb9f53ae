"""Regenerate the README's "Compare" section: the GPT example's table and plot.

    python benchmarks/readme_compare.py                  # prints the markdown, writes the PNG
    python benchmarks/readme_compare.py --readme README.md

Runs ``scheduler.compare`` on ``examples/gpt.py:build`` (default size) at 70% and 50% of the
unscheduled predicted peak, every strategy, measured; writes ``docs/compare_gpt.png`` and prints
the table as markdown. With ``--readme`` it also replaces the text between the README's
``<!-- compare:begin -->`` and ``<!-- compare:end -->`` markers. Timings depend on how busy the
machine is: run it on an idle one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
COMMAND = "scheduler compare examples/gpt.py:build --budget 70% --budget 50% --plot docs/compare_gpt.png"


def section(markdown: str, comparison) -> str:  # noqa: ANN001 - a Comparison
    """The README text between the markers."""
    import torch

    from scheduler.units import format_bytes, format_seconds

    ref = comparison.reference
    return (f"{BEGIN}\n```bash\n{COMMAND}\n```\n\n"
            f"{comparison.model} on {comparison.device}; unscheduled: predicted peak "
            f"{format_bytes(comparison.unconstrained_peak_bytes)}, measured step "
            f"{format_seconds(ref.step_s)} ({torch.get_num_threads()} torch thread(s)). Fits is "
            f"predicted / measured; overheads are over `none`; the measured ones are median "
            f"step times from one run, on a machine with load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end (other work slows "
            f"the steps unevenly: read small or negative measured overheads as noise).\n\n"
            f"{markdown}\n\n![overhead against peak memory](docs/compare_gpt.png)\n{END}")


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
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    import scheduler
    from examples.gpt import build

    model, inputs = build()
    comparison = scheduler.compare(model, inputs, budgets=args.budget or ["70%", "50%"],
                                   repeats=args.repeats)
    comparison.plot(args.png)
    text = section(comparison.to_markdown(), comparison)
    print(text)
    if args.readme is not None:
        readme = args.readme.read_text()
        if BEGIN not in readme or END not in readme:
            raise SystemExit(f"{args.readme} has no {BEGIN} ... {END} markers; add them where "
                             "the section goes")
        head, rest = readme.split(BEGIN, 1)
        args.readme.write_text(head + text + rest.split(END, 1)[1])
        print(f"updated {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
