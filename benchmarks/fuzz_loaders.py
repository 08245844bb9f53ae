"""Fuzz the graph and schedule loaders with damaged real files; report what was tried and found.

    python benchmarks/fuzz_loaders.py                  # 20,000 inputs, seed 0
    python benchmarks/fuzz_loaders.py -n 100000 --seed 7

Each input is a real document (every ``graphs/*.json``, a small `random_graph` and a schedule
saved for it) with 1 to 4 random changes (`scheduler.testing.mutate`: another type, sign or
size, NaN, infinity, a key deleted, an element duplicated, a value nested or copied elsewhere),
written to a file and loaded. Half the graph inputs lose their ``fingerprint`` so that changes
to node names and edges reach the deeper checks. A graph that loads is simulated without
checkpointing and with every compute node in one recompute region; a schedule that loads is
simulated on its graph. Every outcome must be a load and a simulation, or a `CostGraphError` /
`ScheduleError`: anything else is a finding, printed with the changes that caused it (the
same seed repeats the run). The normal suite runs the same property with a bounded count
(``tests/ir/test_loaders.py``). Exit status 1 if anything was found.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import random
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import simulate
from scheduler.ir.graph import CostGraph, CostGraphError
from scheduler.ir.schedule import RECOMPUTE, Schedule, ScheduleError
from scheduler.testing.mutate import mutate
from scheduler.testing.synthetic import random_graph

ROOT = Path(__file__).resolve().parents[1]


def _graph_check(path: Path) -> None:
    g = CostGraph.load(path)
    simulate(g, Schedule.none(g))
    simulate(g, Schedule.from_regions(g, [(0, len(g.compute_nodes), RECOMPUTE)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20_000, help="inputs to try (default 20000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    small = random_graph(8, kind="dag", seed=3)
    schedule = Schedule.from_cuts(small, [3, 6], ["keep", RECOMPUTE, "keep"], budget_bytes=1 << 20,
                                  solver="fuzz", estimate=simulate(small, Schedule.none(small)
                                                                   ).to_dict())
    graphs = {Path(p).name: json.loads(Path(p).read_text())
              for p in sorted(glob.glob(str(ROOT / "graphs" / "*.json")))}
    graphs["random_graph(8)"] = small.to_dict()
    targets = [(name, doc, "graph") for name, doc in graphs.items()]
    targets.append(("schedule", schedule.to_dict(), "schedule"))

    # a schedule that lost its fingerprint loads with a warning: expected, not a finding
    warnings.simplefilter("ignore", UserWarning)
    rng = random.Random(args.seed)
    outcomes: collections.Counter[str] = collections.Counter()
    rejected: collections.Counter[str] = collections.Counter()
    findings: dict[str, tuple[str, list[str]]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.json"
        for _ in range(args.n):
            name, doc, kind = rng.choice(targets)
            bad, changes = mutate(doc, rng, rng.randint(1, 4))
            if kind == "graph" and isinstance(bad, dict) and rng.random() < 0.5:
                bad.pop("fingerprint", None)
            path.write_text(json.dumps(bad))
            try:
                if kind == "graph":
                    _graph_check(path)
                else:
                    simulate(small, Schedule.load(path))
                outcomes[f"{kind}: loaded and simulated"] += 1
            except (CostGraphError, ScheduleError) as e:
                outcomes[f"{kind}: rejected ({type(e).__name__})"] += 1
                # the field named, indices dropped: which checks fired
                field = str(e)[len(str(path)) + 2:].split(": ")[0]
                rejected[re.sub(r"\[[^\]]*\]", "[]", field)] += 1
            except Exception as e:  # noqa: BLE001 - every other exception is a finding
                key = f"{type(e).__name__}: {str(e)[:120]}"
                outcomes[f"{kind}: FOUND {type(e).__name__}"] += 1
                findings.setdefault(key, (name, changes))
    dt = time.perf_counter() - t0
    print(f"tried {args.n} inputs (seed {args.seed}) in {dt:.1f} s over {len(targets)} documents")
    for k, v in sorted(outcomes.items()):
        print(f"  {v:>7}  {k}")
    print("rejected by field (top 15):")
    for k, v in rejected.most_common(15):
        print(f"  {v:>7}  {k}")
    print(f"findings: {len(findings)}")
    for key, (name, changes) in findings.items():
        print(f"  {key}\n    from {name}: {'; '.join(changes)}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
