"""`scheduler.trace`: capturing model + loss as one graph, without touching the model.

References are independent of the traced graph: the model itself, run eagerly, and
hand-computed values for the default-loss rules.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

import scheduler
from scheduler.capture.program import Program
from scheduler.capture.trace import (
    LossRecipe,
    TraceError,
    block_of,
    default_loss_recipe,
    module_path,
)

EXAMPLES = ["mlp", "gpt", "unet", "hf_gpt2"]
Build = Callable[..., tuple[nn.Module, tuple[Any, ...]]]


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def restoring(model: nn.Module) -> Iterator[None]:
    """Put the model's state_dict values (BatchNorm statistics) back afterwards."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(saved)


def step(run: Callable[[], tuple[Any, torch.Tensor]], model: nn.Module,
         seed: int) -> tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Output, loss and parameter gradients of one step (``.grad`` is not touched)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with restoring(model):
        torch.manual_seed(seed)  # the GPT example's dropout must draw the same masks
        out, loss = run()
        grads = torch.autograd.grad(loss, params)
    return out, loss, grads


#: The default loss of each example, written out by hand (see `default_loss_recipe`): the GPT
#: example returns its cross-entropy, the others a tensor (or HF ``logits``) to average.
EXPECTED_LOSS: dict[str, Callable[[Any], torch.Tensor]] = {
    "mlp": lambda out: out.mean(),
    "gpt": lambda out: out,
    "unet": lambda out: out.mean(),
    "hf_gpt2": lambda out: out.logits.mean(),
}


def eager(name: str, model: nn.Module,
          inputs: tuple[Any, ...]) -> Callable[[], tuple[Any, torch.Tensor]]:
    def run() -> tuple[Any, torch.Tensor]:
        out = model(*inputs)
        return out, EXPECTED_LOSS[name](out)

    return run


def assert_same_output(a: Any, b: Any, exact: bool) -> None:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb, "different output structure"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **tol)


# ----------------------------------------------------------------------------- examples


@pytest.fixture(scope="module")
def traced(build_example: Build) -> Callable[[str], tuple[nn.Module, tuple[Any, ...], Any]]:
    """``traced(name) -> (model, inputs, gm)``, traced once per module."""
    cache: dict[str, tuple[nn.Module, tuple[Any, ...], Any]] = {}

    def get(name: str) -> tuple[nn.Module, tuple[Any, ...], Any]:
        if name not in cache:
            model, inputs = build_example(name)
            cache[name] = (model, inputs, scheduler.trace(model, inputs))
        return cache[name]

    return get


@pytest.mark.parametrize("name", EXAMPLES)
def test_trace_example_reproduces_output_and_loss(name: str, traced: Any) -> None:
    model, inputs, gm = traced(name)
    info = gm.meta["scheduler"]
    assert info.tracer == ("export" if name == "hf_gpt2" else "fx")
    if name == "hf_gpt2":
        assert info.fallback_reason  # why symbolic_trace was not used
    else:
        assert info.fallback_reason == ""
    ref_out, ref_loss, ref_grads = step(eager(name, model, inputs), model, seed=123)
    out, loss, grads = step(lambda: Program(gm).run(inputs), model, seed=123)
    # fx runs the user's own modules: bit-for-bit. export runs ATen ops: tight tolerance.
    exact = name != "hf_gpt2"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    assert type(out) is type(ref_out)
    assert_same_output(out, ref_out, exact)
    assert loss.numel() == 1
    torch.testing.assert_close(loss, ref_loss, **tol)
    # gradients flow from the traced loss to the user's own parameter objects, unchanged
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, **tol)


def test_gpt_dropout_is_active_in_the_trace(traced: Any) -> None:
    """Different seeds give different losses: the trace kept the random ops (train mode)."""
    model, inputs, gm = traced("gpt")
    prog = Program(gm)
    torch.manual_seed(1)
    a = prog.run(inputs)[1]
    torch.manual_seed(2)
    b = prog.run(inputs)[1]
    assert not torch.equal(a, b)


@pytest.mark.parametrize("name", EXAMPLES)
def test_trace_leaves_the_model_unchanged(name: str, build_example: Build, model_state: Any,
                                          with_grads: Any) -> None:
    model, inputs = build_example(name)
    with_grads(model)
    inputs_before = [t.clone() for t in inputs]
    before = model_state(model)
    rng = torch.get_rng_state()
    gm = scheduler.trace(model, inputs)
    before.assert_unchanged(model)
    assert torch.equal(torch.get_rng_state(), rng)
    for t, t0 in zip(inputs, inputs_before):
        assert torch.equal(t, t0)
    # the graph uses the user's parameter objects, not copies
    model_params = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= model_params


def test_unet_trace_keeps_batchnorm_statistics(build_example: Build) -> None:
    """Sanity for the test above: a train-mode forward does change the running statistics,
    and tracing (which runs the model) must undo that."""
    model, inputs = build_example("unet")
    bn = model.down[0].net[1]
    mean0, count0 = bn.running_mean.clone(), int(bn.num_batches_tracked)
    scheduler.trace(model, inputs)
    assert torch.equal(bn.running_mean, mean0) and int(bn.num_batches_tracked) == count0
    with torch.no_grad():
        model(*inputs)
    assert not torch.equal(bn.running_mean, mean0)
    assert int(bn.num_batches_tracked) == count0 + 1


@pytest.mark.parametrize("name,blocks", [
    ("mlp", {"blocks.0", "blocks.1", "blocks.2"}),
    ("gpt", {"transformer.h.0", "transformer.h.1"}),
    # plus, by the documented rule, "mid.conv.net.<i>": the U-Net's bottleneck is not a
    # repeated block, but its nn.Sequential indices end in integers
    ("unet", {"down.0", "down.1", "down.2", "up.0", "up.1", "up.2"}),
    ("hf_gpt2", {"transformer.h.0", "transformer.h.1"}),
])
def test_blocks_of_examples(name: str, blocks: set[str], traced: Any) -> None:
    model, inputs, gm = traced(name)
    nodes = Program(gm).nodes
    paths = [module_path(n) for n in nodes]
    found = {block_of(p) for p in paths} - {""}
    extra = {b for b in found - blocks if not (name == "unet" and b.startswith("mid.conv.net."))}
    assert blocks <= found and not extra
    # module paths name real submodules of the user's model (no wrapper prefix)
    submodules = dict(model.named_modules())
    for p in paths:
        assert p == "" or p in submodules, p


# ----------------------------------------------------------------------------- errors


class DataDependent(nn.Module):
    """Branches on a tensor value: neither symbolic tracing (a Proxy has no truth value) nor
    non-strict torch.export (a data-dependent guard) can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.lin(x))
        if y.sum() > 0:  # data-dependent control flow
            return y * 2
        return y - 1


class ItemBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        n = int((y > 0).sum())  # a Python int from tensor data
        return y[:, :n] if n % 2 else y


@pytest.mark.parametrize("cls,line", [(DataDependent, "if y.sum() > 0"),
                                      (ItemBranch, "n = int((y > 0).sum())")])
def test_untraceable_model_gives_a_clear_error(cls: type[nn.Module], line: str,
                                               model_state: Any, with_grads: Any) -> None:
    torch.manual_seed(0)
    model = cls().train()
    x = torch.randn(3, 4)
    with_grads(model)
    before = model_state(model)
    with pytest.raises(TraceError) as info:
        scheduler.trace(model, (x,))
    msg = str(info.value)
    assert cls.__name__ in msg
    assert "symbolic_trace" in msg and "torch.export" in msg  # both tracers were tried
    assert line in msg and "test_trace.py:" in msg  # names the failing line
    assert "loss_fn" in msg and "wrap" in msg  # and the way out
    before.assert_unchanged(model)


def test_untraceable_model_error_from_profile() -> None:
    torch.manual_seed(0)
    with pytest.raises(scheduler.TraceError, match="if y.sum"):
        scheduler.profile(DataDependent(), (torch.randn(3, 4),), repeats=1)


@pytest.mark.parametrize("loss_fn", [lambda out: out, lambda out: out.sum(0),
                                     lambda out: 1.0, lambda out: (out.sum(), out.sum())])
def test_loss_fn_must_return_a_scalar(loss_fn: Callable[[Any], Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with pytest.raises(TraceError, match="loss_fn must return a scalar"):
        scheduler.trace(model, (torch.randn(5, 4),), loss_fn=loss_fn)


def test_custom_loss_fn_is_traced() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    x = torch.randn(5, 4)
    gm = scheduler.trace(model, (x,), loss_fn=lambda out: (out ** 2).sum())
    out, loss = Program(gm).run((x,))
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(loss, (ref ** 2).sum(), rtol=0, atol=0)
    assert gm.meta["scheduler"].loss_nodes  # pow and sum belong to the loss


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        scheduler.trace(lambda x: x, (torch.ones(1),))  # type: ignore[arg-type]


def test_single_tensor_input_is_accepted() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    out, loss = Program(scheduler.trace(model, x)).run((x,))
    torch.testing.assert_close(loss, model(x).mean(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- default loss


T = torch.tensor


@pytest.mark.parametrize("out,kind,expected", [
    (T(2.5), "scalar", 2.5),  # rule 1: a scalar output is the loss
    (T([2.5]), "scalar", 2.5),  # one element counts as a scalar
    ({"loss": T(1.25), "logits": T([[9.0, 9.0]])}, "scalar", 1.25),  # rule 2
    ({"logits": T([[9.0, 9.0]]), "loss": T([1.25])}, "scalar", 1.25),  # any position
    ({"logits": T([[1.0, 2.0], [3.0, 4.0]])}, "mean", 2.5),  # rule 3, no "loss" key
    ({"loss": T([1.0, 2.0]), "logits": T([[1.0, 3.0]])}, "mean", 1.5 + 2.0),  # non-scalar loss
    ({"loss": None, "logits": T([4.0, 6.0])}, "mean", 5.0),
    (T([[1.0, 2.0], [3.0, 6.0]]), "mean", 3.0),  # a single tensor: its mean
    ((T([1.0, 3.0]), T([1, 2]), T([[2.0, 4.0], [6.0, 8.0]])), "mean", 2.0 + 5.0),  # ints skipped
    ([T([1.0]), {"a": T([2.0, 4.0]), "b": (T([10.0, 20.0]),)}], "mean", 1.0 + 3.0 + 15.0),
    ((T(7), T([1.0, 2.0])), "mean", 1.5),  # an integer scalar is not a loss
])
def test_default_loss_rules(out: Any, kind: str, expected: float) -> None:
    recipe = default_loss_recipe(out)
    assert isinstance(recipe, LossRecipe)
    assert recipe.kind == kind
    loss = recipe(out)
    assert isinstance(loss, torch.Tensor) and loss.numel() == 1
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_default_loss_recipe_is_positional() -> None:
    """The recipe is decided once and applies to any output of the same structure."""
    recipe = default_loss_recipe((T([1.0, 3.0]), T([5, 5]), T([2.0])))
    assert recipe.indices == (0, 2)
    assert recipe((T([10.0, 30.0]), T([0, 0]), T([4.0]))).item() == pytest.approx(24.0)


@pytest.mark.parametrize("out", [T(3), T([1, 2]), (T([1, 2]), T([True])), {"ids": T([1])}])
def test_default_loss_needs_a_floating_tensor(out: Any) -> None:
    with pytest.raises(TraceError, match="loss_fn"):
        default_loss_recipe(out)


def test_default_loss_of_hf_model_output() -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    with_loss = CausalLMOutput(loss=T(0.75), logits=T([[[1.0, 2.0]]]))
    assert default_loss_recipe(with_loss)(with_loss).item() == pytest.approx(0.75)
    without = CausalLMOutput(logits=T([[[1.0, 2.0]]]))
    assert default_loss_recipe(without)(without).item() == pytest.approx(1.5)


# ----------------------------------------------------------------------------- module paths


@pytest.mark.parametrize("path,block", [
    ("transformer.h.3.attn", "transformer.h.3"),
    ("transformer.h.3", "transformer.h.3"),
    ("transformer.h.12.mlp.c_fc", "transformer.h.12"),
    ("down.1.pool", "down.1"),
    ("down.1.conv.net.0", "down.1"),  # the outermost index, not net.0
    ("0.1", "0"),
    ("lm_head", ""),
    ("transformer.ln_f", ""),
    ("", ""),
])
def test_block_of(path: str, block: str) -> None:
    assert block_of(path) == block


def _node(op: str, target: Any, stack: dict[str, Any] | None) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    if op == "call_module":
        n = g.call_module(target, (x,))
    else:
        n = g.call_function(target, (x,))
    if stack is not None:
        n.meta["nn_module_stack"] = stack
    return n


@pytest.mark.parametrize("op,target,stack,path", [
    ("call_module", "model.blocks.3.fc1", None, "blocks.3.fc1"),
    ("call_module", "model.head", None, "head"),
    ("call_function", torch.relu, {"a": ("model.blocks.0", nn.Module)}, "blocks.0"),
    ("call_function", torch.relu,
     {"a": ("model", nn.Module), "b": ("model.transformer.h.0.attn", nn.Module)},
     "transformer.h.0.attn"),  # the innermost module
    ("call_function", torch.relu, {"a": ("L['self'].model.transformer.h[3].mlp", nn.Module)},
     "transformer.h.3.mlp"),  # dynamo-style path
    ("call_function", torch.relu, {"a": ("model", nn.Module)}, ""),  # the wrapper itself
    ("call_function", torch.relu, {}, ""),
    ("call_function", torch.relu, None, ""),
])
def test_module_path(op: str, target: Any, stack: Any, path: str) -> None:
    assert module_path(_node(op, target, stack)) == path


def test_preserved_state_restores_every_cuda_generator_where_cuda_is_initialized(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA generators' states (what dropout on a GPU draws from) are put back as they
    were, after a body that raises too; where CUDA is not initialized they are not touched
    (reading them would initialize it). No GPU here: torch.cuda's state calls are stood in
    for by a recording double."""
    from scheduler.capture.state import preserved_state

    states = {"now": [torch.tensor([1], dtype=torch.uint8)]}
    calls: list[str] = []

    def get_all() -> list[torch.Tensor]:
        calls.append("get")
        return [t.clone() for t in states["now"]]

    def set_all(new: list[torch.Tensor]) -> None:
        calls.append("set")
        states["now"] = new

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    model = nn.Linear(2, 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with preserved_state(model):
        pass
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError), preserved_state(model):
        states["now"] = [torch.tensor([9], dtype=torch.uint8)]  # (a draw advanced it)
        raise RuntimeError("the traced forward failed")
    assert calls == ["get", "set"] and states["now"][0].item() == 1
