"""In-place writes survive tracing and rewriting: the plan computes the model's own loss.

The class of graph: a value is written in place (``copy_`` / ``fill_`` / ``masked_fill_`` into
a freshly allocated tensor or a view of it, ``operator.setitem``, a buffer's ``add_``) and the
write's own result is never read, so by data flow alone it looks like dead code. Hugging
Face's ``shift_tokens_right`` (T5, Whisper, BART given ``labels``) builds ``decoder_input_ids``
this way. Every model here is checked against an identical fresh model, bit for bit on CPU:
loss, every gradient and every buffer, at ``solver="none"`` and at recompute schedules. A
schedule whose backward replay would read a value written after it was read is refused with
a `ScheduleError` naming the in-place op; it never runs with other gradients.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import scheduler
from scheduler.capture.mutation import mutated_inputs
from scheduler.capture.trace import trace
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule, ScheduleError
from scheduler.rewrite import rewrite

PAD, START, IGNORE = 0, 3, -100


def shift_right(labels: torch.Tensor) -> torch.Tensor:
    """``shift_tokens_right`` as Hugging Face writes it: item assignment into a new tensor."""
    new = labels.new_zeros(labels.shape)
    new[:, 1:] = labels[:, :-1].clone()
    new[:, 0] = START
    new.masked_fill_(new == IGNORE, PAD)
    return new


def shift_right_reference(labels: torch.Tensor) -> torch.Tensor:
    """The same values without any in-place write: the independent reference."""
    start = torch.full_like(labels[:, :1], START)
    new = torch.cat([start, labels[:, :-1]], dim=1)
    return torch.where(new == IGNORE, torch.full_like(new, PAD), new)


class ShiftRight(nn.Module):
    """Decoder inputs from labels by item assignment (torch.fx cannot trace ``new[...] =``,
    so this goes through torch.export), then an embedding and a loss over the labels."""

    def __init__(self, writes: bool = True) -> None:
        super().__init__()
        self.writes = writes
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        dec = shift_right(labels) if self.writes else labels.clamp(min=0)
        h = self.head(torch.tanh(self.proj(self.emb(dec) * x)))
        return F.cross_entropy(h.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


class ViewWrites(nn.Module):
    """fx-traceable writes: ``copy_`` into a ``narrow`` view of a new tensor, ``masked_fill_``
    and ``index_fill_`` on it (their results unused). With ``counter``, also a buffer's
    ``add_``: symbolic tracing would run that on the real buffer and record nothing, so it
    goes through torch.export."""

    def __init__(self, counter: bool = False) -> None:
        super().__init__()
        self.counter = counter
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.counter:
            self.calls.add_(1)
        new = torch.zeros_like(labels)
        new.narrow(1, 1, labels.shape[1] - 1).copy_(labels.narrow(1, 0, labels.shape[1] - 1))
        new.masked_fill_(new == IGNORE, PAD)
        new.index_fill_(1, torch.tensor([0]), START)
        h = self.head(torch.tanh(self.emb(new) * x))
        return F.cross_entropy(h.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def make_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 8, generator=g)
    labels = torch.randint(1, 16, (2, 6), generator=g)
    labels[0, 2] = IGNORE
    return x, labels


def build(cls: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def step(module: nn.Module, inputs: tuple[Any, ...], loss_fn: Callable[[Any], Any] | None
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Loss, gradients and buffers after one step from zero gradients."""
    for p in module.parameters():
        p.grad = None
    out = module(*inputs)
    loss = loss_fn(out) if loss_fn else out
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    bufs = {n: b.clone() for n, b in module.named_buffers()}
    for p in module.parameters():
        p.grad = None
    return loss.detach(), grads, bufs


def assert_same(got: Any, ref: Any, where: str) -> None:
    (loss, grads, bufs), (rloss, rgrads, rbufs) = got, ref
    assert torch.equal(loss, rloss), f"loss {loss.item()!r} != {rloss.item()!r}: {where}"
    assert list(grads) == list(rgrads)
    differ = [n for n in grads if not torch.equal(grads[n], rgrads[n])]
    assert not differ, f"gradients of {differ} differ: {where}"
    differ = [n for n in bufs if not torch.equal(bufs[n], rbufs[n])]
    assert not differ, f"buffers {differ} differ: {where}"


def reset_buffers(model: nn.Module) -> None:
    with torch.no_grad():
        for b in model.buffers():
            b.zero_()


def test_shift_right_reference_is_independent() -> None:
    """The reference shift agrees with the in-place one, and the writes change the loss (so
    a plan that dropped them, as it once did, cannot pass the tests below)."""
    _, labels = make_inputs()
    assert torch.equal(shift_right(labels), shift_right_reference(labels))
    assert not torch.equal(shift_right(labels), labels.clamp(min=0))
    x, labels = make_inputs()
    with_writes, without = build(ShiftRight), build(lambda: ShiftRight(writes=False))
    assert not torch.equal(with_writes(x, labels), without(x, labels))
    counter = build(counted)
    counter(x, labels)
    assert int(counter.calls) == 1


def test_trace_leaves_buffers_alone_and_records_their_writes() -> None:
    """Symbolic tracing would bump the counter for real and lose it from the graph; the trace
    leaves the model's counter at 0 and the traced graph holds the write."""
    model = build(counted)
    gm = trace(model, make_inputs())
    assert int(model.calls) == 0
    assert "symbolic trace wrote 'calls' in place" in gm.meta["scheduler"].fallback_reason
    writers = [n.name for n in gm.graph.nodes if n.op != "output" and mutated_inputs(n)]
    assert any(n not in gm.meta["scheduler"].loss_nodes for n in writers if "add" in n)


def counted() -> ViewWrites:
    return ViewWrites(counter=True)


CLASSES = [ShiftRight, ViewWrites, counted]
TRACERS = {ShiftRight: "export", ViewWrites: "fx", counted: "export"}


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("solver", ["none", "uniform:2", "every_node_after_writes"])
def test_writes_are_honoured(cls: Callable[[], nn.Module], solver: str) -> None:
    inputs = make_inputs()
    ref = step(build(cls), inputs, None)
    model = build(cls)
    gm = trace(model, inputs)
    assert gm.meta["scheduler"].tracer == TRACERS[cls]
    if solver == "every_node_after_writes":
        # after the last write, every node is its own recompute region
        graph = scheduler.profile(model, inputs, repeats=1)
        names = graph.compute_nodes
        writers = {n.name for n in gm.graph.nodes if n.op != "output" and mutated_inputs(n)}
        last = max(i for i, n in enumerate(names) if n in writers)
        spans = [(0, last + 1, KEEP)] + [(i, i + 1, RECOMPUTE) for i in range(last + 1,
                                                                              len(names))]
        module = rewrite(gm, Schedule.from_regions(graph, spans), model)
    else:
        plan = scheduler.solve(model, inputs, budget=1.0, solver=solver)
        module = plan.module
        if solver != "none":
            assert any(r.recompute for r in plan.schedule.regions)
    reset_buffers(model)
    assert_same(step(module, inputs, module.forward.loss_fn), ref, f"{cls.__name__}, {solver}")


@pytest.mark.parametrize("cls", CLASSES)
def test_every_two_region_schedule_is_exact_or_refused(cls: Callable[[], nn.Module]) -> None:
    """Each split into two regions (keep/recompute, recompute/keep, recompute/recompute)
    either gives the model's loss, gradients and buffers exactly, or is refused at rewrite
    with a message naming an in-place op; a recompute region that starts after the writes is
    accepted."""
    inputs = make_inputs()
    ref = step(build(cls), inputs, None)
    model = build(cls)
    gm = trace(model, inputs)
    graph = scheduler.profile(model, inputs, repeats=1)
    n = len(graph.compute_nodes)
    refused, accepted = [], []
    for k in range(1, n):
        for first, second in [(KEEP, RECOMPUTE), (RECOMPUTE, KEEP), (RECOMPUTE, RECOMPUTE)]:
            schedule = Schedule.from_regions(graph, [(0, k, first), (k, n, second)])
            try:
                module = rewrite(gm, schedule, model)
            except ScheduleError as e:
                assert "writes in place" in str(e) and "_" in str(e), str(e)
                refused.append((k, first, second))
                continue
            reset_buffers(model)
            assert_same(step(module, inputs, module.forward.loss_fn), ref,
                        f"{cls.__name__}, split at {k}: {first}/{second}")
            accepted.append((k, first, second))
    assert refused, "no schedule recomputes across a write: the test is vacuous"
    assert any(s == RECOMPUTE for _, _, s in accepted), accepted


def test_hf_t5_with_labels_matches_the_model() -> None:
    """T5 given ``labels`` shifts them right in place; the plan's loss and gradients are the
    model's exactly, unscheduled and with the encoder recomputed."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                num_decoder_layers=1, num_heads=2, decoder_start_token_id=0,
                                pad_token_id=0, dropout_rate=0.0)

    class WithLabels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = transformers.T5ForConditionalGeneration(cfg)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, labels=labels).loss

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(1, 64, (2, 8), generator=g), torch.randint(1, 64, (2, 8),
                                                                       generator=g))
    ref = step(build(WithLabels), inputs, None)
    model = build(WithLabels)
    plan = scheduler.solve(model, inputs, budget=1.0, solver="none", repeats=1)
    assert_same(step(plan.module, inputs, plan.module.forward.loss_fn), ref, "T5, none")
    graph, gm = plan.graph, trace(model, inputs)
    assert gm.meta["scheduler"].tracer == "export"
    names = graph.compute_nodes
    enc = [i for i, nm in enumerate(names) if graph.node(nm).block.startswith("m.encoder")]
    assert enc, "no encoder block found"
    schedule = Schedule.from_regions(graph, [(0, enc[0], KEEP), (enc[0], enc[-1] + 1, RECOMPUTE),
                                             (enc[-1] + 1, len(names), KEEP)])
    module = rewrite(gm, schedule, model)
    assert_same(step(module, inputs, module.forward.loss_fn), ref, "T5, encoder recomputed")
