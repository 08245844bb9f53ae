"""benchmarks/calibrate.py: its quick mode runs end to end on the GPT example; each op kind's
times are its nodes' times, so the kinds add up to every node of each profile; ``none``'s
predicted step is its profile's unscheduled step; and ``--write`` fills its section."""

from __future__ import annotations

import pytest
from conftest import benchmark_modules

import scheduler
from examples.gpt import build

_calibrate_kinds, _record, calibrate = benchmark_modules("_calibrate_kinds", "_record", "calibrate")


def test_an_unknown_example_is_refused() -> None:
    with pytest.raises(SystemExit) as e:
        calibrate.parse(["--quick", "--examples", "gpt,nope"])
    assert e.value.code == 2


def test_quick_run_adds_up_and_writes_its_section(tmp_path, monkeypatch) -> None:
    argv = ["--quick", "--examples", "gpt", "--write"]
    args = calibrate.parse(argv)
    results = calibrate.collect(args)
    spec = results["spec"]
    assert spec.flops_fp32 > 1e8 and spec.bandwidth > 1e8 and 0 < spec.per_op_s < 1e-3
    (ex,) = results["examples"]
    graphs = ex["graphs"]
    assert set(graphs) == {"real", "isolated", "roofline"} and not ex["failed"]
    assert ex["unmatched"] == {}  # (the three profiles trace the same nodes)
    for profile, graph in graphs.items():
        kinds = ex["kinds"][profile]
        assert sum(k.count for k in kinds.values()) == len(graph.nodes)
        assert sum(k.fwd_s for k in kinds.values()) == pytest.approx(
            sum(n.time_s for n in graph.nodes), rel=1e-12)
        assert sum(k.bwd_s for k in kinds.values()) == pytest.approx(
            sum(n.bwd_time_s for n in graph.nodes), rel=1e-12)
        assert (graph.meta.get("times") or "measured") == {"real": "measured"}.get(profile, profile)
    # the real profile's kinds, one by one, from the graph's nodes
    kind = _calibrate_kinds.op_kind(build(**calibrate.QUICK["gpt"])[0])
    for name, k in ex["kinds"]["real"].items():
        nodes = [n for n in graphs["real"].nodes if kind(n) == name]
        assert k.count == len(nodes)
        assert k.fwd_s == pytest.approx(sum(n.time_s for n in nodes), rel=1e-12)
    assert {"Linear", "LayerNorm", "scaled_dot_product_attention"} <= set(ex["kinds"]["real"])

    plans = ex["plans"]
    assert [(p["profile"], p["budget"]) for p in plans] == [
        (profile, b) for profile in calibrate.SOLVED for b in ("none", *calibrate.BUDGETS)]
    for p in plans:
        if p["budget"] == "none":
            graph = graphs[p["profile"]]
            assert p["predicted_s"] == pytest.approx(graph.measured_step_s, rel=1e-9)
            assert p["predicted_s"] == scheduler.simulate(
                graph, scheduler.Schedule.none(graph)).step_s
        if p["status"] != "INFEASIBLE":
            assert p["measured_s"] > 0 and p["predicted_s"] > 0
        if p["status"] in ("OPTIMAL", "FEASIBLE"):  # a plan adds recompute to none's step
            assert p["predicted_s"] >= graphs[p["profile"]].measured_step_s

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- begin calibrate -->\nold\n<!-- end calibrate -->\n")
    monkeypatch.setattr(_record, "DOC", doc)
    calibrate.report(results, args, argv)
    text = doc.read_text()
    assert "old" not in text and "calibrate.py --quick --examples gpt --write" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    totals = [r for r in rows if r[0] == "| total"]
    assert len(totals) == 1 and totals[0][1] == str(len(graphs["real"].nodes))
    measured = [p for p in plans if p["measured_s"] is not None]
    verdicts = [r[-1].rstrip(" |") for r in rows if r[-1].rstrip(" |") in ("yes", "no")]
    assert len(verdicts) == len(measured)
    assert f"of {len(measured)} predicted steps are within 10%" in text
