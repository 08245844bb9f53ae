"""What `trace` finds in the user's code that the plan will not run as written: the model's own
``torch.utils.checkpoint`` calls and hooks on modules the trace inlines.

References are independent of the detection: the expected ``file:line`` of a checkpoint call is
read from this file's source (the line marked ``# <- checkpoint``), hook counts come from running
the original model, and gradients from the original model's own (checkpointed) backward.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

import scheduler
from scheduler.capture.trace import TraceError, trace
from scheduler.capture.usercode import UserCodeWarning, plain_checkpoints

plain_checkpoint = functools.partial(checkpoint, use_reentrant=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    """Three blocks; ``how`` says how the middle one is called. ``export=True`` adds a
    shape-dependent branch that symbolic tracing cannot follow, so `trace` takes the export
    path."""

    def __init__(self, how: str = "plain", *, export: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.how, self.export = how, export
        if how == "sequential":
            self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.export and x.shape[0] > 1:
            x = x * 1.0
        x = self.blocks[0](x)
        b = self.blocks[1]
        if self.how == "non-reentrant":
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)  # <- checkpoint
        elif self.how == "reentrant":
            x = checkpoint(b, x, use_reentrant=True)  # <- checkpoint
        elif self.how == "partial":
            x = plain_checkpoint(b, x)  # <- checkpoint
        elif self.how == "sequential":
            # checkpoints every segment but the last
            x = torch.utils.checkpoint.checkpoint_sequential(  # <- checkpoint
                self.seq, 2, x, use_reentrant=False)
        else:
            x = b(x)
        return self.blocks[2](x)


def marked_place(how: str) -> str:
    """``file:line`` of the line in `Net.forward` marked for ``how``."""
    lines, start = inspect.getsourcelines(Net.forward)
    branch = next(i for i, line in enumerate(lines) if f'"{how}"' in line)
    mark = next(i for i in range(branch, len(lines)) if "# <- checkpoint" in lines[i])
    return f"{inspect.getsourcefile(Net)}:{start + mark}"


def traced(model: nn.Module, *inputs: Any) -> tuple[Any, list[warnings.WarningMessage]]:
    """``(TraceInfo, the UserCodeWarnings trace raised)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = trace(model, inputs)
    return gm.meta["scheduler"], [w for w in caught if issubclass(w.category, UserCodeWarning)]


X = torch.randn(4, 8)


# ----------------------------------------------------------------------- checkpoint calls


def test_checkpoint_reads_the_names_the_watch_replaces() -> None:
    """`plain_checkpoints` sees every call only because ``checkpoint`` looks these two
    names up in its module at each call; a torch that stops doing so must fail here."""
    fn = inspect.unwrap(torch.utils.checkpoint.checkpoint)
    assert fn.__globals__ is vars(torch.utils.checkpoint)
    assert {"CheckpointFunction", "_checkpoint_without_reentrant_generator"} <= set(
        fn.__code__.co_names)


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "partial", "sequential"])
def test_own_checkpoint_calls_are_recorded_and_warned_about(how: str, export: bool) -> None:
    info, caught = traced(Net(how, export=export), X)
    assert info.tracer == ("export" if export else "fx")
    assert info.user_checkpoints == (marked_place(how),)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert marked_place(how) in msg
    assert "replaces the model's own checkpointing" in msg and "in bytes" in msg
    assert "gradient_checkpointing_disable()" in msg
    assert caught[0].filename == __file__  # points at the caller of trace, not at scheduler


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_plain_model_warns_nothing(export: bool) -> None:
    info, caught = traced(Net("plain", export=export), X)
    assert info.tracer == ("export" if export else "fx")
    assert caught == []
    assert info.user_checkpoints == () and info.unfired_hooks == ()


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_export_plan_of_a_checkpointed_model_has_its_gradients(how: str) -> None:
    """A reentrant checkpoint runs its function without gradients; traced as it is, export
    would put that region (and what follows) in no-grad. The plan's gradients must equal the
    original model's own checkpointed backward."""
    torch.manual_seed(0)
    model = Net(how, export=True)
    model(X).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserCodeWarning, match="torch.utils.checkpoint"):
        plan = scheduler.solve(model, (X,), budget=1.0, solver="none", repeats=1)
    plan.module(X).square().mean().backward()
    for (name, p), g in zip(model.named_parameters(), expected):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, g, msg=name)


def test_checkpoint_functions_are_restored_after_a_failed_trace() -> None:
    real = (torch.utils.checkpoint.CheckpointFunction,
            torch.utils.checkpoint._checkpoint_without_reentrant_generator)

    class Untraceable(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.blocks[0], x, use_reentrant=False)
            return x[x > 0].sum() if x.sum() > 0 else x  # data-dependent: neither tracer

    with pytest.raises(TraceError):
        trace(Untraceable(), (X,))
    assert (torch.utils.checkpoint.CheckpointFunction,
            torch.utils.checkpoint._checkpoint_without_reentrant_generator) == real


def test_other_threads_keep_real_checkpointing() -> None:
    x = torch.randn(2, 8, requires_grad=True)
    block = Block()
    grad_fn: list[str] = []

    def other() -> None:
        y = checkpoint(block, x, use_reentrant=True)
        grad_fn.append(type(y.grad_fn).__name__)

    places: list[str] = []
    with plain_checkpoints(places):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert places == []
    assert grad_fn == ["CheckpointFunctionBackward"]


def test_hugging_face_gradient_checkpointing_is_recorded() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2,
                                     n_head=2, use_cache=False, bos_token_id=63,
                                     eos_token_id=63)
    model = transformers.GPT2LMHeadModel(config).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation notices
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    info, caught = traced(model, torch.randint(0, 64, (2, 8)))
    assert len(info.user_checkpoints) == 1
    file, line = info.user_checkpoints[0].rsplit(":", 1)
    assert file.startswith(os.path.dirname(transformers.__file__) + os.sep)
    assert "_gradient_checkpointing_func" in linecache.getline(file, int(line))
    # gradient checkpointing also puts a hook on the input embeddings, inlined by the trace
    assert [(h.module, h.kind) for h in info.unfired_hooks] == [("transformer.wte",
                                                                 "forward hook")]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert info.user_checkpoints[0] in messages[0]
    assert "'transformer.wte'" in messages[1] and "disable_input_require_grads" in messages[1]


# ----------------------------------------------------------------------------- hooks


def _register(module: nn.Module, kind: str, calls: list[str]) -> None:
    def note(*_: Any) -> None:
        calls.append(kind)

    {"forward hook": module.register_forward_hook,
     "forward pre-hook": module.register_forward_pre_hook,
     "backward hook": module.register_full_backward_hook}[kind](note)


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("kind", ["forward hook", "forward pre-hook", "backward hook"])
def test_hooks_on_an_inlined_container_are_named(kind: str, export: bool) -> None:
    model = Net(export=export)
    _register(model.blocks[1], kind, [])
    info, caught = traced(model, X)
    assert info.tracer == ("export" if export else "fx")
    assert [(h.module, h.kind) for h in info.unfired_hooks] == [("blocks.1", kind)]
    assert info.unfired_hooks[0].hook.endswith("note")
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert f"{kind} " in msg and "'blocks.1'" in msg and "root model" in msg
    assert caught[0].filename == __file__


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
def test_a_hook_on_the_root_warns_nothing(export: bool) -> None:
    model = Net(export=export)
    _register(model, "forward hook", [])
    _register(model, "forward pre-hook", [])
    info, caught = traced(model, X)
    assert caught == [] and info.unfired_hooks == ()


def test_a_hook_on_a_module_forward_never_calls_warns_nothing() -> None:
    model = Net()
    model.spare = Block()  # never called: its hook does not fire in the original either
    _register(model.spare, "forward hook", [])
    info, caught = traced(model, X)
    assert caught == [] and info.unfired_hooks == ()


def test_a_leaf_hook_fires_in_the_fx_plan_and_is_lost_on_export() -> None:
    calls: list[str] = []
    model = Net()
    _register(model.blocks[1].a, "forward hook", calls)
    info, caught = traced(model, X)
    assert info.tracer == "fx" and caught == [] and info.unfired_hooks == ()
    plan = scheduler.solve(model, (X,), budget=1.0, solver="none", repeats=1)
    calls.clear()
    model(X)
    fired_in_original = len(calls)
    calls.clear()
    plan.module(X).mean().backward()
    assert fired_in_original == 1 and len(calls) == fired_in_original

    exported = Net(export=True)
    _register(exported.blocks[1].a, "forward hook", [])
    info, caught = traced(exported, X)
    assert [(h.module, h.kind) for h in info.unfired_hooks] == [("blocks.1.a", "forward hook")]
    assert "export path inlines every submodule" in str(caught[0].message)


def test_global_module_hooks_are_named() -> None:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        info, caught = traced(Net(), X)
    finally:
        handle.remove()
    assert [(h.module, h.kind) for h in info.unfired_hooks] == [(None, "forward hook")]
    assert "on every module (global; the inlined ones will not run it)" in str(caught[0].message)


def test_a_plan_for_a_checkpointed_model_names_its_measured_own_peak() -> None:
    torch.manual_seed(0)
    model, x = Net("non-reentrant"), torch.randn(512, 8)  # activations outweigh parameters
    own = scheduler.measure(model, (x,), repeats=1).peak_bytes  # the model as the user runs it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = scheduler.solve(model, (x,), budget=1.0, solver="none", repeats=1)
    assert plan.own_peak_bytes == own
    assert own < plan.unconstrained_peak_bytes  # its own checkpointing saves something
    said = [str(w.message) for w in caught if "measured a peak of" in str(w.message)]
    assert len(said) == 1 and f"{plan.budget_bytes / own:.0%} of it" in said[0]
    assert "your model" in plan.summary()


def test_a_plan_for_a_plain_model_measures_nothing_more() -> None:
    plan = scheduler.solve(Net(), (X,), budget=1.0, solver="none", repeats=1)
    assert plan.own_peak_bytes is None and "your model" not in plan.summary()
