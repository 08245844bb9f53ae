"""Tables, plots and progress bars: how comparisons, benchmarks and plans are shown.

Nothing here computes a cost: every number comes from a `Comparison`, a benchmark row or an
`Estimate`. Plots use matplotlib's object API (``Figure`` with the Agg canvas), never
``pyplot``, so they touch no global state and need no display; matplotlib is imported only by
the functions that plot, with an error that says how to install it.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .files import check_destination, write_atomic
from .quantities import format_bytes, format_seconds

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure
    from rich.table import Table

    from .cost.estimate import Estimate
    from .workflows.compare import Comparison, Row

__all__ = ["comparison_table", "comparison_markdown", "console", "plot_comparison", "plot_timeline",
           "progress_bar", "render", "rows_to_csv"]

_MIB = 2 ** 20
#: the solved strategies, drawn on top in black so the frontier stands out
_SOLVED = ("auto", "dp", "cpsat")


# ---------------------------------------------------------------------------- progress

@contextlib.contextmanager
def progress_bar(*, enabled: bool, total: int = 1, description: str = ""
                 ) -> Iterator[Callable[..., None]]:
    """A rich progress bar on stderr (transient), or nothing when ``enabled`` is False.

    Yields ``step(description=None, *, advance=0, total=None)``: change the text, move the bar
    by ``advance`` units, or change the number of units.
    """
    if not enabled:
        yield lambda description=None, *, advance=0, total=None: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task(description, total=total)

    def step(description: str | None = None, *, advance: int = 0,
             total: int | None = None) -> None:
        bar.update(task, description=description, advance=advance, total=total)

    with bar:
        yield step


# ---------------------------------------------------------------------------- tables

#: (header, right-aligned) of the comparison table; `_cells` fills them in this order
_COLUMNS = (("strategy", False), ("budget", True), ("status", False), ("fits", False),
            ("peak predicted", True), ("peak measured", True), ("step predicted", True),
            ("step measured", True), ("overhead predicted", True),
            ("overhead measured", True), ("gap", True), ("solve", True))


def _cells(row: "Row") -> list[str]:
    """The row as the strings of `_COLUMNS` (shared by the rich and markdown tables)."""
    def maybe(value: Any, fmt: Callable[[Any], str]) -> str:
        return "-" if value is None else fmt(value)

    def pct(x: float) -> str:
        return f"{x:+.1%}"

    fits = "yes" if row.fits_predicted else "NO"
    if row.fits_measured is not None:
        fits += " / " + ("yes" if row.fits_measured else "NO")
    strategy = row.strategy if row.solver in ("", row.strategy) else f"{row.strategy} ({row.solver})"
    return [strategy, f"{row.budget} ({format_bytes(row.budget_bytes)})", row.status, fits,
            maybe(row.predicted_peak_bytes, format_bytes),
            maybe(row.measured_peak_bytes, format_bytes),
            maybe(row.predicted_step_s, format_seconds),
            maybe(row.measured_step_s, format_seconds),
            maybe(row.predicted_overhead, pct), maybe(row.measured_overhead, pct),
            maybe(row.gap, lambda g: f"{g:.1%}"), format_seconds(row.solve_s)]


def comparison_table(comparison: "Comparison") -> "Table":
    """A rich ``Table``: one row per (budget, strategy), a section per budget; fits is
    "predicted / measured"."""
    from rich.table import Table

    ref = comparison.reference
    measured = (f"; unscheduled step measured {format_seconds(ref.step_s)}, peak "
                f"{format_bytes(ref.peak_bytes)}" if ref is not None else "; not measured")
    table = Table(title=f"{comparison.model} on {comparison.device}: unscheduled predicted peak "
                  f"{format_bytes(comparison.unconstrained_peak_bytes)}{measured}",
                  title_justify="left")
    for header, right in _COLUMNS:
        # the text columns and the budget stay whole; the numeric headers may wrap
        table.add_column(header, justify="right" if right else "left",
                         no_wrap=not right or header == "budget")
    previous = None
    for row in comparison.rows:
        if previous is not None and row.budget != previous:
            table.add_section()
        previous = row.budget
        style = None if row.fits_predicted else "dim"
        table.add_row(*_cells(row), style=style)
    return table


def comparison_markdown(comparison: "Comparison") -> str:
    """The comparison table as GitHub markdown (for the README)."""
    lines = ["| " + " | ".join(h for h, _ in _COLUMNS) + " |",
             "|" + "|".join("---:" if right else ":---" for _, right in _COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in comparison.rows]
    return "\n".join(lines)


def console(*, stderr: bool = False) -> Any:
    """A rich ``Console``; 160 columns wide when not a terminal (piped or captured), so wide
    tables are not squeezed into 80."""
    from rich.console import Console

    out = Console(stderr=stderr)
    return out if out.is_terminal else Console(stderr=stderr, width=160)


def render(renderable: Any, *, width: int = 160) -> str:
    """A rich renderable (a ``Table``) as plain text, ``width`` columns wide."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def rows_to_csv(rows: Sequence[dict[str, Any]], fields: Sequence[str]) -> str:
    """CSV text with a header; ``None`` is an empty cell, floats keep full precision."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(fields), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row[k] is None else row[k]) for k in fields})
    return out.getvalue()


# ---------------------------------------------------------------------------- plots

def _figure(**kwargs: Any) -> "Figure":
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or "
                          "pip install -e '.[plot]')") from None
    return Figure(**kwargs)


def _save(fig: "Figure", path: str | Path | None) -> None:
    if path is not None:
        dest = check_destination(path, "png", what="the plot")
        buf = io.BytesIO()
        fig.savefig(buf, dpi=110, format="png")
        write_atomic(dest, buf.getvalue())


def plot_comparison(comparison: "Comparison", path: str | Path | None = None) -> "Figure":
    """Overhead against peak memory, one series per strategy across the budgets.

    One panel for the predictions and, when the comparison was measured, one for the
    measurements. Each strategy is a line through its points (one per budget; a schedule that
    does not depend on the budget is one point); points that miss their budget (every
    budget, for such a shared point) are drawn hollow; each budget is a dotted vertical line.
    Solved strategies (``auto``, ``dp``, ``cpsat``) are black and on top. Strategies with no
    schedule at a budget have no point there.

    Args:
        comparison: what `scheduler.compare` returned.
        path: where to write the PNG (folders are made); None to only build the figure.

    Returns:
        The matplotlib ``Figure``: each axes' lines are labelled with the strategy names and
        ``"budget <as given>"``.
    """
    measured = comparison.reference is not None
    panels = [("predicted", "predicted")] + ([("measured", "measured")] if measured else [])
    fig = _figure(figsize=(5.5 * len(panels) + 1.4, 4.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    strategies = list(dict.fromkeys(row.strategy for row in comparison.rows))
    colors = _colors(strategies)
    for ax, (kind, title) in zip(axes, panels):
        for strategy in strategies:
            # (peak MiB, overhead %) -> fits; a schedule the budget does not change is one
            # point for all budgets, hollow only when it misses every one of them
            fits_at: dict[tuple[float, float], bool] = {}
            for row in comparison.rows:
                peak = getattr(row, f"{kind}_peak_bytes")
                over = getattr(row, f"{kind}_overhead")
                if row.strategy == strategy and peak is not None and over is not None:
                    xy = (peak / _MIB, 100 * over)
                    fits_at[xy] = fits_at.get(xy, False) or bool(getattr(row, f"fits_{kind}"))
            if not fits_at:
                continue
            points = sorted((x, y, fits) for (x, y), fits in fits_at.items())
            solved = strategy in _SOLVED
            xs, ys, _ = zip(*points)
            ax.plot(xs, ys, marker="D" if solved else "o", color=colors[strategy],
                    linewidth=2.5 if solved else 1.2, markersize=7 if solved else 5,
                    zorder=5 if solved else 3, label=strategy)
            misses = [(x, y) for x, y, fits in points if not fits]
            if misses:  # hollow: the marker's face is blanked out
                mx, my = zip(*misses)
                ax.plot(mx, my, linestyle="none", marker="D" if solved else "o",
                        markersize=7 if solved else 5, markerfacecolor="white",
                        markeredgecolor=colors[strategy], zorder=6)
        for label, nbytes in dict.fromkeys((r.budget, r.budget_bytes)
                                           for r in comparison.rows):
            ax.axvline(nbytes / _MIB, color="grey", linestyle=":", linewidth=1,
                       label=f"budget {label}")
            ax.annotate(f"budget {label}", (nbytes / _MIB, 1), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color="grey")
        ax.set_xlabel(f"{title} peak memory (MiB)")
        ax.set_ylabel(f"{title} step-time overhead over none (%)")
        ax.set_title(f"{comparison.model}: {title}")
        ax.grid(alpha=0.3)
    handles, labels = axes[-1].get_legend_handles_labels()
    keep = [(h, lbl) for h, lbl in zip(handles, labels) if not lbl.startswith("budget ")]
    if keep:
        # outside the panels, so it hides no point
        fig.legend(*zip(*keep), fontsize=7, loc="outside right upper",
                   title="hollow: misses\nits budget", title_fontsize=7)
    _save(fig, path)
    return fig


def _colors(strategies: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    out, i = {}, 0
    for s in strategies:
        if s in _SOLVED:
            out[s] = "black"
        else:
            out[s] = palette[i % len(palette)]
            i += 1
    return out


def plot_timeline(estimate: "Estimate", path: str | Path | None = None, *,
                  budget_bytes: int | None = None, title: str = "",
                  measured: Sequence[int] = (), measured_backward_at: int = 0) -> "Figure":
    """Predicted live memory over one training step, from ``estimate.timeline``.

    The x axis is the step's events in order: each forward node, then each backward step, with
    each recompute burst (a region's replay) as one event just before the backward step that
    needs it. Forward and backward are separate lines (labelled ``"forward"`` and
    ``"backward"``); recompute bursts are red markers (``"recompute"``); the budget is a dashed
    horizontal line (``"budget"``) and the predicted peak a dotted one (``"predicted peak ..."``).

    Args:
        estimate: a `simulate` result (its ``timeline`` holds (event, live bytes) pairs).
        path: where to write the PNG (folders are made); None to only build the figure.
        budget_bytes: draw this budget.
        title: the axes title.
        measured: a measured timeline (`Measurement.timeline`: live bytes after each
            allocation and free), drawn as ``"measured"`` with its forward part stretched over
            the predicted forward and its backward part over the predicted backward; its events
            are PyTorch's, finer than the prediction's, so compare levels, not positions.
        measured_backward_at: the measured timeline's first backward index
            (`Measurement.timeline_backward_at`).

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: the estimate has no timeline (it was loaded from a schedule's JSON, which
            does not keep one; simulate the schedule again).
    """
    timeline = estimate.timeline
    if not timeline:
        raise ValueError("this estimate has no timeline (estimates read from a schedule file "
                         "keep none); use simulate(graph, schedule) to get one")
    labels = [label for label, _ in timeline]
    mib = [b / _MIB for _, b in timeline]
    n_fwd = next((i for i, lbl in enumerate(labels)
                  if lbl.startswith(("bwd ", "recompute "))), len(labels))
    fig = _figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.subplots()
    xs = list(range(len(timeline)))
    ax.plot(xs[:n_fwd], mib[:n_fwd], color="tab:blue", label="forward")
    start = max(n_fwd - 1, 0)  # joined to the last forward point
    ax.plot(xs[start:], mib[start:], color="tab:green", label="backward")
    bursts = [i for i, lbl in enumerate(labels) if lbl.startswith("recompute ")]
    ax.plot([xs[i] for i in bursts], [mib[i] for i in bursts], linestyle="none", marker="^",
            color="red", label="recompute")
    if measured:
        ax.plot(_stretch(len(measured), measured_backward_at, n_fwd - 1, len(timeline) - 1),
                [b / _MIB for b in measured],
                color="tab:orange", linewidth=0.8, alpha=0.8,
                label=f"measured (peak {format_bytes(max(measured))}; x scaled)")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / _MIB, color="black", linestyle="--", linewidth=1,
                   label="budget")
    # the timeline holds the live bytes after each event; the peak may fall inside one (op
    # temporaries, the middle of a replay), so it gets its own line
    ax.axhline(estimate.peak_bytes / _MIB, color="red", linestyle=":", linewidth=1,
               label=f"predicted peak {format_bytes(estimate.peak_bytes)}")
    ax.axvline(n_fwd - 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step events (forward nodes | recompute bursts and backward steps)")
    ax.set_ylabel("live memory (MiB)" if measured else "predicted live memory (MiB)")
    ax.set_title(title or f"predicted memory over one step: recompute "
                 f"{format_seconds(estimate.recompute_s)} (+{estimate.overhead:.1%})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)
    return fig


def _stretch(n: int, split: int, mid: float, end: float) -> list[float]:
    """x positions for ``n`` measured events whose backward starts at index ``split``: the
    forward part spread over [0, mid], the backward part over [mid, end]."""
    split = min(max(split, 0), n)
    xs = [mid * i / max(split - 1, 1) for i in range(split)]
    rest = n - split
    xs += [mid + (end - mid) * i / max(rest - 1, 1) for i in range(rest)]
    return xs
