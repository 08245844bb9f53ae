"""Acceptance tests for `scheduler.apply`: re-applying a saved schedule to a model.

``apply`` re-traces the model, checks the schedule's fingerprint against it and rewrites it.
A schedule made for another model, other input shapes or another loss is refused with a
`ScheduleError` that names both fingerprints; malformed files are refused on load; a good
schedule gives a drop-in module with the unscheduled model's loss and gradients, bit for bit,
and leaves the model object as it was.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import scheduler
from scheduler.capture.trace import default_loss_recipe
from scheduler.ir.graph import CostGraph
from scheduler.ir.schedule import KEEP, RECOMPUTE, Schedule, ScheduleError
from scheduler.plan import apply
from scheduler.rewrite import planned

MODELS = ["mlp", "gpt", "unet", "hf_gpt2"]
Build = Callable[..., tuple[nn.Module, tuple[Any, ...]]]


def _step(module: nn.Module, inputs: tuple[Any, ...],
          loss_fn: Callable[[Any], torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
    """One step after ``torch.manual_seed(0)`` from ``.grad = None``: (loss, grads by name)."""
    params = dict(module.named_parameters())
    for p in params.values():
        p.grad = None
    torch.manual_seed(0)
    out = module(*inputs)
    loss = (loss_fn or default_loss_recipe(out))(out)
    loss.backward()
    grads = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return loss.detach(), grads


def _assert_same_step(module: nn.Module, ref_model: nn.Module, inputs: tuple[Any, ...],
                      loss_fn: Callable[[Any], torch.Tensor] | None = None) -> None:
    loss, grads = _step(module, inputs, loss_fn or getattr(module, "loss_fn", None))
    ref_loss, ref_grads = _step(ref_model, inputs, loss_fn)
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    assert list(grads) == list(ref_grads)
    differ = [n for n in grads if grads[n] is None or not torch.equal(grads[n], ref_grads[n])]
    assert not differ, f"gradients differ: {differ[:4]}"
    ref_buffers = dict(ref_model.named_buffers())
    for n, b in module.named_buffers():
        assert torch.equal(b, ref_buffers[n]), f"buffer {n} differs"


def _blocks_recomputed(g: CostGraph, *, save_first: bool = True) -> Schedule:
    """Every block one recompute region (caching its first allocating node), the rest kept."""
    names = g.compute_nodes
    spans, i = [], 0
    while i < len(names):
        block = g.node(names[i]).block
        j = i
        while j < len(names) and g.node(names[j]).block == block:
            j += 1
        if block:
            save = [n for n in names[i:j] if g.allocates(n)][:1] if save_first else []
            spans.append((i, j, RECOMPUTE, save))
        else:
            spans.append((i, j, KEEP))
        i = j
    return Schedule.from_regions(g, spans, solver="every_block")


@pytest.fixture(scope="module")
def graphs(build_example: Build) -> Callable[[str], CostGraph]:
    """``graphs(name)``: the example's profiled `CostGraph`, profiled once per module."""
    cache: dict[str, CostGraph] = {}

    def get(name: str) -> CostGraph:
        if name not in cache:
            model, inputs = build_example(name)
            cache[name] = scheduler.profile(model, inputs, repeats=1, units=None)
        return cache[name]

    return get


# ---------------------------------------------------------------------------- good input


@pytest.mark.parametrize("how", ["object", "path"])
@pytest.mark.parametrize("name", MODELS)
def test_apply_gives_the_same_step(graphs: Callable[[str], CostGraph], build_example: Build,
                                   tmp_path: Path, name: str, how: str) -> None:
    s = _blocks_recomputed(graphs(name))
    model, inputs = build_example(name)
    ref_model, _ = build_example(name)
    if how == "path":
        s.save(tmp_path / "schedule.json")
        module = apply(model, tmp_path / "schedule.json", inputs)
        assert planned(module).schedule == s
        module = apply(model, str(tmp_path / "schedule.json"), inputs)  # str paths too
    else:
        module = apply(model, s, inputs)
        assert planned(module).schedule is s
    assert type(module) is type(model) and module is not model
    assert list(module.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(module.parameters(), model.parameters()))
    _assert_same_step(module, ref_model, inputs)


@pytest.mark.parametrize("name", MODELS)
def test_apply_leaves_the_model_unchanged(graphs: Callable[[str], CostGraph],
                                          build_example: Build, model_state: Any,
                                          tmp_path: Path, name: str) -> None:
    model, inputs = build_example(name)
    before = model_state(model)
    _blocks_recomputed(graphs(name)).save(tmp_path / "s.json")
    apply(model, tmp_path / "s.json", inputs)
    before.assert_unchanged(model)
    assert "forward" not in vars(model)


def test_apply_to_another_instance_with_other_weights(graphs: Callable[[str], CostGraph],
                                                      build_example: Build) -> None:
    """The fingerprint is about structure and shapes: a schedule made on one GPT applies to
    any GPT of the same configuration and input shapes."""
    s = _blocks_recomputed(graphs("gpt"))
    model, inputs = build_example("gpt", seed=5)
    ref_model, _ = build_example("gpt", seed=5)
    _assert_same_step(apply(model, s, inputs), ref_model, inputs)


def test_apply_trains_with_an_optimizer_on_the_original(graphs: Callable[[str], CostGraph],
                                                        build_example: Build) -> None:
    s = _blocks_recomputed(graphs("gpt"))
    model, inputs = build_example("gpt")
    ref_model, _ = build_example("gpt")
    module = apply(model, s, inputs)
    losses: dict[str, list[float]] = {"ref": [], "applied": []}
    for key, m, opt in (("ref", ref_model, torch.optim.AdamW(ref_model.parameters())),
                        ("applied", module, torch.optim.AdamW(model.parameters()))):
        for step in range(3):
            opt.zero_grad()
            torch.manual_seed(step)
            loss = m(*inputs)  # GPT returns its loss
            loss.backward()
            opt.step()
            losses[key].append(loss.item())
    assert losses["applied"] == losses["ref"]
    for (n, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(a, b), n


def test_apply_accepts_a_lone_tensor_or_a_list(graphs: Callable[[str], CostGraph],
                                               build_example: Build) -> None:
    s = _blocks_recomputed(graphs("mlp"))
    model, (x,) = build_example("mlp")
    ref_model, _ = build_example("mlp")
    _assert_same_step(apply(model, s, x), ref_model, (x,))
    _assert_same_step(apply(model, s, [x]), ref_model, (x,))


def test_apply_with_the_loss_it_was_solved_for(build_example: Build) -> None:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).sum()

    model, inputs = build_example("mlp")
    ref_model, _ = build_example("mlp")
    g = scheduler.profile(model, inputs, loss_fn=loss_fn, repeats=1, units=None)
    module = apply(model, _blocks_recomputed(g), inputs, loss_fn=loss_fn)
    assert module.forward.loss_fn is loss_fn
    _assert_same_step(module, ref_model, inputs, loss_fn)


def test_apply_without_fingerprint_checks_nodes(graphs: Callable[[str], CostGraph],
                                                build_example: Build) -> None:
    """A hand-written schedule (no fingerprint) is applied if its nodes are the model's."""
    s = _blocks_recomputed(graphs("unet"))
    s.fingerprint = ""
    model, inputs = build_example("unet")
    ref_model, _ = build_example("unet")
    _assert_same_step(apply(model, s, inputs), ref_model, inputs)


def test_measure_the_applied_module(graphs: Callable[[str], CostGraph],
                                    build_example: Build) -> None:
    """`measure` runs an applied module, reports the model's loss, leaves its state alone, and
    recomputing every block of the (activation-heavy) MLP lowers the measured peak."""
    g = graphs("mlp")
    model, inputs = build_example("mlp")
    ref_loss, _ = _step(build_example("mlp")[0], inputs)
    plain = scheduler.measure(apply(model, Schedule.none(g), inputs), inputs, repeats=1)
    ckpt = scheduler.measure(apply(model, _blocks_recomputed(g, save_first=False), inputs),
                             inputs, repeats=1)
    assert plain.loss == ckpt.loss == ref_loss.item()
    assert ckpt.peak_bytes < plain.peak_bytes, (ckpt.peak_bytes, plain.peak_bytes)
    assert all(p.grad is None for p in model.parameters())

    unet, unet_inputs = build_example("unet")
    before = [b.clone() for b in unet.buffers()]
    scheduler.measure(apply(unet, _blocks_recomputed(graphs("unet")), unet_inputs), unet_inputs,
                      repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(unet.buffers(), before))


# ----------------------------------------------------------------------------- bad input


def _fingerprint_error(schedule: Schedule, model_name: str) -> str:
    return (rf"schedule was made for a graph with fingerprint '{schedule.fingerprint}', but "
            rf"{model_name} with inputs .* traces to '[0-9a-f]{{16}}': the model's structure or "
            r"input shapes differ; solve again")


@pytest.mark.parametrize("how", ["object", "path"])
def test_apply_schedule_of_another_model(graphs: Callable[[str], CostGraph],
                                         build_example: Build, tmp_path: Path,
                                         how: str) -> None:
    s = _blocks_recomputed(graphs("mlp"))
    target: Any = s
    if how == "path":
        s.save(tmp_path / "mlp.json")
        target = tmp_path / "mlp.json"
    model, inputs = build_example("gpt")
    with pytest.raises(ScheduleError, match=_fingerprint_error(s, "GPT")):
        apply(model, target, inputs)


def test_apply_schedule_of_a_model_of_other_depth(graphs: Callable[[str], CostGraph],
                                                  build_example: Build) -> None:
    s = _blocks_recomputed(graphs("mlp"))
    model, inputs = build_example("mlp", depth=2)
    with pytest.raises(ScheduleError, match=_fingerprint_error(s, "ResidualMLP")):
        apply(model, s, inputs)


@pytest.mark.parametrize(("name", "overrides", "shapes"), [
    ("gpt", dict(batch=3), r"\[\(3, 16\), \(3, 16\)\]"),
    ("unet", dict(size=24), r"\[\(2, 3, 24, 24\)\]"),
    ("hf_gpt2", dict(batch=1), r"\[\(1, 16\)\]"),
])
def test_apply_schedule_for_other_input_shapes(graphs: Callable[[str], CostGraph],
                                               build_example: Build, name: str,
                                               overrides: dict, shapes: str) -> None:
    s = _blocks_recomputed(graphs(name))
    model, inputs = build_example(name, **overrides)
    with pytest.raises(ScheduleError, match=_fingerprint_error(s, ".*")) as err:
        apply(model, s, inputs)
    assert re.search(shapes, str(err.value)), str(err.value)


def test_apply_schedule_solved_for_another_loss(graphs: Callable[[str], CostGraph],
                                                build_example: Build) -> None:
    s = _blocks_recomputed(graphs("mlp"))  # solved with the default loss (a mean)
    model, inputs = build_example("mlp")
    with pytest.raises(ScheduleError, match=_fingerprint_error(s, "ResidualMLP")):
        apply(model, s, inputs, loss_fn=lambda out: out.pow(2).sum())


def test_apply_hand_written_schedule_for_another_model(graphs: Callable[[str], CostGraph],
                                                       build_example: Build) -> None:
    s = Schedule.none(graphs("mlp"))
    s.fingerprint = ""  # nothing to compare: the node names are what differ
    model, inputs = build_example("gpt")
    with pytest.raises(ScheduleError, match=r"schedule does not match the traced model: at node "
                                            r"0 the schedule has 'model_blocks_0_norm' and the "
                                            r"model 'size'"):
        apply(model, s, inputs)


def _edited(g: CostGraph, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    d = _blocks_recomputed(g).to_dict()
    edit(d)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    return path


def _skip(d: dict) -> None:
    d["regions"][1]["nodes"].pop(1)


def _repeat(d: dict) -> None:
    d["regions"][1]["nodes"].insert(0, d["regions"][0]["nodes"][-1])


def _save_outside(d: dict) -> None:
    d["regions"][1]["save"] = [d["regions"][2]["nodes"][0]]


def _policy(d: dict) -> None:
    d["regions"][1]["policy"] = "offload"


def _old(d: dict) -> None:
    d["version"] = 0


EDITS = {
    "skip": (_skip, r"schedule does not match the traced model: at node \d+ the schedule has "
                    r"'\w+' and the model '\w+'"),
    "repeat": (_repeat, r"schedule does not match the traced model: at node \d+"),
    "save_outside": (_save_outside, r"save-set node '\w+' is not in its region"),
    "unknown_policy": (_policy, r"regions\[1\]\.policy: expected 'keep' or 'recompute', got 'offload'"),
    "old_version": (_old, r"version: this scheduler reads schedule version 1 or 2, the file has 0"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_apply_edited_file(graphs: Callable[[str], CostGraph], build_example: Build,
                           tmp_path: Path, edit: str) -> None:
    fn, message = EDITS[edit]
    path = _edited(graphs("gpt"), tmp_path, fn)
    model, inputs = build_example("gpt")
    with pytest.raises(ScheduleError, match=message):
        apply(model, path, inputs)


def test_apply_malformed_json(build_example: Build, tmp_path: Path) -> None:
    path = tmp_path / "truncated.json"
    path.write_text('{"schema": "scheduler.schedule", "version": 1, "regions": [{"pol')
    model, inputs = build_example("mlp")
    with pytest.raises(ScheduleError, match=rf"{re.escape(str(path))}: not valid JSON"):
        apply(model, path, inputs)


def test_apply_cost_graph_file(graphs: Callable[[str], CostGraph], build_example: Build,
                               tmp_path: Path) -> None:
    """The graph JSON is not a schedule: a likely mix-up of two files."""
    graphs("mlp").save(tmp_path / "graph.json")
    model, inputs = build_example("mlp")
    with pytest.raises(ScheduleError, match=r"schema: expected 'scheduler.schedule', got "
                                            r"'scheduler.costgraph'"):
        apply(model, tmp_path / "graph.json", inputs)


def test_every_exported_name_resolves_to_its_own_object() -> None:
    """The package loads its exports on first use: each name in ``__all__`` must come from a
    module that defines it (a name left out of the loader, or a wrong module, fails here)."""
    import importlib

    for name in scheduler.__all__:
        value = getattr(scheduler, name)
        assert getattr(importlib.import_module(value.__module__), name) is value, name
