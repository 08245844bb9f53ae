"""Tests for `scheduler.schedule`: building, validating and (de)serialising schedules.

Torch-free: the graphs are small hand-made `CostGraph`s, so every check here runs in
milliseconds. Rewriting and running schedules is in ``test_rewrite.py``/``test_api.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.ir.graph import CostGraph, Node, Storage
from scheduler.ir.schedule import (
    KEEP,
    RECOMPUTE,
    SCHEMA,
    VERSION,
    Region,
    Schedule,
    ScheduleError,
)

# Node i of `_graph` is a view (allocates nothing) when i % 4 == 3.
N = 12


def _graph(n: int = N, *, name: str = "g", shape: str = "f32[8]") -> CostGraph:
    """A chain of ``n`` compute nodes ``n0..`` in two blocks (``h.0``, ``h.1``) between
    un-blocked nodes, followed by a loss node."""
    names = [f"n{i}" for i in range(n)]
    nodes, storages, events = [], {}, {}
    for i, nm in enumerate(names):
        block = "" if i in (0, n - 1) else f"h.{int(i >= n // 2)}"
        nodes.append(Node(nm, "call_function", "f", (names[i - 1],) if i else (),
                          module_path=block, block=block, shape=shape))
        if i % 4 != 3:
            storages[i] = Storage(i, 32, nm, True, False, nm)
            events[nm] = [("a", i)]
    nodes.append(Node("loss", "call_method", "mean", (names[-1],), is_loss=True, shape="f32[]"))
    return CostGraph(name=name, nodes=nodes, storages=storages, fwd_events=events)


@pytest.fixture(scope="module")
def g() -> CostGraph:
    return _graph()


def _saveable(g: CostGraph, names: list[str]) -> list[str]:
    return [n for n in names if g.allocates(n)]


# -------------------------------------------------------------------------- constructors


def test_none_is_one_keep_region(g: CostGraph) -> None:
    s = Schedule.none(g)
    assert [r.policy for r in s.regions] == [KEEP]
    assert list(s.regions[0].nodes) == g.compute_nodes
    assert "loss" not in s.regions[0].nodes
    assert s.fingerprint == g.fingerprint
    assert s.solver == "none"
    assert s.recompute_regions == []
    assert set(s.policy_of().values()) == {KEEP}


def test_from_regions_spans_and_save_sets(g: CostGraph) -> None:
    s = Schedule.from_regions(g, [(0, 1, KEEP), (1, 6, RECOMPUTE, ["n1", "n4"]),
                                  (6, N, RECOMPUTE)], solver="hand", meta={"why": "test"})
    assert [len(r.nodes) for r in s.regions] == [1, 5, N - 6]
    assert s.regions[1].save == frozenset({"n1", "n4"})
    assert s.regions[2].save == frozenset()
    assert s.solver == "hand" and s.meta == {"why": "test"}
    assert s.recompute_regions == s.regions[1:]
    pol = s.policy_of()
    assert pol["n0"] == KEEP and pol["n1"] == RECOMPUTE and pol[f"n{N - 1}"] == RECOMPUTE
    assert list(pol) == g.compute_nodes


def test_from_cuts_matches_from_regions(g: CostGraph) -> None:
    a = Schedule.from_cuts(g, [2, 7], [KEEP, RECOMPUTE, RECOMPUTE], [(), ["n2"], ()])
    b = Schedule.from_regions(g, [(0, 2, KEEP), (2, 7, RECOMPUTE, ["n2"]), (7, N, RECOMPUTE)])
    assert a == b
    assert Schedule.from_cuts(g, [], [KEEP]) == Schedule.from_regions(g, [(0, N, KEEP)])


def test_describe_names_every_region(g: CostGraph) -> None:
    s = Schedule.from_regions(g, [(0, 3, KEEP), (3, N, RECOMPUTE, ["n4", "n5"])])
    lines = s.describe().splitlines()
    assert len(lines) == 2
    assert lines[0].split()[:4] == ["keep", "n0", "..", "n2"]
    assert "(3 nodes)" in lines[0]
    assert lines[1].startswith("recompute") and f"({N - 3} nodes, save 2)" in lines[1]


# ------------------------------------------------------------------------- bad schedules


def test_unknown_policy() -> None:
    with pytest.raises(ScheduleError, match=r"region policy 'offload' is not one of 'keep', "
                                            r"'recompute'"):
        Region("offload", ("n0",))


def test_unknown_policy_via_from_regions(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match="region policy 'Recompute'"):
        Schedule.from_regions(g, [(0, N, "Recompute")])


def test_empty_region(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match="at least one node"):
        Region(KEEP, ())
    with pytest.raises(ScheduleError, match="at least one node"):
        Schedule.from_regions(g, [(0, 4, KEEP), (4, 4, RECOMPUTE), (4, N, KEEP)])


def test_save_set_node_outside_its_region(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=r"save-set node 'n9' is not in its region "
                                            r"\('n1' \.\. 'n5'\)"):
        Schedule.from_regions(g, [(0, 1, KEEP), (1, 6, RECOMPUTE, ["n2", "n9"]),
                                  (6, N, RECOMPUTE)])


def test_save_set_on_keep_region(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=r"'keep' but has a save set"):
        Schedule.from_regions(g, [(0, N, KEEP, ["n1"])])


def test_save_set_node_that_allocates_nothing(g: CostGraph) -> None:
    assert not g.allocates("n3")
    with pytest.raises(ScheduleError, match=r"save-set node 'n3' allocates no storage"):
        Schedule.from_regions(g, [(0, N, RECOMPUTE, ["n2", "n3"])])


def test_regions_skip_a_node(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=r"regions skip node 'n4'"):
        Schedule.from_regions(g, [(0, 4, KEEP), (5, N, RECOMPUTE)])


def test_regions_repeat_a_node(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=r"node 'n3' appears in more than one region"):
        Schedule.from_regions(g, [(0, 4, KEEP), (3, N, RECOMPUTE)])


def test_regions_out_of_order(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=r"out of execution order"):
        Schedule.from_regions(g, [(4, N, RECOMPUTE), (0, 4, KEEP)])


def test_regions_stop_early(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=rf"regions stop early: node 'n{N - 2}' is not "
                                            "covered"):
        Schedule.from_regions(g, [(0, N - 2, RECOMPUTE)])


def test_region_node_not_in_graph(g: CostGraph) -> None:
    s = Schedule([Region(KEEP, tuple(g.compute_nodes)), Region(KEEP, ("n99",))])
    with pytest.raises(ScheduleError, match=r"region node 'n99' is not a compute node"):
        s.validate(g)


def test_loss_nodes_are_not_schedulable(g: CostGraph) -> None:
    s = Schedule([Region(RECOMPUTE, (*g.compute_nodes, "loss"))])
    with pytest.raises(ScheduleError, match=r"'loss' is not a compute node"):
        s.validate(g)


def test_from_cuts_needs_one_policy_per_region(g: CostGraph) -> None:
    with pytest.raises(ScheduleError, match=r"3 regions but 2 policies"):
        Schedule.from_cuts(g, [3, 6], [KEEP, RECOMPUTE])


@pytest.mark.parametrize("cuts", [[0], [N], [5, 5], [6, 3]])
def test_from_cuts_bad_cuts(g: CostGraph, cuts: list[int]) -> None:
    with pytest.raises(ScheduleError):
        Schedule.from_cuts(g, cuts, [RECOMPUTE] * (len(cuts) + 1))


def test_validate_other_graph_names_both_fingerprints(g: CostGraph) -> None:
    other = _graph(shape="f32[16]")  # same structure, other shapes
    assert other.fingerprint != g.fingerprint
    s = Schedule.none(g)
    with pytest.raises(ScheduleError, match=rf"fingerprint '{g.fingerprint}'.*has "
                                            rf"'{other.fingerprint}'.*input shapes differ"):
        s.validate(other)


def test_validate_without_fingerprint_checks_nodes_only(g: CostGraph) -> None:
    s = Schedule([Region(KEEP, tuple(g.compute_nodes))])
    s.validate(_graph(shape="f32[16]"))  # same node names: fine
    with pytest.raises(ScheduleError, match="stop early"):
        s.validate(_graph(N + 1))


# ------------------------------------------------------------------------ JSON round trip


@st.composite
def schedules(draw: st.DrawFn, g: CostGraph) -> Schedule:
    """Any valid schedule over ``g``: random cuts, policies and save sets, and metadata."""
    names = g.compute_nodes
    n = len(names)
    cuts = draw(st.lists(st.integers(1, n - 1), unique=True, max_size=n - 1).map(sorted))
    spans = []
    for a, b in zip([0, *cuts], [*cuts, n]):
        policy = draw(st.sampled_from([KEEP, RECOMPUTE]))
        save = (draw(st.lists(st.sampled_from(_saveable(g, names[a:b])), unique=True))
                if policy == RECOMPUTE and _saveable(g, names[a:b]) else [])
        spans.append((a, b, policy, save))
    finite = st.floats(allow_nan=False, allow_infinity=False)
    info = dict(
        budget_bytes=draw(st.none() | st.integers(0, 2**50)),
        solver=draw(st.sampled_from(["", "dp", "cpsat", "uniform:4"])),
        status=draw(st.sampled_from(["", "OPTIMAL", "FEASIBLE"])),
        gap=draw(st.none() | finite),
        solve_s=draw(st.none() | st.floats(0, 1e4)),
        estimate=draw(st.none() | st.fixed_dictionaries(
            {"peak_bytes": st.integers(0, 2**40), "overhead": finite})),
        meta=draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5),
                                  max_size=3)),
    )
    return Schedule.from_regions(g, spans, **info)


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_json_round_trip(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    g = _graph()
    s = data.draw(schedules(g))
    path = tmp_path_factory.mktemp("rt") / "s.json"
    s.save(path)
    back = Schedule.load(path)
    assert back == s
    assert back.to_dict() == s.to_dict()
    back.validate(g)
    # a dict that went through JSON text reads back the same too
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    # and saving is deterministic (save sets are written sorted)
    path2 = path.with_name("again.json")
    back.save(path2)
    assert path2.read_text() == path.read_text()


def test_json_file_shape(g: CostGraph, tmp_path: Path) -> None:
    s = Schedule.from_regions(g, [(0, 2, KEEP), (2, N, RECOMPUTE, ["n6", "n2"])],
                              budget_bytes=123, solver="dp", status="OPTIMAL", gap=0.0)
    s.save(tmp_path / "s.json")
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["schema"] == SCHEMA and d["version"] == VERSION
    assert d["fingerprint"] == g.fingerprint
    assert d["regions"][1] == {"policy": RECOMPUTE, "nodes": g.compute_nodes[2:],
                               "save": ["n2", "n6"]}
    assert (d["budget_bytes"], d["solver"], d["status"], d["gap"]) == (123, "dp", "OPTIMAL", 0.0)


# ------------------------------------------------------------------------- bad JSON files


def _doc(g: CostGraph) -> dict:
    return Schedule.from_regions(g, [(0, 3, KEEP), (3, N, RECOMPUTE, ["n4"])]).to_dict()


def test_load_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"schema": "scheduler.schedule", "version": 1, "regions": [')
    with pytest.raises(ScheduleError, match=rf"{re.escape(str(path))}: not valid JSON"):
        Schedule.load(path)


def test_load_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text("")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.load(path)


@pytest.mark.parametrize("version", [0, None, "1"])  # newer: test_loaders.py
def test_load_other_version(g: CostGraph, tmp_path: Path, version: object) -> None:
    d = _doc(g)
    if version is None:
        del d["version"]
    else:
        d["version"] = version
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ScheduleError, match=rf"{re.escape(str(path))}: version: this scheduler "
                                            rf"reads schedule version {VERSION}.*solve again"):
        Schedule.load(path)


def test_load_a_cost_graph_file_is_rejected(g: CostGraph, tmp_path: Path) -> None:
    g.save(tmp_path / "graph.json")
    with pytest.raises(ScheduleError, match=r"schema: expected 'scheduler.schedule', got "
                                            r"'scheduler.costgraph'"):
        Schedule.load(tmp_path / "graph.json")


def _broken(g: CostGraph, change: str) -> object:
    d = _doc(g)
    regions = d["regions"]
    if change == "not an object":
        return [d]
    if change == "no regions":
        del d["regions"]
    elif change == "empty regions":
        d["regions"] = []
    elif change == "regions not a list":
        d["regions"] = {"policy": KEEP}
    elif change == "region not an object":
        regions[0] = ["keep", ["n0"]]
    elif change == "region without nodes":
        del regions[0]["nodes"]
    elif change == "nodes not a list":
        regions[0]["nodes"] = "n0"
    elif change == "nodes hold a non-name":
        regions[0]["nodes"] = [["n0"], "n1", "n2"]
    elif change == "save not a list":
        regions[1]["save"] = 4
    elif change == "unknown policy":
        regions[1]["policy"] = "swap"
    elif change == "no policy":
        del regions[1]["policy"]
    elif change == "save outside region":
        regions[1]["save"] = ["n0"]
    elif change == "save on keep":
        regions[0]["save"] = ["n1"]
    elif change == "fingerprint not a string":
        d["fingerprint"] = 12345
    else:
        raise AssertionError(change)
    return d


BROKEN = {
    "not an object": r"expected a JSON object, got list",
    "no regions": r"regions: missing or empty",
    "empty regions": r"regions: missing or empty",
    "regions not a list": r"regions: missing or empty",
    "region not an object": r"regions\[0\]: expected",
    "region without nodes": r"regions\[0\]\.nodes: expected a non-empty list of node names",
    "nodes not a list": r"regions\[0\]\.nodes: expected a non-empty list of node names",
    "nodes hold a non-name": r"regions\[0\]",
    "save not a list": r"regions\[1\]",
    "unknown policy": r"regions\[1\]\.policy: expected 'keep' or 'recompute', got 'swap'",
    "no policy": r"regions\[1\]\.policy: expected 'keep' or 'recompute', got None",
    "save outside region": r"save-set node 'n0' is not in its region",
    "save on keep": r"'keep' but has a save set",
    "fingerprint not a string": r"fingerprint: expected a string, got 12345",
}


@pytest.mark.parametrize("change", sorted(BROKEN))
def test_load_broken_document(g: CostGraph, tmp_path: Path, change: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(_broken(g, change)))
    with pytest.raises(ScheduleError, match=rf"{re.escape(str(path))}: .*{BROKEN[change]}"):
        Schedule.load(path)


def test_loaded_schedule_for_other_graph_fails_validate(g: CostGraph, tmp_path: Path) -> None:
    Schedule.none(g).save(tmp_path / "s.json")
    s = Schedule.load(tmp_path / "s.json")  # loading does not need the graph ...
    other = _graph(N + 2, name="other")
    with pytest.raises(ScheduleError, match=rf"fingerprint '{g.fingerprint}'"):
        s.validate(other)  # ... validating against another one fails


def test_loaded_edited_nodes_fail_validate(g: CostGraph, tmp_path: Path) -> None:
    d = _doc(g)
    d["fingerprint"] = ""  # hand-written: no fingerprint, so only the nodes are checked
    d["regions"][1]["nodes"].remove("n7")
    (tmp_path / "s.json").write_text(json.dumps(d))
    s = Schedule.load(tmp_path / "s.json")
    with pytest.raises(ScheduleError, match=r"regions skip node 'n7'"):
        s.validate(g)


# -------------------------------------------------------------------------- nested regions


def _nested(g: CostGraph) -> Schedule:
    """keep n0..n1 | recompute n2..n9 [keep n2..n3 | recompute n4..n7 [recompute n4..n5 | keep
    n6..n7] | recompute n8..n9] | keep n10..n11."""
    c = g.compute_nodes
    inner = (Region(KEEP, tuple(c[2:4])),
             Region(RECOMPUTE, tuple(c[4:8]), inner=(Region(RECOMPUTE, tuple(c[4:6])),
                                                     Region(KEEP, tuple(c[6:8])))),
             Region(RECOMPUTE, tuple(c[8:10])))
    s = Schedule([Region(KEEP, tuple(c[:2])), Region(RECOMPUTE, tuple(c[2:10]), inner=inner),
                  Region(KEEP, tuple(c[10:]))], fingerprint=g.fingerprint)
    s.validate(g)
    return s


def test_depth_counts_levels(g: CostGraph) -> None:
    flat = Schedule.from_regions(g, [(0, 2, KEEP), (2, N, RECOMPUTE)])
    assert flat.depth == 1 and not flat.nested
    assert Schedule.none(g).depth == 1
    s = _nested(g)
    assert s.depth == 3 and s.nested
    assert [r.depth for r in s.regions] == [1, 3, 1]
    assert len(s.recompute_regions) == 1  # top-level ones


def test_nested_json_is_version_2_and_round_trips(g: CostGraph, tmp_path: Path) -> None:
    s = _nested(g)
    s.save(tmp_path / "s.json")
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["version"] == 2
    assert d["regions"][1]["inner"][1] == {
        "policy": RECOMPUTE, "nodes": ["n4", "n5", "n6", "n7"], "save": [],
        "inner": [{"policy": RECOMPUTE, "nodes": ["n4", "n5"], "save": []},
                  {"policy": KEEP, "nodes": ["n6", "n7"], "save": []}]}
    assert "inner" not in d["regions"][0] and "inner" not in d["regions"][1]["inner"][0]
    back = Schedule.load(tmp_path / "s.json")
    assert back == s and back.depth == 3


def test_flat_json_is_written_exactly_as_version_1(g: CostGraph) -> None:
    # the bytes a version-1 writer produced for this schedule (no "inner" key anywhere)
    s = Schedule.from_regions(g, [(0, 2, KEEP), (2, N, RECOMPUTE, ["n2"])], solver="dp")
    regions = [{"policy": "keep", "nodes": ["n0", "n1"], "save": []},
               {"policy": "recompute", "nodes": [f"n{i}" for i in range(2, N)],
                "save": ["n2"]}]
    expected = {"schema": SCHEMA, "version": 1, "fingerprint": g.fingerprint,
                "budget_bytes": None, "solver": "dp", "status": "", "gap": None,
                "solve_s": None, "estimate": None, "meta": {}, "regions": regions}
    assert json.dumps(s.to_dict(), indent=1) == json.dumps(expected, indent=1)


def test_inner_regions_must_cover_their_region_in_order(g: CostGraph) -> None:
    c = g.compute_nodes
    with pytest.raises(ScheduleError, match=r"must cover its 4 nodes exactly, in order; they "
                                            r"cover 3 \(at position 3 the region has 'n5'"):
        Region(RECOMPUTE, tuple(c[2:6]), inner=(Region(KEEP, tuple(c[2:5])),))
    with pytest.raises(ScheduleError, match=r"at position 0 the region has 'n2' and the inner "
                                            r"regions 'n4'"):
        Region(RECOMPUTE, tuple(c[2:6]), inner=(Region(KEEP, tuple(c[4:6])),
                                                 Region(KEEP, tuple(c[2:4]))))


def test_only_recompute_regions_nest(g: CostGraph) -> None:
    c = g.compute_nodes
    with pytest.raises(ScheduleError, match=r"'keep' but has inner regions; only recompute"):
        Region(KEEP, tuple(c[2:4]), inner=(Region(KEEP, tuple(c[2:4])),))


@pytest.mark.parametrize("where", ["outer", "inner", "deeper"])
def test_save_sets_in_nested_regions_are_refused(g: CostGraph, where: str) -> None:
    c = g.compute_nodes

    def save(name: str, here: str) -> frozenset[str]:
        return frozenset({name}) if where == here else frozenset()

    with pytest.raises(ScheduleError, match=r"region 'n[24]' \.\. 'n5' nests regions and has a "
                                            r"save set in it: .*drop the save sets there, or "
                                            r"solve without nesting"):
        deeper = Region(RECOMPUTE, tuple(c[4:6]), save("n4", "deeper"))
        inner = (Region(RECOMPUTE, tuple(c[2:4]), save("n2", "inner")),
                 Region(RECOMPUTE, tuple(c[4:6]), inner=(deeper,)))
        Region(RECOMPUTE, tuple(c[2:6]), save("n2", "outer"), inner)


def test_describe_indents_inner_regions(g: CostGraph) -> None:
    lines = _nested(g).describe().splitlines()
    assert lines[1].startswith("recompute  n2 .. n9")
    assert lines[2].startswith("  keep       n2 .. n3")
    assert lines[4].startswith("    recompute  n4 .. n5")


def test_inner_given_as_a_list_is_kept_as_a_tuple(g: CostGraph) -> None:
    c = g.compute_nodes
    r = Region(RECOMPUTE, tuple(c[2:4]), frozenset(), [Region(KEEP, tuple(c[2:4]))])
    assert isinstance(r.inner, tuple) and hash(r) == hash(r)
