"""The block DP (``blocks``): repeated blocks found, and its answers equal brute force over its
own space (every schedule of the space simulated), never better than a proven optimum."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _optima import NOTHING_FITS, OPTIMA, REL
from conftest import budget_bytes
from torch import nn

import scheduler
from scheduler.cost.simulate import simulate
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP
from scheduler.solvers import INFEASIBLE, SolverConfig, get_solver
from scheduler.solvers.blockdp import floor_bytes, table_of
from scheduler.solvers.blocks import BLOCK, PREFIX, SUFFIX, find_blocks
from scheduler.solvers.blocktable import build_schedule


def _fake(model: nn.Module, *inputs: Any) -> CostGraph:
    return scheduler.profile(model, inputs, mode="fake", times="roofline", device_spec="cpu",
                             units=None)


def _gpt(layers: int, batch: int = 2, seq: int = 16) -> CostGraph:
    from examples.gpt import build
    model, inputs = build(batch=batch, block_size=seq, n_layer=layers, n_head=2, n_embd=16,
                          vocab_size=32)
    return _fake(model, *inputs)


class Residual(nn.Module):
    def __init__(self, width: int, hidden: int, act: type[nn.Module] = nn.GELU):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.act = act()
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Stack(nn.Module):
    """Embedding, residual MLP blocks (``layers.i``), a head and a loss."""

    def __init__(self, hiddens: list[int], acts: list[type[nn.Module]] | None = None):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        acts = acts or [nn.GELU] * len(hiddens)
        self.layers = nn.ModuleList(Residual(16, h, a) for h, a in zip(hiddens, acts))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).square().mean()


def _stack(hiddens: list[int], acts: list[type[nn.Module]] | None = None) -> CostGraph:
    torch.manual_seed(0)
    return _fake(Stack(hiddens, acts).train(), torch.randn(4, 32, 8))


# -- detection ------------------------------------------------------------------------------

def _kinds(graph: CostGraph) -> list[tuple[str, int]]:
    return [(s.role, s.kind) for s in find_blocks(graph).stages]


def test_gpt_example_blocks() -> None:
    stages = find_blocks(_gpt(5)).stages
    assert [s.role for s in stages] == [PREFIX] + [BLOCK] * 5 + [SUFFIX]
    kinds = [s.kind for s in stages[1:-1]]
    # the last block's output is read by the final norm, not by a next block's residual: a
    # different storage lifetime, so a kind of its own
    assert len(set(kinds[:4])) == 1 and kinds[4] != kinds[0]


def test_recorded_graphs_blocks(recorded_graph) -> None:
    kinds = _kinds(recorded_graph("gpt"))
    assert [r for r, _ in kinds] == [PREFIX, BLOCK, BLOCK, BLOCK, BLOCK, SUFFIX]
    assert kinds[1][1] == kinds[2][1] == kinds[3][1] != kinds[4][1]
    mlp = _kinds(recorded_graph("mlp"))
    assert sum(r == BLOCK for r, _ in mlp) == 8
    assert len({k for r, k in mlp[1:-2] if r == BLOCK}) == 1
    # HF GPT-2's blocks all read the attention mask made before them: no block boundary is a
    # chain cut, so there is no chain of blocks (the block DP does not apply)
    assert not find_blocks(recorded_graph("hf_gpt2")).repeats


def test_kinds_do_not_depend_on_times() -> None:
    """A layer timed three times slower (a busy machine) is still its siblings' kind: kinds
    come from structure alone, so that the block DP's space does not follow the load."""
    from dataclasses import replace
    g = _gpt(5)
    stages = find_blocks(g).stages
    slow = set(g.compute_nodes[stages[2].start:stages[2].stop])
    noisy = replace(g, nodes=[replace(n, time_s=3 * n.time_s + 1e-4) if n.name in slow else n
                              for n in g.nodes])
    assert [s.kind for s in find_blocks(noisy).stages] == [s.kind for s in stages]
    assert find_blocks(noisy, fine=True).repeats


def test_different_blocks_are_not_merged() -> None:
    kinds = [k for r, k in _kinds(_stack([32, 32, 48, 32, 32])) if r == BLOCK]
    assert kinds[0] == kinds[1] == kinds[3] and kinds[2] != kinds[0]
    # same shapes, another activation: the ops differ
    kinds = [k for r, k in _kinds(_stack([32] * 4, [nn.GELU, nn.ReLU, nn.GELU, nn.GELU]))
             if r == BLOCK]
    assert kinds[0] == kinds[2] and kinds[1] != kinds[0]


def test_structure_alone_finds_blocks() -> None:
    """Without block labels the period of the chain's pieces gives the blocks."""
    g = _stack([32] * 4)
    unlabelled = CostGraph.from_dict({**g.to_dict(), "fingerprint": None, "nodes": [
        {**n, "block": ""} for n in g.to_dict()["nodes"]]})
    b = find_blocks(unlabelled)
    assert not b.hinted and b.repeats and len(b.chain) >= 3


# -- exactness -------------------------------------------------------------------------------

def _space(table) -> Iterator[list[tuple]]:
    """Every schedule of the DP's space, as merged spans (a reference that reads only the
    space's definition, `table.options`, never its costs)."""
    last = len(table.stages)

    def rec(a: int, spans: tuple) -> Iterator[tuple]:
        if a == last:
            yield spans
            return
        for m in range(1, table.max_span + 1):
            if (a, m) not in table.options:
                break
            for o in range(len(table.options[a, m])):
                yield from rec(a + m, spans + (table.spans(a, m, o),))

    for spans in rec(0, ()):
        out: list[list] = []
        for item in spans:
            if out and item[2] == KEEP and out[-1][2] == KEEP:
                out[-1][1] = item[1]
            else:
                out.append(list(item))
        yield [tuple(x) for x in out]


def _check_against_brute_force(graph: CostGraph, max_span: int, fine: bool = False,
                               save_top: int = 1) -> None:
    table = table_of(graph, max_span=max_span, save_top=save_top, fine=fine)
    seen = {}
    for spans in _space(table):
        est = simulate(graph, build_schedule(graph, spans), timeline=False)
        seen[tuple(spans)] = (est.peak_bytes, est.recompute_s)
    assert len(seen) > 50
    peaks = sorted({p for p, _ in seen.values()})
    assert floor_bytes(table) == peaks[0]
    budgets = peaks[:: max(1, len(peaks) // 12)] + [peaks[-1], peaks[0] - 1]
    for budget in budgets:
        best = min((t for p, t in seen.values() if p <= budget), default=None)
        r = get_solver("blocks")(graph, budget, config=SolverConfig(save_top=save_top),
                                 max_span=max_span, fine=fine)
        if best is None:
            assert r.status == INFEASIBLE and r.min_feasible_bytes == peaks[0]
            continue
        assert r.fits and r.space_optimal, (budget, r.status)
        assert r.estimate.recompute_s == pytest.approx(best, rel=1e-9, abs=1e-15), budget


def test_equals_brute_force_on_recorded_gpt(recorded_graph) -> None:
    _check_against_brute_force(recorded_graph("gpt"), max_span=3)


def test_equals_brute_force_on_a_chain_of_blocks() -> None:
    _check_against_brute_force(_stack([32] * 5), max_span=5)


def test_equals_brute_force_on_pieces_of_blocks(recorded_graph) -> None:
    """Stages are the attention and MLP halves of the GPT blocks; runs mix their kinds."""
    _check_against_brute_force(recorded_graph("gpt"), max_span=2, fine=True, save_top=0)


def test_equals_brute_force_on_gpt_example() -> None:
    _check_against_brute_force(_gpt(5), max_span=4)


@pytest.mark.parametrize("key", [k for k in OPTIMA if k[0] in ("gpt", "mlp")])
def test_never_better_than_a_proven_optimum(recorded_graph, key) -> None:
    g = recorded_graph(key[0])
    r = get_solver("blocks")(g, budget_bytes(g, key[1]))
    if r.status != INFEASIBLE:
        assert r.estimate.recompute_s >= OPTIMA[key] * (1 - REL)
        assert r.space_optimal  # proven over its own space (FEASIBLE until certified)


@pytest.mark.parametrize("key", [k for k in NOTHING_FITS if k[0] in ("gpt", "mlp")])
def test_nothing_fits_where_nothing_can(recorded_graph, key) -> None:
    g = recorded_graph(key[0])
    r = get_solver("blocks")(g, budget_bytes(g, key[1]))
    assert r.status == INFEASIBLE and r.min_feasible_bytes > budget_bytes(g, key[1])


def test_schedule_names_its_space(recorded_graph) -> None:
    g = recorded_graph("gpt")
    r = get_solver("blocks")(g, budget_bytes(g, 0.7))
    assert "block chain" in r.schedule.meta["space"]
    assert r.schedule.meta["composed_peak_bytes"] == r.estimate.peak_bytes


# -- nested (two levels) -------------------------------------------------------------------

def test_nested_equals_brute_force_on_a_chain_of_blocks() -> None:
    g = _stack([32] * 5)
    table = table_of(g, max_span=5, save_top=0, nested=True, fine=True)
    seen = {}
    for spans in _space(table):
        est = simulate(g, build_schedule(g, spans), timeline=False)
        seen[tuple(spans)] = (est.peak_bytes, est.recompute_s)
    peaks = sorted({p for p, _ in seen.values()})
    assert floor_bytes(table) == peaks[0]
    for budget in peaks[:: max(1, len(peaks) // 12)] + [peaks[-1]]:
        best = min(t for p, t in seen.values() if p <= budget)
        r = get_solver("blocks_nested")(g, budget, config=SolverConfig(save_top=0),
                                        max_span=5)
        assert r.fits and r.space_optimal, budget
        assert r.estimate.recompute_s == pytest.approx(best, rel=1e-9, abs=1e-15), budget


def test_nested_floor_is_below_the_one_level_floor() -> None:
    # activations well above the parameters' gradients (which no schedule lowers)
    g = _gpt(8, batch=16, seq=64)
    flat = floor_bytes(table_of(g, fine=True))
    nested = floor_bytes(table_of(g, nested=True, fine=True))
    assert nested < flat
    r = get_solver("blocks_nested")(g, nested)
    assert r.fits and r.schedule.depth == 2


def test_auto_tries_two_levels_before_the_searches_that_the_clock_stops(monkeypatch) -> None:
    """Below the one-level block floor, with the floor's block offer out of reach (its table
    over the offer's share, as on another CPU's profile) and a machine so busy that relax, dp
    and cpsat spend the whole limit (stand-ins that wait it out): auto still answers the
    two-level schedule, which needs no clock (CI once got InfeasibleBudgetError here), and
    past the deadline too where its table is built."""
    import time

    from scheduler.solvers import base
    from scheduler.solvers.deadline import left
    g = _gpt(8, batch=16, seq=64)
    nested = floor_bytes(table_of(g, nested=True, fine=True))
    assert nested < floor_bytes(table_of(g, fine=True))
    offers = {k: v for k, v in base.least_peak_offers().items() if k != "blocks"}
    monkeypatch.setattr(base, "_LEAST_PEAK", offers)

    def busy(name: str) -> Any:
        def solve(graph: CostGraph, budget: int, **_: Any) -> Any:
            time.sleep(max(0.0, left() or 0.0))
            return base.finish(graph, budget, None, solver=name, started=time.perf_counter(),
                               status=INFEASIBLE)
        return solve

    for name in ("relax", "dp", "cpsat", "cpsat_fine"):
        monkeypatch.setitem(base._REGISTRY, name, busy(name))
    r = get_solver("auto")(g, nested, time_limit_s=3.0)
    assert r.fits and r.schedule.depth == 2, r
    # past the deadline at once (as a second solve, with room for the RNG stash, that the
    # first left no time), the two-level table built: its search still runs
    r = get_solver("auto")(g, nested, time_limit_s=1e-3)
    assert r.fits and r.schedule.depth == 2, r


def test_auto_uses_blocks_and_skips_what_would_start_past_the_limit(recorded_graph,
                                                                      monkeypatch) -> None:
    """As on a deep graph (`DEEP_NODES` lowered to 0): with the limit spent by the block DP,
    auto runs `every_block` only besides it, skips the rest and says so."""
    from scheduler.solvers import auto as auto_module
    g = recorded_graph("gpt")
    budget = budget_bytes(g, 0.7)
    get_solver("blocks")(g, budget)  # (its table built, beside the graph)
    monkeypatch.setattr(auto_module, "DEEP_NODES", 0)
    r = get_solver("auto")(g, budget, time_limit_s=1e-3)
    skipped = r.schedule.meta["auto_skipped"]
    assert set(auto_module.BASELINES) - set(skipped) == {"every_block"}
    assert {"relax", "dp"} <= set(skipped)
    assert r.fits and r.solver == "blocks"
