"""`capture.calls`: keyword calls as positional ones, and the copies of a model that get
planned and traced."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from scheduler.capture.calls import bare_copy, bind_call, call_inputs, module_copy


def fwd(x: Any, mask: Any = None, scale: float = 2.0, target: Any = None) -> None:
    """A forward with optional parameters, as Hugging Face models have."""


def needs(x: Any, y: Any, z: Any = 1) -> None:
    """A forward with two required parameters."""


def star(x: Any, **rest: Any) -> None:
    """A forward that takes any keyword."""


@pytest.mark.parametrize(("args", "kwargs", "want"), [
    ((1,), {}, (1,)),
    ((), {"x": 1}, (1,)),
    ((1,), {"target": 5}, (1, None, 2.0, 5)),  # the skipped ones at their defaults
    ((), {"scale": 3.0, "x": 1}, (1, None, 3.0)),  # keyword order does not matter
    ((), {"mask": 0}, None),  # x, required, left out
    ((1,), {"other": 0}, None),  # a name it does not take
])
def test_bind_call(args: tuple[Any, ...], kwargs: dict[str, Any], want: Any) -> None:
    assert bind_call(fwd, args, kwargs) == want


def test_bind_call_needs_every_required_parameter_before_the_last_given() -> None:
    assert bind_call(needs, (), {"x": 1, "z": 3}) is None
    assert bind_call(needs, (), {"y": 2, "x": 1}) == (1, 2)
    assert bind_call(star, (1,), {"extra": 2}) is None  # **rest cannot be positional


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * scale


def test_call_inputs_binds_a_mapping_and_names_what_does_not_bind() -> None:
    x = torch.ones(1, 2)
    assert call_inputs(Net(), {"scale": 3.0, "x": x}) == (x, 3.0)
    assert call_inputs(Net(), x) == (x,) and call_inputs(Net(), [x]) == (x,)
    with pytest.raises(TypeError, match=r"keys \['y'\] do not bind to Net.forward\(x"):
        call_inputs(Net(), {"y": x})


def test_module_copy_shares_state_but_not_its_dictionaries() -> None:
    net = Net()
    net.register_forward_hook(lambda *a: None)
    copy = module_copy(net)
    assert type(copy) is Net and copy is not net
    assert copy.lin is net.lin and copy.count is net.count
    assert list(copy.state_dict()) == list(net.state_dict())
    assert len(copy._forward_hooks) == 1  # hooks registered before: fire on the copy too
    copy.register_forward_pre_hook(lambda *a: None)
    copy.extra = nn.Linear(1, 1)
    assert not net._forward_pre_hooks and not hasattr(net, "extra")
    copy.eval()
    assert net.training and not net.lin.training  # its own flag; the shared child follows
    bare = bare_copy(net)
    assert not bare._forward_hooks and bare.lin is net.lin
