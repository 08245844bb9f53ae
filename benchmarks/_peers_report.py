"""The race's report (`peers.py`): each example's table of variants, our fastest plan against
each other choice at no higher measured peak (with the ratio's spread over the rounds), and
the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table


def mib(b: int | None) -> str:
    """Bytes as MiB with two decimals; ``-`` for None."""
    return "-" if b is None else f"{b / 2**20:.2f}"


def table(result: dict[str, Any]) -> Any:
    """The rich ``Table`` of one example."""
    t = Table(title=f"{result['label']}: {result['nodes']} nodes, {result['blocks']} blocks, "
                    f"inputs {result['inputs']}; medians of {result['rounds']} interleaved "
                    f"rounds, 1 thread", title_justify="left")
    # (on CUDA the peak is the allocator's, `peaks`, and no tracker runs)
    peak = f"peak MiB ({'allocator' if result.get('device') == 'cuda' else 'profiler'})"
    for col in ("variant", "budget MiB", peak, "peak MiB (tracker)", "step",
                "x none", "predicted x none", "predicted / measured step",
                "predicted peak MiB", "graphs"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for r in result["rows"]:
        # (a compiled plan's predicted step is its compiled replays added to the compiled
        # base's measured step, `compiled_step_ratios`; its predicted peak is the eager one)
        pr = r.get("predicted_step_ratio")
        t.add_row(r["name"] + (f" ({r['note']})" if r["note"] else ""), mib(r["budget"]),
                  mib(r["peak"]), mib(r["tracked"]), f"{r['step_s'] * 1e3:.1f} ms",
                  f"{r['ratio']:.3f}",
                  "-" if pr is None else f"{pr:.3f}",
                  "-" if pr is None else f"{pr / r['ratio']:.3f}",
                  mib(r.get("predicted_peak_bytes")),
                  "-" if r["graphs"] is None else str(r["graphs"]))
    return t


def matched(result: dict[str, Any]) -> Any:
    """For each variant a user would pick instead: the fastest of our plans, eager and
    compiled, whose measured peak is no higher than its own, and their step over its step;
    for the compiled one also that ratio round by round (`per_round`), the race's own
    run-to-run spread, and what it reads as."""
    rows = result["rows"]
    spread = twin_spread(rows)
    twins = ("" if spread is None else
             f"; the twins, one step compiled twice apart, differed by {spread:.1%}")
    t = Table(title=f"{result['label']}: against each other choice, the fastest of our plans "
                    f"whose measured peak is no higher (step over its step; < 1: ours faster; "
                    f"per round: the ratio in each interleaved round, lowest-highest{twins})",
              title_justify="left")
    for col in ("variant", "its peak MiB", "its x none", "ours eager", "ours eager / it",
                "ours compiled", "ours compiled / it", "per round", "reads"):
        t.add_column(col, justify="left" if col == "variant" else "right")

    def best(r: dict[str, Any], family: str) -> dict[str, Any] | None:
        fit = [o for o in rows if o["family"] == family and o["peak"] <= r["peak"]]
        return min(fit, key=lambda o: o["ratio"]) if fit else None

    def cells(r: dict[str, Any], o: dict[str, Any] | None) -> list[str]:
        if o is None:
            return ["none fits", "-"]
        return [f"{o['ratio']:.3f} ({o['name']}, {mib(o['peak'])})",
                f"{o['ratio'] / r['ratio']:.3f}"]

    for r in rows:
        if r["family"] in ("user", "compile") and r["name"] != "none":
            o = best(r, "ours compiled")
            rounds = per_round(o, r) if o is not None else None
            t.add_row(r["name"], mib(r["peak"]), f"{r['ratio']:.3f}",
                      *cells(r, best(r, "ours")), *cells(r, o),
                      "-" if rounds is None else f"{rounds[0]:.3f}-{rounds[1]:.3f}",
                      "-" if rounds is None else reads(o["ratio"] / r["ratio"], rounds,
                                                       spread or 0.0))
    return t


def per_round(ours: dict[str, Any], it: dict[str, Any]) -> tuple[float, float] | None:
    """The lowest and highest of ``ours``'s step over ``it``'s, round by round (the rounds
    interleave every variant, so a round's pair ran under the same load); None for rows
    without their rounds' times."""
    a, b = ours.get("round_s"), it.get("round_s")
    if not a or not b or len(a) != len(b):
        return None
    ratios = [x / y for x, y in zip(a, b)]
    return min(ratios), max(ratios)


def twin_spread(rows: list[dict[str, Any]]) -> float | None:
    """How far apart the twins' steps were at the medians (the largest ``|twin / first - 1|``
    over the ``twin`` rows, each the step of the row named as it is less `` twin``, compiled
    again apart): what two runs of one step differ by in this race. None without twins."""
    by_name = {r["name"]: r for r in rows}
    gaps = [abs(r["ratio"] / by_name[r["name"].removesuffix(" twin")]["ratio"] - 1)
            for r in rows if r["family"] == "twin"
            and r["name"].removesuffix(" twin") in by_name]
    return max(gaps) if gaps else None


def reads(ratio: float, rounds: tuple[float, float], spread: float = 0.0) -> str:
    """A ratio of medians (ours over theirs) read against the race's spread: ``faster`` (or
    as fast) at the medians; ``within spread`` where slower at the medians but not in every
    round (``rounds``: the lowest and highest ratio round by round), or by no more than
    ``spread`` (`twin_spread`); else ``slower``."""
    if ratio <= 1:
        return "faster"
    return "within spread" if rounds[0] <= 1 or ratio - 1 <= spread else "slower"


MARKERS = {"user": "o", "compile": "s", "ours": "^", "ours compiled": "v"}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Measured peak against step time (x none), one panel per example."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results):
        for fam, marker in MARKERS.items():
            rs = [r for r in res["rows"] if r["family"] == fam]
            if rs:
                ax.scatter([r["peak"] / 2**20 for r in rs], [r["ratio"] for r in rs],
                           marker=marker, label=fam)
                for r in rs:
                    if fam in ("user", "compile"):
                        ax.annotate(r["name"], (r["peak"] / 2**20, r["ratio"]), fontsize=6,
                                    xytext=(3, 3), textcoords="offset points")
        ax.set_title(res["label"], fontsize=9)
        ax.set_xlabel("measured peak (MiB, profiler)")
        ax.set_ylabel("step time / none")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
