"""benchmarks/partitioner.py: its arguments are checked by value, its policy saves exactly the
compute-intensive ops, its form variant saves what nodes with FLOPs read (on a chain whose
readers are known), and its spy on the partitioner records a compiled graph's saved tensors
(a small MLP's: its ReLU's output among them, no more than its activations and weights) and
puts the partitioner back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._functorch.partitioners as partitioners
import torch._inductor.config as inductor_config
import torch.nn as nn
from _chain import chain
from torch.utils.checkpoint import CheckpointPolicy
from conftest import benchmark_modules

from scheduler.ir.schedule import RECOMPUTE, Region, Schedule

(partitioner,) = benchmark_modules("partitioner")

aten = torch.ops.aten


@pytest.mark.parametrize("argv,named", [(["--examples", "mlp"], "'mlp'"),
                                        (["--rounds", "0"], "got 0")])
def test_bad_arguments_are_refused_by_value(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        partitioner.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_form_saves_as_well_what_nodes_with_flops_read_and_nothing_else() -> None:
    # n0 -> n1 (matmul) -> n2 -> n3 -> n4 (matmul) -> n5: n0 and n3 are read by a matmul
    g = chain([""] * 6)
    g = dataclasses.replace(g, nodes=[dataclasses.replace(
        n, flop_share=1.0 if n.name in ("n1", "n4") else 0.0) for n in g.nodes])
    names = g.compute_nodes
    s = Schedule([Region(RECOMPUTE, tuple(names[:3]), frozenset({"n1"})),
                  Region(RECOMPUTE, tuple(names[3:]), frozenset())])
    got = partitioner.flop_inputs_saved(g, s)
    assert [r.save for r in got.regions] == [{"n0", "n1"}, {"n3"}]
    assert [r.nodes for r in got.regions] == [r.nodes for r in s.regions]


def test_the_policy_saves_the_compute_intensive_ops_and_recomputes_the_rest() -> None:
    policy = partitioner.save_flop_outputs()
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.relu.default, aten.mul.Tensor, aten.native_layer_norm.default):
        assert policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).sum()


@pytest.mark.slow
def test_the_spy_records_what_the_backward_receives_and_restores_the_partitioner() -> None:
    torch.manual_seed(0)
    original = partitioners.choose_saved_values_set
    x = torch.randn(4, 8)
    # (caches off, as the benchmark has them: a cached graph from an earlier run skips the
    # partitioner, and the spy would see nothing)
    with partitioner.Saved() as saved, inductor_config.patch(force_disable_caches=True), \
            functorch_config.patch(enable_autograd_cache=False):
        saved.current = "net"
        torch._dynamo.reset()
        partitioner.Variant("net", "", partitioner.compiled(Net(), 1.0, [0]), (x,),
                            compiled=True).step()
    assert partitioners.choose_saved_values_set is original
    (first,) = saved.sets["net"]
    # what fc2's and relu's backward need: relu's output (4 x 16 floats, 256 bytes) at least,
    # and nothing larger than the whole forward's activations
    total = sum(b for _, b in first)
    assert any(b == 4 * 16 * 4 for _, b in first), first
    assert 0 < total <= 4 * 8 * 4 + 2 * 4 * 16 * 4 + 4 * 4 * 4 + 16 * 8 * 4 + 4 * 16 * 4, first
