"""Acceptance tests for `scheduler.rewrite`: a checkpointed module is a drop-in for the model.

For every example (MLP, GPT with dropout, Hugging Face GPT-2, U-Net with BatchNorm) and the
schedules ``none``, every block recomputed, equal segments and random valid schedules (with
random save sets), one training step of the rewritten module gives the unscheduled model's
loss and gradients bit for bit (CPU), updates BatchNorm statistics once, and shares the
model's parameters and ``state_dict`` keys; an optimizer built on the original's parameters
trains it exactly as it trains the original.

The reference is always a second model built with the same seed (the rewritten module shares
its model's parameters, so it cannot be its own reference); every step runs after
``torch.manual_seed(0)``, so dropout draws the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import scheduler
from scheduler.capture.trace import default_loss_recipe, trace
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, RECOMPUTE, Region, Schedule, ScheduleError
from scheduler.rewrite import rewrite

MODELS = ["mlp", "gpt", "unet", "hf_gpt2"]
#: random-schedule tests: Hugging Face GPT-2 is the slowest to step, so it runs with the slow ones
RANDOM_MODELS = ["mlp", "gpt", "unet", pytest.param("hf_gpt2", marks=pytest.mark.slow)]


# ------------------------------------------------------------------------------- schedules


def every_block(g: CostGraph, *, save: Callable[[list[str]], list[str]] | None = None
                ) -> Schedule:
    """One recompute region per distinct `Node.block` (nodes outside blocks are kept);
    ``save(region_nodes)`` picks each region's save set."""
    names = g.compute_nodes
    blocks = [g.node(n).block for n in names]
    spans, i = [], 0
    while i < len(names):
        j = i
        while j < len(names) and blocks[j] == blocks[i]:
            j += 1
        if blocks[i]:
            spans.append((i, j, RECOMPUTE, save(names[i:j]) if save else ()))
        else:
            spans.append((i, j, KEEP))
        i = j
    recomputed = [blocks[a] for a, _, p, *_ in spans if p == RECOMPUTE]
    assert len(recomputed) == len(set(recomputed)), f"blocks are not contiguous: {recomputed}"
    return Schedule.from_regions(g, spans, solver="every_block")


def segments(g: CostGraph, k: int, *, save: Callable[[list[str]], list[str]] | None = None
             ) -> Schedule:
    """``k`` contiguous recompute regions of about equal node count."""
    names = g.compute_nodes
    n = len(names)
    k = min(k, n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    spans = [(a, b, RECOMPUTE, save(names[a:b]) if save else ())
             for a, b in zip(bounds, bounds[1:])]
    return Schedule.from_regions(g, spans, solver=f"uniform:{k}")


def saveable(g: CostGraph, names: list[str]) -> list[str]:
    """The nodes a save set may hold (those that allocate their output)."""
    return [n for n in names if g.allocates(n)]


NAMED_SCHEDULES: dict[str, Callable[[CostGraph], Schedule]] = {
    "none": Schedule.none,
    "every_block": every_block,
    "segments_1": lambda g: segments(g, 1),
    "segments_2": lambda g: segments(g, 2),
    "segments_4": lambda g: segments(g, 4),
    # a region per node: every value crosses a region boundary (ints, tuples, views)
    "every_node": lambda g: segments(g, len(g.compute_nodes)),
    # selective checkpointing: cache every other allocating node / all of them
    "every_block_half_saved": lambda g: every_block(g, save=lambda ns: saveable(g, ns)[::2]),
    "every_block_all_saved": lambda g: every_block(g, save=lambda ns: saveable(g, ns)),
    "segments_2_third_saved": lambda g: segments(g, 2, save=lambda ns: saveable(g, ns)[1::3]),
}


@st.composite
def random_schedules(draw: st.DrawFn, g: CostGraph) -> Schedule:
    """Any valid schedule over ``g``: up to 8 cuts, random policies, random save sets."""
    names = g.compute_nodes
    n = len(names)
    cuts = draw(st.lists(st.integers(1, n - 1), unique=True, max_size=min(8, n - 1)).map(sorted))
    spans = []
    for a, b in zip([0, *cuts], [*cuts, n]):
        policy = draw(st.sampled_from([KEEP, RECOMPUTE]))
        pool = saveable(g, names[a:b])
        save = (draw(st.lists(st.sampled_from(pool), unique=True))
                if policy == RECOMPUTE and pool else [])
        spans.append((a, b, policy, save))
    return Schedule.from_regions(g, spans, solver="random")


# ---------------------------------------------------------------------- models and steps


@dataclass
class Step:
    """What one training step left: the loss, each parameter's gradient and each buffer."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def run_step(module: nn.Module, inputs: tuple[Any, ...],
             loss_fn: Callable[[Any], torch.Tensor] | None = None, *, seed: int = 0) -> Step:
    """One step from ``.grad = None``, after ``torch.manual_seed(seed)``; grads are reset
    to None afterwards."""
    params = dict(module.named_parameters())
    for p in params.values():
        p.grad = None
    torch.manual_seed(seed)
    out = module(*inputs)
    loss = (loss_fn or default_loss_recipe(out))(out)
    loss.backward()
    step = Step(loss.detach(), {n: p.grad for n, p in params.items()},
                {n: b.detach().clone() for n, b in module.named_buffers()})
    for p in params.values():
        p.grad = None
    return step


@dataclass
class Case:
    """One example, profiled once: ``model`` is rewritten by the tests (its buffers are reset
    before each step); ``ref`` is the unscheduled step of an identical fresh model."""

    name: str
    model: nn.Module
    inputs: tuple[Any, ...]
    graph: CostGraph
    gm: torch.fx.GraphModule
    ref: Step
    initial_buffers: list[torch.Tensor] = field(default_factory=list)

    def reset(self) -> None:
        with torch.no_grad():
            for b, v in zip(self.model.buffers(), self.initial_buffers):
                b.copy_(v)
        for p in self.model.parameters():
            p.grad = None

    def rewrite(self, schedule: Schedule) -> nn.Module:
        return rewrite(self.gm, schedule, self.model)

    def check_step(self, schedule: Schedule) -> None:
        """The rewritten module's step equals the reference step exactly."""
        self.reset()
        module = self.rewrite(schedule)
        got = run_step(module, self.inputs, module.forward.loss_fn)
        where = f"{self.name}, schedule:\n{schedule.describe()}\nsave sets: " \
                f"{[sorted(r.save) for r in schedule.regions]}"
        assert torch.equal(got.loss, self.ref.loss), \
            f"loss {got.loss.item()!r} != {self.ref.loss.item()!r}; {where}"
        assert list(got.grads) == list(self.ref.grads)
        missing = [n for n, g in got.grads.items() if g is None]
        assert not missing, f"no gradient for {missing}; {where}"
        differ = [n for n, g in got.grads.items() if not torch.equal(g, self.ref.grads[n])]
        assert not differ, (f"{len(differ)}/{len(got.grads)} gradients differ, first "
                            f"{differ[:3]} (max abs diff "
                            f"{(got.grads[differ[0]] - self.ref.grads[differ[0]]).abs().max()})"
                            f"; {where}")
        assert list(got.buffers) == list(self.ref.buffers)
        differ = [n for n, b in got.buffers.items() if not torch.equal(b, self.ref.buffers[n])]
        assert not differ, f"buffers differ after one step: {differ[:4]}; {where}"


class _Cases:
    """Builds and profiles each example once per module, on first use."""

    def __init__(self, build: Callable[..., tuple[nn.Module, tuple[Any, ...]]]) -> None:
        self.build = build
        self.cases: dict[str, Case] = {}

    def __call__(self, name: str) -> Case:
        if name not in self.cases:
            ref_model, ref_inputs = self.build(name)
            ref = run_step(ref_model, ref_inputs)
            model, inputs = self.build(name)
            initial = [b.detach().clone() for b in model.buffers()]
            graph = scheduler.profile(model, inputs, repeats=1, units=None)
            self.cases[name] = Case(name, model, inputs, graph, trace(model, inputs), ref,
                                    initial)
        return self.cases[name]


@pytest.fixture(scope="module")
def cases(build_example: Callable[..., Any]) -> _Cases:
    return _Cases(build_example)


# ---------------------------------------------------------------------------- same maths


@pytest.mark.parametrize("schedule", list(NAMED_SCHEDULES))
@pytest.mark.parametrize("name", MODELS)
def test_same_loss_grads_and_buffers(cases: _Cases, name: str, schedule: str) -> None:
    case = cases(name)
    case.check_step(NAMED_SCHEDULES[schedule](case.graph))


@pytest.mark.parametrize("name", RANDOM_MODELS)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_random_schedules_same_maths(cases: _Cases, name: str, data: st.DataObject) -> None:
    case = cases(name)
    case.check_step(data.draw(random_schedules(case.graph), label="schedule"))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_schedules_same_maths_more(cases: _Cases, name: str,
                                         data: st.DataObject) -> None:
    case = cases(name)
    case.check_step(data.draw(random_schedules(case.graph), label="schedule"))


@pytest.mark.parametrize("saved", ["model_transformer_drop", "scaled_dot_product_attention",
                                   "model_transformer_h_0_attn_resid_dropout"])
def test_cached_random_op_leaves_later_dropout_masks_alone(cases: _Cases, saved: str) -> None:
    """A save-set node that draws random numbers (dropout, attention dropout) is not run by
    the replay; the random ops after it in the region must still draw forward's masks."""
    case = cases("gpt")
    n = len(case.graph.compute_nodes)
    assert saved in case.graph.compute_nodes and case.graph.allocates(saved)
    case.check_step(Schedule.from_regions(case.graph, [(0, n, RECOMPUTE, [saved])]))
    mid = case.graph.compute_nodes.index(saved)
    case.check_step(Schedule.from_regions(case.graph, [(0, mid, KEEP),
                                                       (mid, n, RECOMPUTE, [saved])]))


def test_reference_is_not_vacuous(cases: _Cases, build_example: Callable[..., Any]) -> None:
    """Dropout is live in the GPT example (another seed, another loss), and one step moves
    the U-Net's BatchNorm statistics: otherwise the checks above would prove little."""
    gpt = cases("gpt")
    model, inputs = build_example("gpt")
    assert not torch.equal(run_step(model, inputs, seed=1).loss, gpt.ref.loss)
    unet = cases("unet")
    for n, b in unet.ref.buffers.items():
        if n.endswith("num_batches_tracked"):
            assert int(b) == 1, n
        elif n.endswith("running_mean"):
            assert b.abs().sum() > 0, n


@pytest.mark.parametrize("name", MODELS)
def test_schedules_really_recompute(cases: _Cases, name: str) -> None:
    """Recompute regions replay forward ops in backward and save sets spare some of them:
    the equality tests above are not passing because the schedule was ignored."""
    case = cases(name)
    count = {key: _backward_ops(case, make(case.graph)) for key, make in [
        ("none", Schedule.none), ("every_block", every_block),
        ("all_saved", NAMED_SCHEDULES["every_block_all_saved"])]}
    assert count["every_block"] > count["none"], count
    assert count["all_saved"] < count["every_block"], count


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.n += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(case: Case, schedule: Schedule) -> int:
    """ATen ops run during backward (gradients and any replay)."""
    case.reset()
    module = case.rewrite(schedule)
    torch.manual_seed(0)
    loss = module.forward.loss_fn(module(*case.inputs))
    with _CountOps() as counter:
        loss.backward()
    case.reset()
    return counter.n


@pytest.mark.parametrize("name", MODELS)
def test_outputs_equal_the_models(cases: _Cases, build_example: Callable[..., Any],
                                  name: str) -> None:
    """The rewritten module returns the model's output, in the model's structure (a Hugging
    Face ``ModelOutput`` stays one), with and without grad."""
    case = cases(name)
    module = case.rewrite(every_block(case.graph))
    for grad in (True, False):
        ref_model, _ = build_example(name)
        case.reset()
        with torch.set_grad_enabled(grad):
            torch.manual_seed(0)
            want = ref_model(*case.inputs)
            torch.manual_seed(0)
            got = module(*case.inputs)
        assert type(got) is type(want)
        got_leaves, got_spec = pytree.tree_flatten(got)
        want_leaves, want_spec = pytree.tree_flatten(want)
        assert got_spec == want_spec
        for a, b in zip(got_leaves, want_leaves):
            assert torch.equal(a, b)
        buffers = dict(case.model.named_buffers())
        for n, b in ref_model.named_buffers():  # no-grad forward updates BatchNorm once, too
            assert torch.equal(buffers[n], b), n
    case.reset()


# ------------------------------------------------------------------------------ BatchNorm


@pytest.mark.parametrize("schedule", ["every_block", "segments_1", "segments_4", "every_node",
                                      "every_block_half_saved"])
def test_batchnorm_statistics_updated_once(cases: _Cases, schedule: str) -> None:
    case = cases("unet")
    bns = [m for m in case.model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns
    case.reset()
    module = case.rewrite(NAMED_SCHEDULES[schedule](case.graph))
    run_step(module, case.inputs, module.forward.loss_fn)
    ref = case.ref.buffers
    for n, m in case.model.named_modules():
        if isinstance(m, nn.BatchNorm2d):
            assert int(m.num_batches_tracked) == 1, f"{n} ran {int(m.num_batches_tracked)} times"
            assert torch.equal(m.running_mean, ref[f"{n}.running_mean"]), n
            assert torch.equal(m.running_var, ref[f"{n}.running_var"]), n
    case.reset()


# ------------------------------------------------------------------------------- drop-in


@pytest.mark.parametrize("name", MODELS)
def test_drop_in_state_dict_and_parameters(cases: _Cases, name: str) -> None:
    case = cases(name)
    model = case.model
    module = case.rewrite(every_block(case.graph, save=lambda ns: saveable(case.graph, ns)[:1]))
    assert list(module.state_dict()) == list(model.state_dict())
    for (k, a), b in zip(module.state_dict().items(), model.state_dict().values()):
        assert a.data_ptr() == b.data_ptr(), k  # the same tensors, not copies
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(module.parameters(), model.parameters()))
    assert len(list(module.parameters())) == len(list(model.parameters()))
    assert [n for n, _ in module.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert all(a is b for a, b in zip(module.buffers(), model.buffers()))
    # state dicts load both ways
    module.load_state_dict(model.state_dict())
    model.load_state_dict(module.state_dict())
    assert module.forward.loss_fn is case.gm.meta["scheduler"].loss_fn


def test_drop_in_with_own_parameters_and_buffers() -> None:
    """A model with parameters and buffers of its own (not in a child) keeps the order of
    state_dict keys and the non-persistent buffer stays out of it."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.register_buffer("shift", torch.full((8,), 0.5))
            self.register_buffer("scratch", torch.zeros(8), persistent=False)
            self.fc1 = nn.Linear(8, 16)
            self.bn = nn.BatchNorm1d(16)
            self.fc2 = nn.Linear(16, 8)
            self.gain = nn.Parameter(torch.full((8,), 2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn(self.fc1(x * self.scale + self.shift + self.scratch)))
            return self.fc2(h) * self.gain

    def build() -> tuple[nn.Module, tuple[torch.Tensor]]:
        torch.manual_seed(0)
        return Net().train(), (torch.randn(6, 8),)

    ref_model, inputs = build()
    ref = run_step(ref_model, inputs)
    model, _ = build()
    g = scheduler.profile(model, inputs, repeats=1, units=None)
    n = len(g.compute_nodes)
    module = rewrite(trace(model, inputs),
                     Schedule.from_regions(g, [(0, n // 2, RECOMPUTE), (n // 2, n, RECOMPUTE)]),
                     model)
    assert list(module.state_dict()) == list(model.state_dict())
    assert "scratch" not in module.state_dict()
    assert [n for n, _ in module.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert all(a is b for a, b in zip(module.parameters(), model.parameters()))
    got = run_step(module, inputs, module.forward.loss_fn)
    assert torch.equal(got.loss, ref.loss)
    assert all(torch.equal(got.grads[k], ref.grads[k]) for k in ref.grads)
    assert all(torch.equal(got.buffers[k], ref.buffers[k]) for k in ref.buffers)


#: every example with every block recomputed; GPT (dropout) with save sets, too
OPTIMIZER_CASES = [*((name, "every_block") for name in MODELS), ("gpt", "segments_2_third_saved"),
                   pytest.param("unet", "segments_2_third_saved", marks=pytest.mark.slow),
                   pytest.param("hf_gpt2", "segments_2_third_saved", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("name", "schedule"), OPTIMIZER_CASES)
def test_optimizer_on_original_parameters_trains_the_rewritten_module(
        cases: _Cases, build_example: Callable[..., Any], name: str, schedule: str) -> None:
    """AdamW over ``model.parameters()`` (the original's) trains the rewritten module for 3
    steps with the losses, parameters and buffers of training an identical fresh original."""
    graph = cases(name).graph  # node names are the same for every model built alike
    ref_model, inputs = build_example(name)
    model, _ = build_example(name)
    module = rewrite(trace(model, inputs), NAMED_SCHEDULES[schedule](graph), model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_losses, losses = [], []
    for step in range(3):
        for m, o, out, fn in ((ref_model, ref_opt, ref_losses, None),
                              (module, opt, losses, module.forward.loss_fn)):
            o.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            y = m(*inputs)
            loss = (fn or default_loss_recipe(y))(y)
            loss.backward()
            o.step()
            out.append(loss.item())
    assert losses == ref_losses
    assert len(set(losses)) == 3  # it did train
    for (n, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(a, b), f"{n} differs after 3 steps"


@pytest.mark.parametrize("name", MODELS)
def test_rewrite_leaves_the_model_unchanged(build_example: Callable[..., Any], cases: _Cases,
                                            model_state: Any, name: str) -> None:
    graph = cases(name).graph
    model, inputs = build_example(name)
    before = model_state(model)
    schedule = segments(graph, 2, save=lambda ns: saveable(graph, ns)[:2])
    module = rewrite(trace(model, inputs), schedule, model)
    before.assert_unchanged(model)
    assert type(model).forward is getattr(model.forward, "__func__", None)
    # the model still runs as itself, unscheduled
    fresh, _ = build_example(name)
    assert torch.equal(run_step(model, inputs).loss, run_step(fresh, inputs).loss)
    del module


# ------------------------------------------------------------------------------ bad input


def test_rewrite_rejects_a_schedule_for_another_model(cases: _Cases) -> None:
    mlp, gpt = cases("mlp"), cases("gpt")
    with pytest.raises(ScheduleError, match=r"schedule does not match the traced model: at "
                                            r"node 0 the schedule has 'size' and the model "
                                            r"'model_blocks_0_norm'"):
        rewrite(mlp.gm, Schedule.none(gpt.graph), mlp.model)


def test_rewrite_rejects_a_schedule_that_stops_early(cases: _Cases) -> None:
    case = cases("mlp")
    full = Schedule.none(case.graph)
    short = Schedule([Region(KEEP, full.regions[0].nodes[:-1])])
    with pytest.raises(ScheduleError, match=r"does not match the traced model: at node "
                                            rf"{len(case.graph.compute_nodes) - 1} the schedule "
                                            r"has None"):
        rewrite(case.gm, short, case.model)

