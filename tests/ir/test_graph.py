"""`CostGraph`: construction, JSON round trip, validation errors, fingerprint, saved bytes,
networkx view, and the recorded graphs in ``graphs/``.

Torch-free: every graph here is built by hand from the dataclasses or loaded from JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import RECORDED_GRAPHS

from scheduler.cost.simulate import simulate
from scheduler.ir.graph import (
    SCHEMA,
    VERSION,
    BwdStep,
    CostGraph,
    CostGraphError,
    Node,
    Saved,
    Storage,
    with_step_time,
)
from scheduler.ir.schedule import Schedule
from scheduler.solvers import get_solver


def make_graph(**overrides: Any) -> CostGraph:
    """A five-node graph: x1 = fc1(input); r = relu(x1); x2 = fc2(r); add = x1 + x2; loss = mean.

    Storage 1 (r's output) is saved by two nodes (r and x2); fc2 allocates and frees an op
    temporary (storage 5); ``loss`` is a loss node.
    """
    nodes = [
        Node("x1", "call_module", "fc1", (), module_path="blocks.0.fc1", block="blocks.0",
             time_s=1.5e-5, bwd_time_s=2.5e-5, out_bytes=256,
             saved=(Saved("input:0", None, 64), Saved("param:blocks.0.fc1.weight", None, 128)),
             shape="float32[4,16]"),
        Node("r", "call_function", "relu", ("x1",), module_path="blocks.0", block="blocks.0",
             time_s=2e-6, bwd_time_s=3e-6, out_bytes=256, saved=(Saved("r", 1, 256),),
             shape="float32[4,16]"),
        Node("x2", "call_module", "fc2", ("r",), module_path="blocks.0.fc2", block="blocks.0",
             time_s=1e-5, bwd_time_s=2e-5, out_bytes=256,
             saved=(Saved("r", 1, 256), Saved("param:blocks.0.fc2.weight", None, 1024)),
             shape="float32[4,16]"),
        Node("add", "call_function", "add", ("x1", "x2"), time_s=1e-6, out_bytes=256,
             shape="float32[4,16]"),
        Node("loss", "call_method", "mean", ("add",), is_loss=True, time_s=1e-6, out_bytes=4,
             shape="float32[]"),
    ]
    storages = {
        0: Storage(0, 256, "x1", True, False, "add"),
        1: Storage(1, 256, "r", True, False, "x2", savers=("r", "x2")),
        2: Storage(2, 256, "x2", True, False, "add"),
        5: Storage(5, 512, "x2", False, True, "x2"),
        3: Storage(3, 256, "add", True, False, "loss"),
        4: Storage(4, 4, "loss", True, False, "loss"),
    }
    kwargs: dict[str, Any] = dict(
        name="tiny",
        nodes=nodes,
        storages=storages,
        fwd_events={"x1": [("a", 0)], "r": [("a", 1)], "x2": [("a", 2), ("a", 5), ("f", 5)],
                    "add": [("a", 3)], "loss": [("a", 4)]},
        bwd_steps=[BwdStep("", 1e-6, (("a", 0, 4),)),
                   BwdStep("loss", 2e-6, (("a", 1, 256), ("f", 0, 0))),
                   BwdStep("x2", 3e-6, (("a", 2, 1024), ("a", 3, 256), ("f", 1, 0)))],
        param_bytes=1152, buffer_bytes=0, input_bytes=64, grad_bytes=1152,
        measured_peak_bytes=4096, measured_step_s=1e-4,
        meta={"tracer": "fx", "note": "hand-built", "n": 3},
    )
    kwargs.update(overrides)
    return CostGraph(**kwargs)


def write(tmp_path: Path, d: Any, name: str = "g.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


def load_error(tmp_path: Path, d: Any) -> str:
    """Load ``d`` from a file; it must raise `CostGraphError`. Returns the message."""
    with pytest.raises(CostGraphError) as info:
        CostGraph.load(write(tmp_path, d))
    return str(info.value)


# ----------------------------------------------------------------------------- structure


def test_structure_accessors() -> None:
    g = make_graph()
    assert [n.name for n in g.nodes] == ["x1", "r", "x2", "add", "loss"]
    assert g.index("x2") == 2
    assert g.node("add").inputs == ("x1", "x2")
    assert g.compute_nodes == ["x1", "r", "x2", "add"]  # the loss node is excluded
    assert g.base_bytes == 1152 + 0 + 64
    with pytest.raises(KeyError, match="nope"):
        g.index("nope")


def test_node_saved_bytes_is_the_sum_of_its_saved_tensors() -> None:
    g = make_graph()
    assert g.node("x1").saved_bytes == 64 + 128
    assert g.node("x2").saved_bytes == 256 + 1024
    assert g.node("add").saved_bytes == 0


def test_saved_bytes_counts_a_storage_saved_by_two_nodes_once() -> None:
    g = make_graph()
    # input 64 + fc1.weight 128 + storage 1 (saved by r and by x2) 256 + fc2.weight 1024
    assert g.saved_bytes() == 64 + 128 + 256 + 1024


def test_saved_bytes_counts_a_parameter_saved_by_two_nodes_once() -> None:
    g = make_graph()
    nodes = list(g.nodes)
    nodes[3] = dataclasses.replace(nodes[3], saved=(Saved("param:blocks.0.fc2.weight", None, 1024),))
    g2 = make_graph(nodes=nodes)
    assert g2.saved_bytes() == g.saved_bytes()


def test_saved_bytes_of_an_empty_graph_is_zero() -> None:
    assert CostGraph("empty", []).saved_bytes() == 0


def test_to_networkx_edges_and_attributes() -> None:
    nx_g = make_graph().to_networkx()
    assert list(nx_g.nodes) == ["x1", "r", "x2", "add", "loss"]
    assert set(nx_g.edges) == {("x1", "r"), ("r", "x2"), ("x1", "add"), ("x2", "add"),
                               ("add", "loss")}
    assert nx_g.nodes["x2"]["target"] == "fc2"
    assert nx_g.nodes["x2"]["out_bytes"] == 256
    assert nx_g.nodes["loss"]["is_loss"] is True


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_changes_with_a_shape() -> None:
    g = make_graph()
    nodes = list(g.nodes)
    nodes[2] = dataclasses.replace(nodes[2], shape="float32[8,16]")
    assert make_graph(nodes=nodes).fingerprint != g.fingerprint


@pytest.mark.parametrize("field,value", [
    ("target", "fc3"), ("op", "call_function"), ("is_loss", True), ("inputs", ("x1",)),
])
def test_fingerprint_changes_with_structure(field: str, value: Any) -> None:
    g = make_graph()
    nodes = list(g.nodes)
    nodes[2] = dataclasses.replace(nodes[2], **{field: value})
    assert make_graph(nodes=nodes).fingerprint != g.fingerprint


def test_fingerprint_ignores_times_and_bytes() -> None:
    g = make_graph()
    nodes = [dataclasses.replace(n, time_s=n.time_s * 7 + 1, bwd_time_s=3.0,
                                 out_bytes=n.out_bytes + 100,
                                 saved=tuple(dataclasses.replace(s, bytes=s.bytes * 2)
                                             for s in n.saved))
             for n in g.nodes]
    storages = {k: dataclasses.replace(s, bytes=s.bytes + 1) for k, s in g.storages.items()}
    g2 = make_graph(nodes=nodes, storages=storages, measured_peak_bytes=1, measured_step_s=9.0,
                    param_bytes=7, bwd_steps=[], meta={})
    assert g2.fingerprint == g.fingerprint


def test_fingerprint_is_a_stable_hex_string() -> None:
    a, b = make_graph(), make_graph()
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 16 and int(a.fingerprint, 16) >= 0


# ----------------------------------------------------------------------------- JSON round trip


def test_json_round_trip_is_exact(tmp_path: Path) -> None:
    g = make_graph()
    path = tmp_path / "g.json"
    g.save(path)
    g2 = CostGraph.load(path)
    assert g2 == g
    assert g2.to_dict() == g.to_dict()
    # field by field, independently of to_dict: the dataclasses themselves are equal
    assert g2.nodes == g.nodes
    assert g2.storages == g.storages
    assert list(g2.storages) == list(g.storages)
    assert g2.fwd_events == g.fwd_events
    assert g2.bwd_steps == g.bwd_steps
    for f in ("name", "param_bytes", "buffer_bytes", "input_bytes", "grad_bytes",
              "measured_peak_bytes", "measured_step_s", "meta", "checkpoint_call_s",
              "checkpoint_saved_s"):
        assert getattr(g2, f) == getattr(g, f), f
    assert g2.fingerprint == g.fingerprint
    # and saving again gives the same bytes
    path2 = tmp_path / "g2.json"
    g2.save(path2)
    assert path2.read_text() == path.read_text()


def test_file_is_tagged_with_schema_version_and_fingerprint(tmp_path: Path) -> None:
    g = make_graph()
    g.save(tmp_path / "g.json")
    d = json.loads((tmp_path / "g.json").read_text())
    assert d["schema"] == SCHEMA == "scheduler.costgraph"
    assert d["version"] == VERSION
    assert d["fingerprint"] == g.fingerprint


def test_equality_sees_a_changed_time() -> None:
    g = make_graph()
    nodes = list(g.nodes)
    nodes[0] = dataclasses.replace(nodes[0], time_s=1.0)
    assert make_graph(nodes=nodes) != g
    assert g != "not a graph"


# ----------------------------------------------------------------------------- errors


@pytest.fixture
def good() -> dict[str, Any]:
    return make_graph().to_dict()


def test_wrong_schema(tmp_path: Path, good: dict[str, Any]) -> None:
    good["schema"] = "something.else"
    msg = load_error(tmp_path, good)
    assert "schema" in msg and "something.else" in msg


def test_wrong_version_says_to_reprofile(tmp_path: Path, good: dict[str, Any]) -> None:
    good["version"] = VERSION - 1  # older; a newer one says to upgrade (tests/ir/test_loaders.py)
    msg = load_error(tmp_path, good)
    assert "version" in msg and "re-profile" in msg


@pytest.mark.parametrize("field", ["name", "nodes", "storages", "fwd_events", "bwd_steps",
                                   "param_bytes", "buffer_bytes", "input_bytes", "grad_bytes",
                                   "measured_peak_bytes", "measured_step_s", "meta"])
def test_missing_field(tmp_path: Path, good: dict[str, Any], field: str) -> None:
    del good[field]
    msg = load_error(tmp_path, good)
    assert field in msg and "missing" in msg


@pytest.mark.parametrize("field", ["name", "op", "target", "inputs", "saved"])
def test_missing_node_field(tmp_path: Path, good: dict[str, Any], field: str) -> None:
    del good["nodes"][1][field]
    assert field in load_error(tmp_path, good)


@pytest.mark.parametrize("field,value", [
    ("param_bytes", "1152"), ("param_bytes", 1.5), ("param_bytes", True),
    ("measured_step_s", "fast"), ("nodes", {"x1": {}}), ("storages", {}), ("meta", []),
    ("name", 3),
])
def test_wrong_type(tmp_path: Path, good: dict[str, Any], field: str, value: Any) -> None:
    good[field] = value
    assert field in load_error(tmp_path, good)


@pytest.mark.parametrize("field,value", [
    ("out_bytes", "256"), ("out_bytes", 2.5), ("time_s", "fast"), ("is_loss", "no"),
    ("inputs", "x1"), ("inputs", [1]), ("target", 5), ("saved", [["r", 1]]),
])
def test_wrong_node_field_type(tmp_path: Path, good: dict[str, Any], field: str,
                               value: Any) -> None:
    good["nodes"][2][field] = value
    assert field in load_error(tmp_path, good)


@pytest.mark.parametrize("col,value", [(1, "256"), (3, "false"), (2, 7), (6, "r")])
def test_wrong_storage_field_type(tmp_path: Path, good: dict[str, Any], col: int,
                                  value: Any) -> None:
    good["storages"][1][col] = value
    assert "storages[1]" in load_error(tmp_path, good)


def test_unknown_node_field(tmp_path: Path, good: dict[str, Any]) -> None:
    good["nodes"][0]["colour"] = "red"
    assert "colour" in load_error(tmp_path, good)


def test_unknown_node_in_inputs(tmp_path: Path, good: dict[str, Any]) -> None:
    good["nodes"][2]["inputs"] = ["ghost"]
    del good["fingerprint"]  # the structural check, not the hash, must catch it
    msg = load_error(tmp_path, good)
    assert "inputs" in msg and "ghost" in msg
    with pytest.raises(CostGraphError, match="ghost"):
        make_graph(nodes=[*make_graph().nodes[:2],
                          dataclasses.replace(make_graph().nodes[2], inputs=("ghost",)),
                          *make_graph().nodes[3:]])


def test_nodes_out_of_order(tmp_path: Path, good: dict[str, Any]) -> None:
    good["nodes"][1], good["nodes"][2] = good["nodes"][2], good["nodes"][1]
    del good["fingerprint"]
    msg = load_error(tmp_path, good)
    assert "inputs" in msg and "order" in msg
    nodes = make_graph().nodes
    with pytest.raises(CostGraphError, match="order"):
        make_graph(nodes=[nodes[0], nodes[2], nodes[1], *nodes[3:]])


def test_duplicate_node_names(tmp_path: Path, good: dict[str, Any]) -> None:
    good["nodes"][3]["name"] = "x2"
    good["nodes"][4]["inputs"] = ["x2"]
    del good["fingerprint"]
    msg = load_error(tmp_path, good)
    assert "duplicate" in msg and "x2" in msg
    nodes = make_graph().nodes
    with pytest.raises(CostGraphError, match="duplicate"):
        make_graph(nodes=[*nodes, dataclasses.replace(nodes[-1], inputs=())])


@pytest.mark.parametrize("where", ["storage_producer", "storage_saver", "saved_storage",
                                   "fwd_events", "bwd_step"])
def test_dangling_references(tmp_path: Path, good: dict[str, Any], where: str) -> None:
    if where == "storage_producer":
        good["storages"][0][2] = "ghost"
    elif where == "storage_saver":
        good["storages"][1][6] = ["ghost"]
    elif where == "saved_storage":
        good["nodes"][1]["saved"] = [["r", 99, 256]]
    elif where == "fwd_events":
        good["fwd_events"]["ghost"] = [["a", 0]]
    else:
        good["bwd_steps"][1][0] = "ghost"
    msg = load_error(tmp_path, good)
    assert "ghost" in msg or "99" in msg


def test_negative_storage_bytes(tmp_path: Path, good: dict[str, Any]) -> None:
    good["storages"][0][1] = -5
    assert "bytes" in load_error(tmp_path, good)


def test_edited_shape_no_longer_matches_fingerprint(tmp_path: Path,
                                                    good: dict[str, Any]) -> None:
    good["nodes"][2]["shape"] = "float32[8,16]"
    msg = load_error(tmp_path, good)
    assert "fingerprint" in msg and "edited or corrupted" in msg


def test_edited_times_still_load(tmp_path: Path, good: dict[str, Any]) -> None:
    """Times and bytes are measurements, not structure: editing them keeps the fingerprint."""
    good["nodes"][2]["time_s"] = 1.0
    g = CostGraph.load(write(tmp_path, good))
    assert g.node("x2").time_s == 1.0


@pytest.mark.parametrize("text", ["", "{", "not json", '{"schema": "scheduler.costgraph",'])
def test_invalid_json(tmp_path: Path, text: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(CostGraphError, match="not valid JSON") as info:
        CostGraph.load(p)
    assert str(p) in str(info.value)


@pytest.mark.parametrize("d", [[], "graph", 3, None])
def test_not_an_object(tmp_path: Path, d: Any) -> None:
    load_error(tmp_path, d)


def test_load_error_names_the_file(tmp_path: Path, good: dict[str, Any]) -> None:
    good["version"] = 0
    p = write(tmp_path, good, "old-graph.json")
    with pytest.raises(CostGraphError, match="old-graph.json"):
        CostGraph.load(p)


def test_error_is_a_value_error(tmp_path: Path, good: dict[str, Any]) -> None:
    good["schema"] = None
    with pytest.raises(ValueError):
        CostGraph.from_dict(copy.deepcopy(good))


# ----------------------------------------------------------------------------- recorded graphs


@pytest.mark.parametrize(("name", "path"), RECORDED_GRAPHS, ids=[n for n, _ in RECORDED_GRAPHS])
def test_recorded_graphs_load(name: str, path: Path, tmp_path: Path) -> None:
    g = CostGraph.load(path)
    assert g.nodes, "a recorded graph has nodes"
    assert g.saved_bytes() > 0
    assert g.measured_peak_bytes >= g.base_bytes > 0
    g.save(tmp_path / "again.json")
    assert CostGraph.load(tmp_path / "again.json") == g


def test_pack_mark_out_of_range(tmp_path: Path, good: dict[str, Any]) -> None:
    """A node's pack_mark counts its own forward events: more than it has is an error that
    names the node and the range; a valid one round-trips and drives `replay_mark`."""
    name = good["nodes"][1]["name"]
    n_events = len(good["fwd_events"].get(name, []))
    good["nodes"][1]["pack_mark"] = n_events + 1
    msg = load_error(tmp_path, good)
    assert "pack_mark" in msg and name in msg and f"[0, {n_events}]" in msg
    good["nodes"][1]["pack_mark"] = 0
    g = CostGraph.from_dict(good)
    assert g.node(name).pack_mark == 0 and g.replay_mark(name) == 0
    assert CostGraph.from_dict(g.to_dict()).node(name).pack_mark == 0


def test_with_step_time_scales_every_time_and_no_byte(recorded_graph: Any) -> None:
    """Re-timing a recorded graph scales the simulated step and recompute time by the same
    factor and changes no predicted byte."""
    g = recorded_graph("gpt")
    s = get_solver("every_block")(g, 1 << 62).schedule
    g2 = with_step_time(g, 3 * g.measured_step_s)
    a, b = simulate(g, s), simulate(g2, Schedule.from_dict(s.to_dict()))
    assert b.peak_bytes == a.peak_bytes and b.timeline == a.timeline
    assert b.step_s == pytest.approx(3 * a.step_s, rel=1e-12)
    assert b.recompute_s == pytest.approx(3 * a.recompute_s, rel=1e-12)
    assert b.overhead == pytest.approx(a.overhead, rel=1e-12)
    assert g.checkpoint_call_s > 0 and g.checkpoint_saved_s > 0  # scaled with the rest
    assert g2.checkpoint_call_s == pytest.approx(3 * g.checkpoint_call_s, rel=1e-12)
    assert g2.fingerprint == g.fingerprint
    with pytest.raises(ValueError, match="positive"):
        with_step_time(g, 0.0)


def test_checkpoint_costs_are_optional_in_json_and_checked(tmp_path: Path,
                                                         good: dict[str, Any]) -> None:
    """Graphs recorded before checkpoint costs were measured load with zero; a negative or
    infinite cost is an error naming the field."""
    g = make_graph()
    g.checkpoint_call_s, g.checkpoint_saved_s = 2e-4, 1.5e-5
    assert CostGraph.from_dict(g.to_dict()).checkpoint_saved_s == 1.5e-5
    old = dict(good)
    old.pop("checkpoint_call_s"), old.pop("checkpoint_saved_s")
    g0 = CostGraph.from_dict(old)
    assert (g0.checkpoint_call_s, g0.checkpoint_saved_s) == (0.0, 0.0)
    for field, value in (("checkpoint_call_s", -1e-4), ("checkpoint_saved_s", 1e400),
                         ("checkpoint_call_s", "slow")):
        bad = {**good, field: value}
        assert field in load_error(tmp_path, bad)
