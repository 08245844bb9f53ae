"""The compiled time model (`cost.compiled`): what a replay costs under ``torch.compile``,
the share of each node's work it keeps (`Node.flop_share`, recorded by the profile), and
plans solved for it (``execution="compiled"``).

References: replay costs worked out by hand on a chain whose replays are known; the optimum
under the compiled costs by enumerating every schedule of a small chain (`brute.schedules`);
shares against which ops have FLOPs (a ``Linear`` has, a ``ReLU`` or a view has none).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from _chain import chain

import scheduler
from scheduler.cost.compiled import (FUSED_REPLAY_SHARE, CompiledCostWarning, compiled_costs,
                                     costs_for)
from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph, CostGraphError
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule
from scheduler.solvers.brute import schedules

#: the chain's "matmul" nodes (share 1) and their eager times; the rest are pointwise (share 0)
MATMULS = {"n1": 1.0, "n3": 1.0}


def shared(g: CostGraph, shares: dict[str, float], default: float = 0.0) -> CostGraph:
    return replace(g, nodes=[replace(n, flop_share=shares.get(n.name, default))
                             for n in g.nodes])


def alternating() -> CostGraph:
    """Six nodes, n1 and n3 "matmuls" (share 1, 1 ms), the rest pointwise (share 0) and
    slower in eager (1.5 ms, as dropout or GELU on a CPU can be); checkpoint costs set."""
    times = [1.5e-3, 1e-3, 1.5e-3, 1e-3, 1.5e-3, 1.5e-3]
    g = chain([""] * 6, time_s=times)
    g = replace(g, checkpoint_call_s=2e-4, checkpoint_saved_s=5e-5)
    return shared(g, MATMULS)


def regions(g: CostGraph, spans: list[tuple[int, int, str]]) -> Schedule:
    names = g.compute_nodes
    return Schedule([Region(p, tuple(names[a:b])) for a, b, p in spans])


def test_a_replay_costs_its_nodes_times_their_share_and_no_checkpoint_machinery() -> None:
    g = alternating()
    # n1..n3 recomputed: backward needs n1's and n2's outputs again (n2 and n3 save them), and
    # the replay stops at n3, which saves its input before it runs: n1 and n2 replay
    s = regions(g, [(0, 1, KEEP), (1, 4, RECOMPUTE), (4, 6, KEEP)])
    eager = simulate(g, s, timeline=False)
    compiled = simulate(compiled_costs(g), s, timeline=False)
    assert eager.recompute_s == pytest.approx(1e-3 + 1.5e-3 + 2e-4 + 3 * 5e-5)
    # (n2, pointwise, fuses into backward's kernels: its replay costs nothing)
    assert FUSED_REPLAY_SHARE == 0
    assert compiled.recompute_s == pytest.approx(1e-3 * 1.0)
    assert compiled.peak_bytes == eager.peak_bytes
    assert compiled_costs(g).fingerprint == g.fingerprint


def test_compiled_planning_keeps_matmuls_and_replays_what_fuses() -> None:
    g = alternating()
    costs = compiled_costs(g)
    points = list(range(len(g.compute_nodes) + 1))
    every = [Schedule([Region(p, tuple(g.compute_nodes[a:b])) for a, b, p in spans])
             for spans in schedules(g, points)]
    none_peak = simulate(g, Schedule.none(g), timeline=False).peak_bytes
    least = min(simulate(g, s, timeline=False).peak_bytes for s in every)
    budget = (none_peak + least) // 2
    fits = [s for s in every if simulate(g, s, timeline=False).peak_bytes <= budget]
    best_compiled = min(simulate(costs, s, timeline=False).recompute_s for s in fits)
    best_eager = min(simulate(g, s, timeline=False).recompute_s for s in fits)

    for_compile = scheduler.solve_graph(g, budget, execution="compiled", time_limit_s=10)
    for_eager = scheduler.solve_graph(g, budget, time_limit_s=10)
    assert for_compile.schedule.meta["execution"] == "compiled"
    assert "execution" not in for_eager.schedule.meta
    got = simulate(costs, for_compile.schedule, timeline=False)
    assert got.peak_bytes <= budget
    assert got.recompute_s == pytest.approx(best_compiled, abs=1e-12)
    assert for_compile.estimate.recompute_s == pytest.approx(best_compiled, abs=1e-12)
    assert simulate(g, for_eager.schedule, timeline=False).recompute_s == pytest.approx(best_eager)
    # the two time models choose differently here: eager's choice replays a matmul
    eager_choice_compiled = simulate(costs, for_eager.schedule, timeline=False).recompute_s
    assert eager_choice_compiled > best_compiled + 1e-4


def priced(g: CostGraph, share_of) -> CostGraph:
    """``g`` with each node's time ``share_of(node) * time_s`` and no checkpoint costs."""
    return replace(g, nodes=[replace(n, time_s=n.time_s * share_of(n), sac_s=None)
                             for n in g.nodes], checkpoint_call_s=0.0, checkpoint_saved_s=0.0)


def test_nodes_without_a_share_keep_their_eager_time_and_warn() -> None:
    g = chain([""] * 4, time_s=1e-3)
    assert all(n.flop_share is None for n in g.nodes)
    with pytest.warns(CompiledCostWarning, match="profile the model again"):
        costs = compiled_costs(g)
    assert [n.time_s for n in costs.nodes] == [n.time_s for n in g.nodes]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert costs_for(g, "eager") is g
        compiled_costs(shared(g, {}, default=0.5))


def test_execution_and_step_are_checked_by_name() -> None:
    g = alternating()
    with pytest.raises(ValueError, match="execution must be one of 'eager', 'compiled'.*'jit'"):
        scheduler.solve_graph(g, "90%", execution="jit")
    with pytest.raises(ValueError, match="step_s must be a positive"):
        compiled_costs(g, step_s=0.0)
    assert compiled_costs(g, step_s=0.25).measured_step_s == 0.25


def test_flop_share_round_trips_and_a_bad_one_is_named(tmp_path) -> None:
    g = alternating()
    path = tmp_path / "g.json"
    g.save(path)
    assert [n.flop_share for n in CostGraph.load(path).nodes] == [n.flop_share for n in g.nodes]
    d = json.loads(path.read_text())
    d["nodes"][1]["flop_share"] = 1.5
    path.write_text(json.dumps(d))
    with pytest.raises(CostGraphError, match=r"nodes\[1\]\.flop_share: 1\.5 is not a fraction"):
        CostGraph.load(path)
    del d["nodes"][1]["flop_share"]
    path.write_text(json.dumps(d))
    assert CostGraph.load(path).nodes[1].flop_share is None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        y = self.fc2(h).transpose(0, 1)
        return y.sum() + torch.tanh(self.conv(img)).sum()


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_profile_records_the_share_of_each_nodes_flop_work(mode: str) -> None:
    torch.manual_seed(0)
    g = scheduler.profile(Net(), (torch.randn(32, 64), torch.randn(2, 4, 16, 16)), mode=mode,
                          repeats=1)
    share = {n.target.split(".")[-1]: n.flop_share for n in g.nodes if not n.is_loss}
    # a Linear is an addmm (FLOPs) and a convolution too; their bias and layout work is small
    assert share["fc1"] > 0.5 and share["fc2"] > 0.5 and share["conv"] > 0.5
    assert share["relu"] == 0.0 and share["tanh"] == 0.0 and share["transpose"] == 0.0
