"""The loaders reject every bad field of a graph or schedule file with their own error
(`CostGraphError`, `ScheduleError`, both ValueErrors), in one line naming the file and the
field; and damaged real files (hypothesis) either load to something `simulate` runs or raise
that error, never another exception.

Each case starts from a real file (``graphs/mlp.json``, a schedule saved for
`random_graph`) and changes one thing.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import GRAPHS_DIR
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import simulate
from scheduler.ir.graph import CostGraph, CostGraphError
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule, ScheduleError
from scheduler.testing.mutate import mutate
from scheduler.testing.synthetic import random_graph

MLP = GRAPHS_DIR / "mlp.json"


def graph_doc() -> dict[str, Any]:
    return json.loads(MLP.read_text())


def small_graph() -> CostGraph:
    return random_graph(8, kind="dag", seed=3)


def schedule_doc() -> dict[str, Any]:
    g = small_graph()
    s = Schedule.from_cuts(g, [3, 6], ["keep", RECOMPUTE, "keep"], budget_bytes=1 << 20,
                           solver="test", status="OPTIMAL", estimate=simulate(g, Schedule.none(
                               g)).to_dict())
    return s.to_dict()


def write(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def error_of(load: Callable[[Path], Any], error: type[ValueError], path: Path) -> str:
    """The message of the ``error`` that ``load(path)`` raises, checked to be one line that
    starts with the path."""
    with pytest.raises(error) as info:
        load(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    return msg


def test_errors_are_value_errors() -> None:
    assert issubclass(CostGraphError, ValueError) and issubclass(ScheduleError, ValueError)


# -- graph files --------------------------------------------------------------------------------
def _node(d: dict[str, Any], name: str) -> tuple[int, dict[str, Any]]:
    return next((i, n) for i, n in enumerate(d["nodes"]) if n["name"] == name)


def _set_time(d: dict[str, Any]) -> None:
    d["nodes"][3]["time_s"] = -4.0


def _first_saver(d: dict[str, Any]) -> dict[str, Any]:
    return next(n for n in d["nodes"] if n["saved"])


def _bwd_free(d: dict[str, Any]) -> list[Any]:
    return next(e for st in d["bwd_steps"] for e in st[2] if e[0] == "f")


GRAPH_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "negative time_s": (_set_time, r"nodes\[3\]\.time_s: -4\.0 is negative"),
    "negative bwd_time_s": (lambda d: d["nodes"][2].update(bwd_time_s=-1e-3),
                            r"nodes\[2\]\.bwd_time_s: -0\.001 is negative"),
    "negative out_bytes": (lambda d: d["nodes"][1].update(out_bytes=-5),
                           r"nodes\[1\]\.out_bytes: -5 is negative"),
    "negative saved bytes": (lambda d: _first_saver(d)["saved"][0].__setitem__(2, -1),
                             r"nodes\[\d+\]\.saved\[0\]\.bytes: -1 is negative"),
    "negative param_bytes": (lambda d: d.update(param_bytes=-100),
                             r"param_bytes: -100 is negative"),
    "empty bwd_steps": (lambda d: d.update(bwd_steps=[]), r"bwd_steps: empty"),
    "unknown storage in bwd_steps": (lambda d: _bwd_free(d).__setitem__(1, 99999),
                                     (r"bwd_steps\[\d+\]\.events\[\d+\]: frees gradient 99999, "
                                     r"which no earlier step allocated")),
    "unknown bwd event kind": (lambda d: d["bwd_steps"][1][2][0].__setitem__(0, "x"),
                               r"bwd_steps\[1\]\.events\[0\]\.kind: 'x' is not an event kind"),
    "unknown fwd event kind": (lambda d: d["fwd_events"]["gelu"][0].__setitem__(0, "m"),
                               r"fwd_events\['gelu'\]\[0\]\.kind: 'm' is not an event kind"),
    "huge storage bytes": (lambda d: d["storages"][0].__setitem__(1, 10**30),
                           r"storages\[0\]\.bytes: 10{30} bytes is more than"),
    "huge out_bytes": (lambda d: d["nodes"][1].update(out_bytes=2**64),
                       r"nodes\[1\]\.out_bytes: \d+ bytes is more than"),
    "time a huge integer": (lambda d: d["nodes"][0].update(time_s=10**400),
                            r"nodes\[0\]\.time_s: 1\d+\.\.\. s is more than 1e\+09 s"),
    "infinite time": (lambda d: d["nodes"][0].update(time_s=float("inf")),
                      r"nodes\[0\]\.time_s: inf is not a finite time"),
    "NaN time": (lambda d: d["nodes"][0].update(bwd_time_s=float("nan")),
                 r"nodes\[0\]\.bwd_time_s: nan is not a finite time"),
    "NaN backward step time": (lambda d: d["bwd_steps"][2].__setitem__(1, float("nan")),
                               r"bwd_steps\[2\]\.time_s: nan is not a finite time"),
    "infinite step time": (lambda d: d.update(measured_step_s=float("inf")),
                           r"measured_step_s: inf is not a finite time"),
    "unknown storage in fwd_events": (lambda d: d["fwd_events"]["gelu"][0].__setitem__(1, 4242),
                                      r"fwd_events\['gelu'\]: unknown storage 4242"),
    "saved source unknown node": (lambda d: _first_saver(d)["saved"][0].__setitem__(0, "ghost"),
                                  r"nodes\['[^']+'\]\.saved: unknown source 'ghost'"),
    "duplicate storage id": (lambda d: d["storages"].append(list(d["storages"][0])),
                             r"storages\[\d+\]\.id: storage 0 appears twice"),
    "storage never allocated": (lambda d: d["fwd_events"]["gelu"].clear(),
                                r"storages\[\d+\]: never allocated in fwd_events"),
    "allocated by another node": (lambda d: d["fwd_events"]["gelu"].append(["a", 0]),
                                  r"fwd_events\['gelu'\]: storage 0 is allocated again"),
    "last use before producer": (lambda d: d["storages"][5].__setitem__(5, d["nodes"][0]["name"]),
                                 r"storages\[\d+\]\.last_use: '[^']+' runs before its producer"),
    "unknown loss node": (lambda d: d["meta"].update(loss_node="nope"),
                          r"meta\.loss_node: unknown node 'nope'"),
    "bool for bytes": (lambda d: d.update(input_bytes=True),
                       r"input_bytes: expected int, got bool"),
    "unknown top-level field": (lambda d: d.update(param_byte=1), r"unknown fields \['param_byte'"),
    "newer version": (lambda d: d.update(version=2),
                      (r"version: the file has version 2, newer than the 1 this scheduler reads; "
                      r"upgrade scheduler \(`pip install -U scheduler`\)")),
}


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_bad_graph_field(tmp_path: Path, case: str) -> None:
    change, pattern = GRAPH_CASES[case]
    d = graph_doc()
    change(d)
    msg = error_of(CostGraph.load, CostGraphError, write(tmp_path / "x.json", d))
    assert re.search(pattern, msg), msg


def test_the_graph_cases_start_from_a_good_file(tmp_path: Path) -> None:
    """The unchanged file loads and simulates (so each case fails for its own change)."""
    g = CostGraph.load(write(tmp_path / "x.json", graph_doc()))
    assert simulate(g, Schedule.none(g)).peak_bytes > 0


def test_deeply_nested_graph(tmp_path: Path) -> None:
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in error_of(CostGraph.load, CostGraphError, p)


def test_binary_graph_file(tmp_path: Path) -> None:
    p = tmp_path / "g.json"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    assert "not a text file" in error_of(CostGraph.load, CostGraphError, p)


def test_directory_as_graph(tmp_path: Path) -> None:
    assert "is a directory" in error_of(CostGraph.load, CostGraphError, tmp_path)


# -- schedule files -----------------------------------------------------------------------------
def _region_field(d: dict[str, Any]) -> None:
    d["regions"][0]["colour"] = "red"


SCHEDULE_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "budget_bytes a string": (lambda d: d.update(budget_bytes="abc"),
                              r"budget_bytes: expected int/null, got str \('abc'\)"),
    "budget_bytes negative": (lambda d: d.update(budget_bytes=-1), r"budget_bytes: -1 is negative"),
    "budget_bytes huge": (lambda d: d.update(budget_bytes=10**30), r"budget_bytes: 10{30} bytes"),
    "budget_bytes a bool": (lambda d: d.update(budget_bytes=True), r"budget_bytes: expected int"),
    "estimate a list": (lambda d: d.update(estimate=[1, 2]),
                        r"estimate: expected dict/null, got list"),
    "estimate peak a string": (lambda d: d["estimate"].update(peak_bytes="1G"),
                               r"estimate\.peak_bytes: expected int, got str"),
    "estimate step NaN": (lambda d: d["estimate"].update(step_s=float("nan")),
                          r"estimate\.step_s: nan is not a finite number"),
    "solver not a string": (lambda d: d.update(solver=3), r"solver: expected str, got int"),
    "solve_s negative": (lambda d: d.update(solve_s=-2.0), r"solve_s: -2\.0 is negative"),
    "gap a huge integer": (lambda d: d.update(gap=10**400), r"gap: \d+\.\.\. is too large"),
    "gap infinite": (lambda d: d.update(gap=float("inf")), r"gap: inf is not a finite number"),
    "meta a list": (lambda d: d.update(meta=["x"]), r"meta: expected dict, got list"),
    "unknown field": (lambda d: d.update(budget_byte=5), r"unknown fields \['budget_byte'\]"),
    "unknown region field": (_region_field, r"regions\[0\]: unknown fields \['colour'\]"),
    "newer version": (lambda d: d.update(version=3),
                      (r"version: the file has schedule version 3, newer than the 2 this "
                      r"scheduler reads; upgrade scheduler \(`pip install -U scheduler`\)")),
    "inner in a version-1 file": (lambda d: d["regions"][1].update(inner=[]),
                                  r"regions\[1\]: unknown fields \['inner'\]"),
}


def nested_doc() -> dict[str, Any]:
    """`schedule_doc` with its recompute region (nodes 3..5) nested: keep 3, recompute 4..5
    holding recompute 4 and keep 5 (version 2)."""
    g = small_graph()
    names = g.compute_nodes
    inner = (Region(KEEP, tuple(names[3:4])),
             Region(RECOMPUTE, tuple(names[4:6]),
                    inner=(Region(RECOMPUTE, (names[4],)), Region(KEEP, (names[5],)))))
    s = Schedule([Region(KEEP, tuple(names[:3])), Region(RECOMPUTE, tuple(names[3:6]),
                                                         inner=inner),
                  Region(KEEP, tuple(names[6:]))], fingerprint=g.fingerprint)
    s.validate(g)
    return s.to_dict()


def _inner(d: dict[str, Any], *path: int) -> dict[str, Any]:
    r = d["regions"][1]
    for i in path:
        r = r["inner"][i]
    return r


NESTED_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "inner not a list": (lambda d: _inner(d).update(inner={"policy": "keep"}),
                         r"regions\[1\]\.inner: expected a list of region objects"),
    "inner region not an object": (lambda d: _inner(d)["inner"].__setitem__(0, "keep"),
                                   r"regions\[1\]\.inner\[0\]: expected \{policy"),
    "inner policy bad": (lambda d: _inner(d, 1, 0).update(policy="skip"),
                         r"regions\[1\]\.inner\[1\]\.inner\[0\]\.policy: expected 'keep' or "
                         r"'recompute', got 'skip'"),
    "inner nodes not names": (lambda d: _inner(d, 1).update(nodes=[1, 2]),
                              r"regions\[1\]\.inner\[1\]\.nodes: expected a non-empty list"),
    "inner nodes empty": (lambda d: _inner(d, 0).update(nodes=[]),
                          r"regions\[1\]\.inner\[0\]\.nodes: expected a non-empty list"),
    "inner nodes do not cover": (lambda d: _inner(d, 1, 1)["nodes"].append("zz"),
                                 r"regions\[1\]\.inner\[1\]\.inner\[1\]\.nodes: the inner "
                                 r"regions must cover regions\[1\]\.inner\[1\]\.nodes"),
    "inner nodes out of order": (lambda d: _inner(d)["inner"].reverse(),
                                 r"regions\[1\]\.inner\[0\]\.nodes: the inner regions must "
                                 r"cover regions\[1\]\.nodes"),
    "inner save not names": (lambda d: _inner(d, 1, 0).update(save=3),
                             r"regions\[1\]\.inner\[1\]\.inner\[0\]\.save: expected a list"),
    "inner save set": (lambda d: _inner(d, 1, 0).update(save=_inner(d, 1, 0)["nodes"]),
                       r"regions\[1\]\.inner\[1\]: .*save sets .* are not supported in "
                       r"nested regions"),
    "unknown inner field": (lambda d: _inner(d, 1).update(colour="red"),
                            r"regions\[1\]\.inner\[1\]: unknown fields \['colour'\]"),
    "inner under keep": (lambda d: _inner(d, 0).update(inner=[dict(_inner(d, 0))]),
                         r"regions\[1\]\.inner\[0\]: .*is 'keep' but has inner regions"),
    "nested too deep": (lambda d: _inner(d, 1, 0).update(inner=_deep(_inner(d, 1, 0), 40)),
                        r"inner: regions nest more than 32 deep"),
}


def _deep(r: dict[str, Any], n: int) -> list[dict[str, Any]]:
    inner: list[dict[str, Any]] = []
    for _ in range(n):
        inner = [dict(r, inner=inner)]
    return inner


@pytest.mark.parametrize("case", sorted(NESTED_CASES))
def test_bad_nested_schedule_field(tmp_path: Path, case: str) -> None:
    change, pattern = NESTED_CASES[case]
    d = nested_doc()
    assert d["version"] == 2
    change(d)
    msg = error_of(Schedule.load, ScheduleError, write(tmp_path / "s.json", d))
    assert re.search(pattern, msg), msg


def test_a_nested_file_loads_back_as_written(tmp_path: Path) -> None:
    d = nested_doc()
    s = Schedule.load(write(tmp_path / "s.json", d))
    assert s.depth == 3 and s.to_dict() == d
    s.validate(small_graph())


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_bad_schedule_field(tmp_path: Path, case: str) -> None:
    change, pattern = SCHEDULE_CASES[case]
    d = schedule_doc()
    change(d)
    msg = error_of(Schedule.load, ScheduleError, write(tmp_path / "s.json", d))
    assert re.search(pattern, msg), msg


def test_the_schedule_cases_start_from_a_good_file(tmp_path: Path) -> None:
    s = Schedule.load(write(tmp_path / "s.json", schedule_doc()))
    assert s.budget_bytes == 1 << 20 and len(s.recompute_regions) == 1
    simulate(small_graph(), s)


@pytest.mark.parametrize("how", ["removed", "empty"])
def test_schedule_without_fingerprint_warns(tmp_path: Path, how: str) -> None:
    """A schedule with no fingerprint loads (hand-written ones may leave it out) but says that
    another input shape would go unseen."""
    d = schedule_doc()
    if how == "removed":
        del d["fingerprint"]
    else:
        d["fingerprint"] = ""
    p = write(tmp_path / "s.json", d)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(p))}: no fingerprint.*another input "
                                         r"shape.*solve again"):
        s = Schedule.load(p)
    assert s.fingerprint == ""


def test_directory_as_schedule(tmp_path: Path) -> None:
    assert "is a directory" in error_of(Schedule.load, ScheduleError, tmp_path)


def test_binary_schedule_file(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_bytes(bytes(range(256)))
    assert "byte 0x80 at offset 128 is not UTF-8" in error_of(Schedule.load, ScheduleError, p)


def test_deeply_nested_schedule(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text('{"meta": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in error_of(Schedule.load, ScheduleError, p)


def test_missing_file_is_still_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        CostGraph.load(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError):
        Schedule.load(tmp_path / "nope.json")


# -- property tests -----------------------------------------------------------------------------
def loads_or_rejects_graph(doc: Any, tmp_path: Path) -> None:
    """``doc`` loads to a graph that `simulate` runs without checkpointing, or the load
    raises `CostGraphError`; any other exception propagates (the test fails)."""
    p = tmp_path / "g.json"
    p.write_text(json.dumps(doc))
    try:
        g = CostGraph.load(p)
    except CostGraphError:
        return
    est = simulate(g, Schedule.none(g))
    assert est.peak_bytes >= 0 and est.step_s >= 0


def loads_or_rejects_schedule(doc: Any, graph: CostGraph, tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text(json.dumps(doc))
    try:
        simulate(graph, Schedule.load(p))
    except ScheduleError:
        return


_GRAPH = graph_doc()
_SMALL = small_graph().to_dict()
_SCHEDULE = schedule_doc()
_FAST = settings(max_examples=200, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FAST
@given(rng=st.randoms(use_true_random=False), n=st.integers(1, 3), keep_fp=st.booleans(),
       small=st.booleans())
def test_damaged_graph_loads_or_raises_cost_graph_error(tmp_path: Path, rng: random.Random,
                                                        n: int, keep_fp: bool,
                                                        small: bool) -> None:
    doc, _ = mutate(_SMALL if small else _GRAPH, rng, n)
    if isinstance(doc, dict) and not keep_fp:
        doc.pop("fingerprint", None)  # else most edits stop at the fingerprint check
    loads_or_rejects_graph(doc, tmp_path)


@_FAST
@given(rng=st.randoms(use_true_random=False), n=st.integers(1, 3))
def test_damaged_schedule_loads_or_raises_schedule_error(tmp_path: Path, rng: random.Random,
                                                         n: int) -> None:
    doc, _ = mutate(_SCHEDULE, rng, n)
    loads_or_rejects_schedule(doc, small_graph(), tmp_path)


def test_mutate_scales_numbers_past_floats_range() -> None:
    """The damage itself never raises: scaling an int past float's range (10**400, one of the
    nasty values, or repeated scaling) keeps it an int rather than calling float() on it."""
    seen_huge = False
    for seed in range(400):
        doc, done = mutate({"a": [10**400, 1e308, 5]}, random.Random(seed), n=3)
        seen_huge |= any("10000000000" in line for line in done)
    assert seen_huge
