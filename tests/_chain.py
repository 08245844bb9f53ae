"""Hand-made chain `CostGraph`s for the solver and solve-API tests (torch-free).

``chain(["", "", "h.0", "h.0", "h.1", "h.1", ""])`` is a chain of compute nodes ``n0, n1, ...``
(one per entry, the entry being its ``Node.block``) followed by a loss node. Each node allocates
one output storage that the next node saves for backward (as a linear layer saves its input);
backward runs the nodes in reverse, passing one gradient along.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.ir.graph import BwdStep, CostGraph, Node, Saved, Storage


def chain(blocks: Sequence[str], *, out_bytes: Sequence[int] | int = 1000,
          time_s: Sequence[float] | float = 1e-3, name: str = "chain") -> CostGraph:
    n = len(blocks)
    sizes = list(out_bytes) if not isinstance(out_bytes, int) else [out_bytes] * n
    times = list(time_s) if not isinstance(time_s, (int, float)) else [float(time_s)] * n
    assert len(sizes) == n and len(times) == n, (len(sizes), len(times), n)
    names = [f"n{i}" for i in range(n)]
    nodes, storages, events = [], {}, {}
    for i, nm in enumerate(names):
        saved = ((Saved("input:0", None, 64),) if i == 0
                 else (Saved(names[i - 1], i - 1, sizes[i - 1]),))
        nodes.append(Node(nm, "call_function", "f", (names[i - 1],) if i else (),
                          module_path=blocks[i], block=blocks[i], time_s=times[i],
                          bwd_time_s=2 * times[i], out_bytes=sizes[i], saved=saved,
                          shape=f"f32[{sizes[i] // 4}]"))
        last = names[i + 1] if i + 1 < n else "loss"
        storages[i] = Storage(i, sizes[i], nm, True, False, last,
                              savers=(names[i + 1],) if i + 1 < n else ())
        events[nm] = [("a", i)]
    nodes.append(Node("loss", "call_method", "mean", (names[-1],), is_loss=True, time_s=1e-6,
                      out_bytes=4, shape="f32[]"))
    storages[n] = Storage(n, 4, "loss", True, False, "loss")
    events["loss"] = [("a", n)]
    steps = [BwdStep("", 1e-6, (("a", 0, 4),)),
             BwdStep("loss", 1e-6, (("a", 1, sizes[-1]), ("f", 0, 0)))]
    for i in reversed(range(n)):
        ev = ((("a", n - i + 1, sizes[i - 1]),) if i else ()) + (("f", n - i, 0),)
        steps.append(BwdStep(names[i], 2 * times[i], ev))
    return CostGraph(name=name, nodes=nodes, storages=storages, fwd_events=events,
                     bwd_steps=steps, param_bytes=500, input_bytes=64, grad_bytes=500,
                     measured_step_s=3 * sum(times))
