"""``torch.compile(plan.module)``: one graph for the planned training call (``fullgraph=True``),
the unmodified model's gradients, BatchNorm statistics updated once per step, save sets that
reach the compiled graph as MUST_SAVE, fallbacks that compute the model's own outputs, and the
compiled plan's measured peak against its budget and the eager plan's.

References are the unmodified model run eagerly (gradients: ``assert_close``, compiled kernels
round differently) and `scheduler.measure` (the eager peak, counted by another method than the
profiler's events that `measurement.compiled.compiled_peak` reads). Caches are off and dynamo
is reset before each compilation, so every plan is compiled from its own graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

import scheduler
from scheduler.run_watch import EagerRunWarning
from scheduler.cost.compiled_form import compiled_form, flop_saves
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule
from scheduler.measurement.compiled import compiled_peak
from scheduler.quantities import format_bytes


#: dynamo and AOTAutograd (functionalisation, the partitioner) without inductor's code
#: generation, for the checks of what is captured; the peaks need inductor's kernels
AOT = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_compiler() -> Any:
    dynamo.reset()
    with inductor_config.patch(force_disable_caches=True), \
            functorch_config.patch(enable_autograd_cache=False):
        yield
    dynamo.reset()


def gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from examples.gpt import build
    return build(batch=4, block_size=64, n_layer=4, n_head=2, n_embd=64, vocab_size=128,
                 dropout=0.0, seed=0)


@pytest.fixture(scope="module")
def gpt_plan() -> tuple[nn.Module, tuple[torch.Tensor, ...], Any]:
    model, inputs = gpt()
    return model, inputs, scheduler.solve(model, inputs, budget="60%", solver="greedy")


def grads(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, list[Any]]:
    params = list(module.parameters())
    for p in params:
        p.grad = None
    out = module(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    got = loss.detach(), [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return got


def assert_one_graph_with_the_models_gradients(model: nn.Module, inputs: Any, plan: Any) -> None:
    """The plan recomputes something, compiles to one graph without breaks, computes the
    model's loss and gradients compiled, and bit for bit eagerly."""
    assert any(r.recompute for r in plan.schedule.regions)
    ex = dynamo.explain(plan.module)(*inputs)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    dynamo.reset()
    ref = grads(model, *inputs)
    torch.testing.assert_close(grads(torch.compile(plan.module, backend=AOT, fullgraph=True),
                                     *inputs), ref)
    eager = grads(plan.module, *inputs)
    assert torch.equal(eager[0], ref[0]) and all(map(torch.equal, eager[1], ref[1]))


def test_fx_plan_compiles_to_one_graph_with_the_models_gradients(gpt_plan: Any) -> None:
    assert_one_graph_with_the_models_gradients(*gpt_plan)


@pytest.mark.slow  # (a solve and a compile; the fx one-graph test stays fast)
def test_plan_solved_for_compile_runs_in_one_graph_with_the_models_gradients() -> None:
    """A plan solved with ``execution="compiled"`` (replays of what fuses are free, so it
    recomputes more and keeps the matmuls' outputs) is the model under compile as well."""
    model, inputs = gpt()
    plan = scheduler.solve(model, inputs, budget="60%", execution="compiled", time_limit_s=10,
                           measure_compiled=False)
    assert plan.schedule.meta["execution"] == "compiled"
    assert "time model      compiled" in plan.summary()
    assert plan.estimate.peak_bytes <= plan.budget_bytes
    assert_one_graph_with_the_models_gradients(model, inputs, plan)


@pytest.mark.slow  # (compiles a few candidate plans, then the chosen one again)
def test_plan_for_compile_measures_within_its_budget_compiled() -> None:
    """With ``measure_compiled`` (the default), the compiled step of a plan solved for compile
    keeps to the budget: measured again here from a fresh compilation (dynamo reset, caches
    off), it is what the plan reports, within the budget, with the model's gradients. (With
    ``dp``, which has no clock: `auto`'s candidates under a time limit depend on the machine's
    load, and on two busy workers none measured within 3.47 MiB once, the least 3.48 MiB.)"""
    model, inputs = gpt()
    plan = scheduler.solve(model, inputs, budget="65%", execution="compiled", solver="dp")
    assert plan.compiled_peak_bytes is not None
    assert "compiled peak" in plan.summary()
    dynamo.reset()
    compiled = torch.compile(plan.module, fullgraph=True)
    peak = compiled_peak(compiled, inputs)
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.compiled_peak_bytes) <= 0.01 * peak, (peak, plan.compiled_peak_bytes)
    torch.testing.assert_close(grads(compiled, *inputs), grads(model, *inputs))


@pytest.mark.slow  # (compiles the least plan, then again)
def test_a_budget_below_every_eager_prediction_is_met_compiled(tmp_path) -> None:
    """Inductor's step needs less than the eager one: on HF GPT-2 a budget 3% below the least
    peak any schedule is predicted to reach eagerly (the solver's proven floor) has a plan for
    compile, whose step measured again from a fresh compilation keeps to it, with the model's
    gradients."""
    pytest.importorskip("transformers")
    from examples.hf_gpt2 import build_with_labels
    from scheduler.budget import InfeasibleBudgetError

    model, inputs = build_with_labels(batch=2, seq_len=16, n_layer=2, n_head=2, n_embd=32,
                                      vocab_size=64)
    with pytest.raises(InfeasibleBudgetError) as eager:
        scheduler.solve(model, inputs, budget=1, execution="compiled", time_limit_s=10,
                        measure_compiled=False)
    budget = int(0.97 * eager.value.min_feasible_bytes)
    plan = scheduler.solve(model, inputs, budget=budget, execution="compiled", time_limit_s=10)
    assert plan.estimate.peak_bytes > budget  # (eagerly, it would not fit)
    dynamo.reset()
    compiled = torch.compile(plan.module, fullgraph=True)
    peak = compiled_peak(compiled, inputs)
    assert peak <= budget
    assert abs(peak - plan.compiled_peak_bytes) <= 0.01 * peak, (peak, plan.compiled_peak_bytes)
    torch.testing.assert_close(grads(compiled, *inputs), grads(model, *inputs))
    # run eagerly, its step is predicted over the budget: the module says so, once
    with pytest.warns(EagerRunWarning, match="fitted for torch.compile") as caught:
        plan.module(*inputs)
        plan.module(*inputs)
    assert len([w for w in caught if w.category is EagerRunWarning]) == 1
    # and so does the module `apply` builds from its saved schedule, which records the budget
    # it was measured against (it was solved at a higher target)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Schedule.load(path).budget_bytes == budget
    with pytest.warns(EagerRunWarning, match=format_bytes(budget)):
        scheduler.apply(model, path, inputs)(*inputs)


def test_fallbacks_under_compile_compute_the_models_outputs(gpt_plan: Any) -> None:
    model, inputs, plan = gpt_plan
    compiled = torch.compile(plan.module, backend=AOT)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    try:
        plan.module.eval()  # (shares its submodules with the model: both are in eval)
        with torch.no_grad():
            ref = model(*inputs)
        torch.testing.assert_close(compiled(*inputs), ref)
    finally:
        plan.module.train()
    # keywords that bind to the planned inputs still run the plan, in one graph
    dynamo.reset()
    ex = dynamo.explain(plan.module)(idx=inputs[0], targets=inputs[1])
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons


#: ``(budget, solver)`` -> why its compiled peak exceeds the budget (None: it is within it)
OVER_BUDGET_COMPILED = {
    ("60%", "greedy"): None,
    ("85%", "greedy"): None,
    ("55%", "greedy"): "greedy's 55% schedule is its 60% one (predicted 2.80 MiB against a "
                       "2.94 MiB budget); compiled it peaks at 3.10 MiB",
    ("55%", "relax"): "relax fills the budget (predicted 2.89 of 2.94 MiB); compiled it peaks "
                      "1.3% over",
}
COMPILED_CAUSE = ("inductor's compiled step allocates other buffers than the eager ops the "
                  "plan was profiled and solved with (its own forward/backward partition of "
                  "the kept values, fused kernels' outputs, backward buffers): its peak is "
                  "1.5-11% above the eager plan's, which the solver does not model")


def compiled_case(budget: str, solver: str) -> Any:
    why = OVER_BUDGET_COMPILED[(budget, solver)]
    marks = [pytest.mark.xfail(strict=True, reason=f"{why}: {COMPILED_CAUSE}")] if why else []
    marks.append(pytest.mark.slow)  # (each compiles a planned step: minutes on two cores)
    return pytest.param(budget, solver, marks=marks, id=f"{solver}-{budget}")


@pytest.mark.parametrize("budget,solver", [compiled_case(*k) for k in OVER_BUDGET_COMPILED])
def test_compiled_peak_against_budget(budget: str, solver: str) -> None:
    """The eager plan is within its budget (profiler events and `scheduler.measure` agree on
    it, within 1%); the compiled plan's peak is above the eager plan's, within the budget
    where the eager plan leaves room for the difference, and over it (xfail, the cause named)
    where it does not."""
    model, inputs = gpt()
    plan = scheduler.solve(model, inputs, budget=budget, solver=solver, time_limit_s=30)
    budget_bytes = plan.schedule.budget_bytes
    eager = compiled_peak(plan.module, inputs)
    measured = scheduler.measure(plan.module, inputs, repeats=1).peak_bytes
    assert abs(eager - measured) <= 0.01 * measured, (eager, measured)
    assert eager <= budget_bytes
    peak = compiled_peak(torch.compile(plan.module, fullgraph=True), inputs)
    assert peak > eager
    assert peak <= budget_bytes, (f"compiled peak {peak} B > budget {budget_bytes} B "
                                  f"(eager plan {eager} B)")


@pytest.mark.slow  # (compiles twice; tests/test_nested covers save sets eagerly)
def test_save_set_reaches_the_compiled_graph(gpt_plan: Any) -> None:
    """A save set (every c_fc/c_attn Linear in the recompute regions) is what the compiled
    graph's partitioner sees as MUST_SAVE; without one nothing is."""
    model, inputs, plan = gpt_plan
    graph = scheduler.profile(model, inputs, repeats=1, units=None)
    spans, at = [], 0
    for r in plan.schedule.regions:
        save = [n for n in r.nodes if r.recompute and ("c_fc" in n or "c_attn" in n)]
        spans.append((at, at + len(r.nodes), r.policy, save))
        at += len(r.nodes)
    saving = Schedule.from_regions(graph, spans)
    n_saved = sum(len(r.save) for r in saving.regions)
    assert n_saved >= 6  # (3 recompute regions, a block or more each)
    ref = grads(model, *inputs)
    tags: dict[str, list[Any]] = {}
    for name, schedule in [("plain", plan.schedule), ("saving", saving)]:
        seen: list[Any] = []

        def partition(joint: Any, joint_inputs: Any, **kw: Any) -> Any:
            seen.extend(n.meta.get("recompute") for n in joint.graph.nodes)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kw)

        backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
        dynamo.reset()
        module = scheduler.apply(model, schedule, inputs)
        torch.testing.assert_close(grads(torch.compile(module, backend=backend,
                                                       fullgraph=True), *inputs), ref)
        tags[name] = seen
    assert CheckpointPolicy.MUST_SAVE not in tags["plain"]
    assert CheckpointPolicy.PREFER_RECOMPUTE in tags["plain"]
    # each saved Linear's matmul at least (its views are recomputed)
    assert tags["saving"].count(CheckpointPolicy.MUST_SAVE) >= n_saved


def partitioned(module: nn.Module, inputs: Any) -> tuple[dict[str, int], Any]:
    """``module`` compiled with AOTAutograd and inductor's partitioner (no inductor code):
    the bytes its forward saves for backward, the ops with FLOPs its backward runs, and its
    loss and gradients."""
    seen: dict[str, int] = {}

    def forward(gm: fx.GraphModule, _: Any) -> Any:
        outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        vals = [a.meta["val"] for a in outs if isinstance(a, fx.Node)
                and isinstance(a.meta.get("val"), torch.Tensor)]
        seen["saved_bytes"] = sum(hint(v.numel()) * v.element_size() for v in vals)
        return make_boxed_func(gm)

    def backward(gm: fx.GraphModule, _: Any) -> Any:
        seen["flop_ops"] = sum(getattr(n.target, "overloadpacket", None) in flop_registry
                               for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    dynamo.reset()
    backend = aot_autograd(fw_compiler=forward, bw_compiler=backward,
                           partition_fn=min_cut_rematerialization_partition)
    return seen, grads(torch.compile(module, backend=backend, fullgraph=True), *inputs)


def hint(n: Any) -> int:
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)


def test_a_compiled_form_saves_less_and_replays_no_matmul(gpt_plan: Any) -> None:
    """The compiled form of "no checkpointing" (`cost.compiled_form`: per block one region
    saving its matmuls' and attention's outputs) compiles to a backward with as many ops
    with FLOPs as the unmodified model's (nothing with FLOPs replayed) that saves fewer bytes
    than the model and than the same regions saving every op of their save-set nodes, with
    the model's gradients."""
    model, inputs, plan = gpt_plan
    form = compiled_form(plan.graph, Schedule.none(plan.graph), check_budget=False)
    assert len(flop_saves(form)) >= 4 * 4  # (per block: attention's and 3 Linears at least)
    every_op = dataclasses.replace(form, meta={})
    ref, ref_grads = partitioned(model, inputs)
    got = {}
    for name, schedule in [("form", form), ("every op", every_op)]:
        got[name], g = partitioned(scheduler.apply(model, schedule, inputs), inputs)
        torch.testing.assert_close(g, ref_grads)
    assert got["form"]["flop_ops"] == got["every op"]["flop_ops"] == ref["flop_ops"]
    assert got["form"]["saved_bytes"] < got["every op"]["saved_bytes"] < ref["saved_bytes"]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1)).square().mean()


@pytest.mark.parametrize("save", [False, True])
def test_batchnorm_statistics_update_once_per_step_compiled(save: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    ref, model = ConvNet().train(), ConvNet().train()
    model.load_state_dict(ref.state_dict())
    graph = scheduler.profile(model, (x,), repeats=1, units=None)
    n = len(graph.compute_nodes)
    saved = [graph.compute_nodes[0], graph.compute_nodes[3]] if save else []  # the convs
    schedule = Schedule.from_regions(graph, [(0, 6, RECOMPUTE, saved), (6, n, KEEP)])
    compiled = torch.compile(scheduler.apply(model, schedule, (x,)), backend=AOT,
                             fullgraph=True)
    for _ in range(3):
        g_ref = grads(ref, x)
        g = grads(compiled, x)
    torch.testing.assert_close(g, g_ref)
    for (name, b), b_ref in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, b_ref, msg=name)
    assert [int(m.num_batches_tracked) for m in model.modules()
            if isinstance(m, nn.BatchNorm2d)] == [3, 3]


@pytest.mark.slow  # (a minute of compiling; the fx path's one-graph test stays fast)
@pytest.mark.parametrize("units", [None, "default"])
def test_export_path_compiles_to_one_graph(units: Any) -> None:
    """A Hugging Face Llama from a config, planned and called with a keyword batch, traced
    by torch.export (units=None: the whole step; by default: its layers inside its own
    forward, from a stock config that asks for a cache): one graph under fullgraph=True,
    the model's gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=units is not None)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    plan = scheduler.solve(model, batch, budget="80%", solver="greedy", units=units)
    if units is None:
        assert scheduler.planned(plan.module).info.tracer == "export"
    else:
        assert scheduler.units.units_plan(plan.module).forwards
    assert any(r.recompute for r in plan.schedule.regions)
    ex = dynamo.explain(plan.module)(**batch)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    dynamo.reset()
    ref = grads(model, **batch)
    torch.testing.assert_close(grads(torch.compile(plan.module, backend=AOT, fullgraph=True),
                                     **batch), ref)


def test_units_plan_compiles_to_one_graph_with_the_models_gradients() -> None:
    """A units plan (the model's own forward, its blocks planned) traced its units when solved
    (the step ran for real), so torch.compile captures the step in one graph, fullgraph,
    with the model's loss and gradients."""
    model, inputs = gpt()
    plan = scheduler.solve(model, inputs, budget="60%", solver="greedy", units="auto")
    assert plan.units.paths and scheduler.units.units_plan(plan.module).traces > 0
    assert scheduler.units.units_plan(plan.module).planned_calls == 0
    assert_one_graph_with_the_models_gradients(model, inputs, plan)
