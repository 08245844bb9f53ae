"""torchtitan's recipe on gloo ranks (CPU): solve with ``parallel="fsdp2"`` (for eager execution,
and for compiled execution in torchtitan's way), ``torch.compile``
each unit of ``plan.module`` (``fullgraph=True``; torchtitan's way, the compiled module
registered in place of the unit, and ``unit.compile()``), then ``fully_shard`` each unit and
the root, and train.

The reference is the unplanned model wrapped the same way (its units compiled alike, then
sharded). Bit-equality is not promised under inductor, so each case's tolerance is what
compiling does to the unplanned model: its largest loss and gradient difference from the same
model run eagerly (FSDP2, uncompiled), and at least a few float32 rounding steps of the
values compared (a fused kernel may sum in another order: where compiling happens to change
nothing on this CPU it may on another). The plan may not move the compiled step further from
the compiled reference than that.

The plan runs planned: compiled calls are counted (a tensor each unit's graph adds to), and
each unit is compiled with its own recording backend: the graph of every unit that recomputes
in the solved batch's run holds checkpoint regions (``tag_activation_checkpoint``, which only
the plan's regions make) while no other unit's does (a unit may recompute only in a call
variant, the padded batch: `scheduler.units.variants`); one more step
with ``torch.compiler.set_stance("force_eager")`` counts its planned and fallback calls. After
the first (compiling) step nothing compiles again (``error_on_recompile``). Each rank's peak,
compiled and eager, is measured by c10's allocator (`_ranks.allocator_peak`): the compiled
plan's is below the compiled unplanned model's; none is held to the budget (the eager step's
is recorded: the allocator's count also sees gloo's worker-thread scratch, at times 50 KB
above the prediction in these runs).
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
from _ranks import allocator_peak, full_grads, spawn, wrap
from torch._inductor.compile_fx import compile_fx

import scheduler

transformers = pytest.importorskip("transformers")

MODELS = ("gpt", "llama")
#: ``unit.compile()``; torchtitan's ``torch.compile(unit)`` registered in the unit's place
WAYS = ("method", "replace")
#: (model, way, the plan's ``execution``): every way for eager plans, and torchtitan's for a
#: plan solved for compiled execution (its compiled form, `cost.compiled_form`: from a
#: per-rank profile, taken in a block only where the eager prediction keeps to the budget)
CASES = [*((name, way, "eager") for name in MODELS for way in WAYS),
         *((name, "replace", "compiled") for name in MODELS)]
STEPS = 3  # (the first compiles; the others may not)


def _build(name: str, rank: int) -> tuple[torch.nn.Module, Any, Any]:
    """The model (same weights on every rank), this rank's batch, and its training call."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(10 + rank)
    if name == "gpt":
        from examples import gpt
        model, _ = gpt.build(batch=4, block_size=32, n_layer=2, n_head=2, n_embd=32,
                             vocab_size=64, dropout=0.0)
        idx, tgt = (torch.randint(0, 64, (4, 32), generator=g) for _ in range(2))
        return model, (idx, tgt), lambda m: m(idx, tgt)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 32), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    return model, batch, lambda m: m(**batch).loss


def _recording(checkpoints: list[int]) -> Any:
    """Inductor, recording how many checkpoint regions each graph it compiles holds."""
    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        checkpoints.append(sum(n.op == "call_function" and "tag_activation_checkpoint"
                               in str(n.target) for n in gm.graph.nodes))
        return compile_fx(gm, example_inputs)
    return backend


def _compile_units(module: torch.nn.Module, paths: tuple[str, ...], way: str
                   ) -> dict[str, list[int]]:
    graphs: dict[str, list[int]] = {}
    for path in paths:
        unit = module.get_submodule(path)
        backend = _recording(graphs.setdefault(path, []))
        if way == "method":
            unit.compile(backend=backend, fullgraph=True)
        else:
            parent, _, name = path.rpartition(".")
            module.get_submodule(parent).register_module(
                name, torch.compile(unit, backend=backend, fullgraph=True))
    return graphs


def _train(module: torch.nn.Module, paths: tuple[str, ...], call: Any, inputs: Any,
           way: str) -> dict[str, Any]:
    """Compile ``module``'s units (``way``; "eager": not), ``fully_shard`` each, then the
    root, and train `STEPS` SGD steps; then measure one step's peak."""
    graphs = _compile_units(module, paths, way) if way != "eager" else {}
    wrap(module, "fsdp2", paths)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    steps, compiled = [], []
    for step in range(STEPS):
        with dynamo.config.patch(error_on_recompile=step > 0):
            compiled.append(sum(map(len, graphs.values())))
            loss = call(module)
            loss.backward()
        # (named as the model names them: torchtitan's way adds torch.compile's `_orig_mod`)
        steps.append((loss.detach().clone(), {k.replace("._orig_mod", ""): g
                                              for k, g in full_grads(module).items()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    with dynamo.config.patch(error_on_recompile=True):
        peak = allocator_peak(module, call, inputs)
    return {"steps": steps, "graphs": graphs, "peak": peak,
            "compiled": [*compiled[1:], sum(map(len, graphs.values()))], "module": module}


def _diff(a: list[Any], b: list[Any]) -> tuple[float, float]:
    """The largest loss difference and gradient difference over the steps."""
    loss = max((la - lb).abs().item() for (la, _), (lb, _) in zip(a, b))
    grad = max((ga[k] - gb[k]).abs().max().item() for (_, ga), (_, gb) in zip(a, b)
               for k in gb)
    return loss, grad


def _rounding(steps: list[Any]) -> tuple[float, float]:
    """Eight float32 rounding steps of the largest loss and gradient entry over the steps."""
    eps = 8 * torch.finfo(torch.float32).eps
    return (eps * max(loss.abs().item() for loss, _ in steps),
            eps * max(g.abs().max().item() for _, grads in steps for g in grads.values()))


def _worker(rank: int, world: int) -> dict[str, Any]:
    rec: dict[Any, Any] = {}
    for name in MODELS:
        model, inputs, call = _build(name, rank)
        paths = scheduler.units.find_units(model, "auto").paths
        eager = _train(model, paths, call, inputs, "eager")["steps"]
        del model
        refs: dict[str, dict[str, Any]] = {}
        for _, way, execution in [c for c in CASES if c[0] == name]:
            if way not in refs:
                dynamo.reset()
                model, inputs, call = _build(name, rank)
                refs[way] = _train(model, paths, call, inputs, way)
                del model, refs[way]["module"]
            ref = refs[way]
            model, inputs, call = _build(name, rank)
            with warnings.catch_warnings():  # (for compiled execution: not measured compiled)
                warnings.simplefilter("ignore", scheduler.compiled_fit.CompiledPeakWarning)
                plan = scheduler.solve(model, inputs, budget="80%", repeats=1, time_limit_s=10,
                                       parallel="fsdp2", execution=execution)
            form = plan.schedule.meta.get("compiled_form")
            units = scheduler.units.units_plan(plan.module)
            case = {"predicted": plan.estimate.peak_bytes, "budget": plan.budget_bytes,
                    "paths": plan.units.paths, "planned_units": set(units.forwards),
                    # (a unit may recompute only in a call variant, the padded batch)
                    "recomputing_units": {p for p, f in units.forwards.items()
                                          if f.run.recomputes},
                    "form": form}
            module = plan.module
            del model, plan
            gc.collect()
            dynamo.reset()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = _train(module, case["paths"], call, inputs, way)
                case["compiled_counts"] = (units.planned_calls, units.fallback_calls)
                with torch.compiler.set_stance("force_eager"):
                    case["eager_peak"] = allocator_peak(module, call, inputs)  # (recorded)
            case["eager_counts"] = (units.planned_calls, units.fallback_calls)
            case["warnings"] = [str(w.message) for w in seen
                                if issubclass(w.category, RuntimeWarning)]
            case.update(peak=got["peak"], ref_peak=ref["peak"], graphs=got["graphs"],
                        ref_graphs=ref["graphs"], compiled=got["compiled"],
                        ref_compiled=ref["compiled"],
                        # what compiling does to the unplanned model; what the plan does
                        compile_diff=_diff(ref["steps"], eager),
                        rounding=_rounding(ref["steps"]),
                        plan_diff=_diff(got["steps"], ref["steps"]),
                        same_keys=all(set(a) == set(b) for (_, a), (_, b)
                                      in zip(got["steps"], ref["steps"])))
            rec[(name, way, execution)] = case
            del module, got
            gc.collect()
    return rec


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_worker, 2, tmp_path_factory.mktemp("compile"))


pytestmark = pytest.mark.slow  # (two ranks compile 12 units' steps: minutes on two cores)


@pytest.mark.parametrize("name,way,execution", CASES)
def test_compiled_units_run_the_plan_without_recompiling(
        ranks: list[dict[str, Any]], name: str, way: str, execution: str) -> None:
    for rec in ranks:
        case = rec[(name, way, execution)]
        planned = case["planned_units"]
        assert case["recomputing_units"], case  # (the plan recomputes somewhere)
        # each unit recomputing in the solved batch's run holds its checkpoint regions in
        # its graph; nothing else does
        assert {p for p, g in case["graphs"].items() if any(g)} == \
            case["recomputing_units"], case
        assert not any(map(any, case["ref_graphs"].values())), case
        # no unit compiles more than once, and nothing after the first step
        for key in ("graphs", "ref_graphs"):
            assert all(len(g) <= 1 for g in case[key].values()), case
        for key in ("compiled", "ref_compiled"):
            assert len(set(case[key])) == 1, case
        # compiled calls are counted too (a tensor the unit's graph adds to): every compiled
        # step ran every planned unit planned; one eager step adds each planned unit once
        n, fell = case["compiled_counts"]
        assert fell == 0 and n >= STEPS * len(planned) and n % len(planned) == 0, case
        assert case["eager_counts"] == (n + len(planned), 0), case
        assert case["warnings"] == [], case  # (no fallback, wrapped as solved for)


@pytest.mark.parametrize("name,way,execution", CASES)
def test_compiled_plan_trains_as_the_compiled_unplanned_model(
        ranks: list[dict[str, Any]], name: str, way: str, execution: str) -> None:
    for rec in ranks:
        case = rec[(name, way, execution)]
        assert case["same_keys"], case
        loss_tol, grad_tol = map(max, case["compile_diff"], case["rounding"])
        loss, grad = case["plan_diff"]
        assert loss <= loss_tol and grad <= grad_tol, case


@pytest.mark.parametrize("name,way,execution", CASES)
def test_compiled_plan_peaks_below_the_compiled_unplanned_model(
        ranks: list[dict[str, Any]], name: str, way: str, execution: str) -> None:
    """The plan's saving survives compiling: the compiled plan's step peaks below the compiled
    unplanned model's, by the allocator's count. Its peak is not bounded by the budget here:
    the solver models the eager ops, not inductor's buffers (docs/distributed.md has the
    measured numbers)."""
    for rec in ranks:
        case = rec[(name, way, execution)]
        assert case["peak"] < case["ref_peak"], case


@pytest.mark.parametrize("name", MODELS)
def test_a_plan_for_compiled_execution_runs_in_its_compiled_form(
        ranks: list[dict[str, Any]], name: str) -> None:
    """The plan solved with ``execution="compiled"`` (its eager prediction within the budget at
    80%) takes its compiled form in some block: the cases above then check that form compiled
    under FSDP2 (the model's gradients, one graph a unit, a lower peak)."""
    for rec in ranks:
        form = rec[(name, "replace", "compiled")]["form"]
        assert form and form["blocks"], form
