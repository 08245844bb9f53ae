"""A plan outside the training step it traced: eval mode, no_grad, keyword arguments, other
input counts and (on the `torch.export` path) other shapes.

There the checkpointed module must compute exactly what the model computes: it runs the
model's own forward, and a training step that does so warns once, naming the cause. The
reference is always a second model built with the same seed, run the same way.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import scheduler
from scheduler.rewrite import planned


class FunctionalDropout(nn.Module):
    """Dropout through ``F.dropout(x, p, self.training)``: fx reads ``self.training`` once, at
    trace time, so the traced graph alone would keep (or never) dropping out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), 0.5, self.training)
        out = self.b(h)
        return out if y is None else ((out - y) ** 2).mean()


class Branchy(nn.Module):
    """A branch on a shape, which `torch.fx.symbolic_trace` cannot follow: traced by
    `torch.export`, which specialises the graph to the traced shapes. With dropout and
    BatchNorm, whose train and eval behaviour differ."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 2
        return self.b(self.drop(torch.relu(self.bn(self.a(x))))).sum()


def build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().train()


def solved(cls: type[nn.Module], inputs: tuple[Any, ...], *, train: bool = True) -> Any:
    model = build(cls).train(train)
    plan = scheduler.solve(model, inputs, budget=1.0, solver="every_block", repeats=1)
    return model, plan


def step(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss (or output) and the gradients of one step, dropout drawn after seed 0."""
    torch.manual_seed(0)
    for p in module.parameters():
        p.grad = None
    out = module(*args, **kwargs)
    loss = out if out.dim() == 0 else out.sum()
    loss.backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


def same(a: tuple[torch.Tensor, list[torch.Tensor]],
         b: tuple[torch.Tensor, list[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))


def test_the_traced_training_step_runs_without_a_warning() -> None:
    model, plan = solved(FunctionalDropout, (X, Y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(plan.module, X, Y)
    assert same(got, step(build(FunctionalDropout), X, Y))


def test_eval_mode_stops_functional_dropout() -> None:
    model, plan = solved(FunctionalDropout, (X,))
    plan.module.eval()
    # the plan's own root flag (functional dropout reads it); the shared children's follow
    assert not plan.module.training and not model.a.training
    ref = build(FunctionalDropout).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eval is no training step: nothing to warn about
        got = plan.module(X)
    assert torch.equal(got, ref(X))
    assert torch.equal(plan.module(X), plan.module(X))  # no dropout: the same twice
    plan.module.train()
    assert plan.module.training and model.a.training
    assert same(step(plan.module, X), step(build(FunctionalDropout), X))


def test_no_grad_runs_the_model_as_it_is() -> None:
    model, plan = solved(FunctionalDropout, (X, Y))
    ref = build(FunctionalDropout)
    with torch.no_grad():
        torch.manual_seed(0)
        got = plan.module(X, Y)
        torch.manual_seed(0)
        assert torch.equal(got, ref(X, Y))


def test_a_plan_traced_in_eval_mode_warns_in_training_and_drops_out() -> None:
    model, plan = solved(FunctionalDropout, (X, Y), train=False)
    plan.module.train()
    with pytest.warns(RuntimeWarning, match="traced in eval mode"):
        got = step(plan.module, X, Y)
    assert same(got, step(build(FunctionalDropout), X, Y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per cause
        step(plan.module, X, Y)


def test_keywords_that_fill_the_traced_inputs_run_the_plan() -> None:
    model, plan = solved(FunctionalDropout, (X, Y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(plan.module, x=X, y=Y)
        assert same(got, step(plan.module, X, y=Y))
    assert same(got, step(build(FunctionalDropout), X, Y))


def test_fewer_inputs_than_traced_run_the_model_with_a_warning() -> None:
    model, plan = solved(FunctionalDropout, (X, Y))
    with pytest.warns(RuntimeWarning, match="called with 1 inputs"):
        got = step(plan.module, X)  # (the optional target left out: another output)
    assert same(got, step(build(FunctionalDropout), X))


def test_a_plan_that_stops_running_is_counted_and_warns_again_with_the_count() -> None:
    """A job whose every training call falls back (as under HF Trainer's extra keywords)
    trained unplanned for good after one warning: the steps are counted, the warning comes
    back at the 10th and 100th with the counts, and eval calls are neither."""
    model, plan = solved(FunctionalDropout, (X, Y))
    fwd = planned(plan.module)
    step(plan.module, X, Y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(100):
            got = step(plan.module, X)
        with torch.no_grad():
            plan.module(X)
    assert same(got, step(build(FunctionalDropout), X))
    counts = [str(w.message) for w in caught if "own forward" in str(w.message)]
    assert len(counts) == 3, counts
    for message, n in zip(counts, (1, 10, 100)):
        assert f"{n} training step(s) have run unplanned so far, 1 planned" in message, message
    assert (fwd.planned_steps, fwd.fallback_steps) == (1, 100)


def test_on_fallback_raise_stops_a_step_that_cannot_run_the_plan() -> None:
    model = build(FunctionalDropout)
    plan = scheduler.solve(model, (X, Y), budget=1.0, solver="every_block", repeats=1,
                           on_fallback="raise")
    with pytest.raises(scheduler.PlanFallbackError, match="called with 1 inputs"):
        plan.module(X)
    with torch.no_grad():
        plan.module(X)  # (outside training the model's own forward is what the plan runs)
    assert same(step(plan.module, X, Y), step(build(FunctionalDropout), X, Y))
    with pytest.raises(ValueError, match="on_fallback must be one of 'warn', 'raise'"):
        scheduler.apply(model, plan.schedule, (X, Y), on_fallback="ignore")


def test_exported_plan_in_eval_mode_is_the_models_eval() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    model, plan = solved(Branchy, (x,))
    assert planned(plan.module).info.tracer == "export"
    ref = build(Branchy)
    assert same(step(plan.module, x), step(ref, x))  # the traced step, in training
    plan.module.eval()
    ref.eval()
    stats = copy.deepcopy(model.bn.state_dict())
    with torch.no_grad():
        assert torch.equal(plan.module(x), ref(x))
    assert all(torch.equal(v, stats[k]) for k, v in model.bn.state_dict().items())


def test_exported_plan_at_another_shape_runs_the_schedule_and_warns() -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    short = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    model, plan = solved(Branchy, (x,))
    runner = planned(plan.module)
    with pytest.warns(RuntimeWarning, match=r"shapes and dtypes \[\(\[3, 8\], 'float32'\)\], "
                                            r"but it was solved for \[\(\[4, 8\], 'float32'\)\]"):
        got = step(plan.module, short)
    assert runner.traces == 2  # traced again at (3, 8): the schedule ran, not the fallback
    assert same(got, step(build(Branchy), short))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per plan, not at every step
        again = step(plan.module, short)
    assert runner.traces == 2
    assert same(again, step(build(Branchy), short))


def test_exported_training_step_counts_batchnorm_batches() -> None:
    """The buffer's in-place ``add_`` has no reader: it is kept in the model's nodes because
    it writes into a buffer (`mutation.mutated_inputs`)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    model, plan = solved(Branchy, (x,))
    ref = build(Branchy)
    step(plan.module, x)
    step(ref, x)
    assert torch.equal(model.bn.running_mean, ref.bn.running_mean)
    assert torch.equal(model.bn.num_batches_tracked, ref.bn.num_batches_tracked)
