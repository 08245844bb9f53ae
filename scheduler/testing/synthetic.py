"""Synthetic `CostGraph`s that look like a profiled training step, for tests and benchmarks.

Torch-free. `random_graph` builds compute nodes ``n0 .. n{k-1}`` in execution order followed by
one loss node, with the same kinds of records `profile` writes for a real model:

* every node allocates one output storage (4 KiB .. 256 KiB); some allocate an op temporary
  first that they free before finishing (``inner_free``), some a small internal storage that
  they save for their own backward (as LayerNorm saves its mean and rstd);
* ``chain`` graphs read only the previous node; ``dag`` graphs also read, with probability
  ``skip_prob``, one earlier node (skip connections, as in a U-Net; several may be live at once);
* each node saves a random subset (usually all) of its inputs' storages, sometimes its own
  output (as ReLU does), and its parameters, if it has any;
* backward runs a step per node in reverse order (the loss first), after a seed-gradient step:
  a gradient per input is allocated, the gradients of the node's own output are freed, and the
  gradients of its parameters are allocated and kept;
* a checkpoint call costs up to 0.3 ms and each tensor saved in a recompute region up to
  30 us (`CostGraph.checkpoint_call_s`, `checkpoint_saved_s`).

Peak and step time "measured" are the simulator's own for the unscheduled step.
"""

from __future__ import annotations

import random

from ..cost.simulate import simulate
from ..ir.graph import BwdStep, CostGraph, Node, Saved, Storage
from ..ir.schedule import Schedule

__all__ = ["random_graph", "large_dag"]

KINDS = ("chain", "dag")
_TARGETS = ("linear", "relu", "gelu", "layer_norm", "conv2d", "add", "mul", "softmax", "matmul")


def random_graph(n_nodes: int, *, kind: str = "chain", seed: int = 0, block_size: int = 4,
                 skip_prob: float = 0.3) -> CostGraph:
    """A random, valid `CostGraph` with ``n_nodes`` compute nodes plus one loss node.

    Same arguments, same graph. ``kind`` is ``"chain"`` (each node reads the previous one)
    or ``"dag"`` (plus, with probability ``skip_prob``, one earlier node). Nodes are grouped
    into blocks of ``block_size`` (``Node.block == "blocks.<i // block_size>"``).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be at least 1, got {n_nodes}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not 0.0 <= skip_prob <= 1.0:
        raise ValueError(f"skip_prob must be in [0, 1], got {skip_prob}")
    rng = random.Random(f"{kind}:{n_nodes}:{seed}:{block_size}:{skip_prob}")
    cost_rng = random.Random(f"checkpoint costs:{kind}:{n_nodes}:{seed}:{block_size}:{skip_prob}")

    def nbytes(lo: int = 4096, hi: int = 262144) -> int:
        return rng.randrange(lo // 4, hi // 4 + 1) * 4

    names = [f"n{i}" for i in range(n_nodes)]
    loss = "loss"
    input_bytes = nbytes()

    # -- structure: who reads whom --------------------------------------------------------
    inputs: list[tuple[str, ...]] = []
    for i in range(n_nodes):
        ins = [names[i - 1]] if i > 0 else []
        if kind == "dag" and i >= 2 and rng.random() < skip_prob:
            ins.insert(0, names[rng.randrange(0, i - 1)])
        inputs.append(tuple(ins))
    users: dict[str, list[str]] = {nm: [] for nm in (*names, loss)}
    for nm, ins in zip(names, inputs):
        for u in ins:
            users[u].append(nm)
    users[names[-1]].append(loss)

    # -- forward: storages and events -----------------------------------------------------
    storages: dict[int, dict] = {}  # sid -> Storage fields, savers filled in below
    fwd_events: dict[str, list[tuple[str, int]]] = {}
    out_sid: dict[str, int] = {}
    own_saved: dict[str, list[Saved]] = {nm: [] for nm in (*names, loss)}
    sizes: dict[str, int] = {}

    def new_storage(producer: str, b: int, *, output: bool, inner_free: bool) -> int:
        sid = len(storages)
        storages[sid] = dict(id=sid, bytes=b, producer=producer, output=output,
                             inner_free=inner_free, last_use=producer, savers=[])
        return sid

    for nm in names:
        events: list[tuple[str, int]] = []
        tmp = None
        if rng.random() < 0.25:  # an op temporary (a workspace), freed inside the op
            tmp = new_storage(nm, nbytes(), output=False, inner_free=True)
            events.append(("a", tmp))
        b = nbytes()
        sizes[nm] = b
        out_sid[nm] = new_storage(nm, b, output=True, inner_free=False)
        events.append(("a", out_sid[nm]))
        if rng.random() < 0.2:  # statistics the op saves for its own backward (LayerNorm)
            stat = new_storage(nm, rng.randrange(16, 1025) * 4, output=False, inner_free=False)
            events.append(("a", stat))
            own_saved[nm].append(Saved(nm, stat, storages[stat]["bytes"]))
        if tmp is not None:
            events.append(("f", tmp))
        fwd_events[nm] = events
    sizes[loss] = 4
    out_sid[loss] = new_storage(loss, 4, output=True, inner_free=False)
    fwd_events[loss] = [("a", out_sid[loss])]

    # -- what each node saves for backward --------------------------------------------------
    params: dict[str, tuple[str, int]] = {}
    saved: dict[str, list[Saved]] = {}
    for i, nm in enumerate(names):
        sv: list[Saved] = []
        if i == 0 and rng.random() < 0.8:
            sv.append(Saved("input:0", None, input_bytes))
        for u in inputs[i]:
            if rng.random() < 0.75:  # usually an op saves its inputs
                sv.append(Saved(u, out_sid[u], sizes[u]))
        if rng.random() < 0.2:  # saves its own output, as relu does
            sv.append(Saved(nm, out_sid[nm], sizes[nm]))
        sv.extend(own_saved[nm])
        if rng.random() < 0.5 or (i == 0 and not sv):
            pname = f"blocks.{i // block_size}.{nm}.weight"
            params[nm] = (pname, nbytes(1024, 65536))
            sv.append(Saved(f"param:{pname}", None, params[nm][1]))
        rng.shuffle(sv)
        saved[nm] = sv
    saved[loss] = ([Saved(names[-1], out_sid[names[-1]], sizes[names[-1]])]
                   if rng.random() < 0.5 else [])
    for nm, sv in saved.items():
        for s in sv:
            if s.storage is not None:
                storages[s.storage]["savers"].append(nm)
    order = {nm: i for i, nm in enumerate((*names, loss))}
    for nm in (*names, loss):
        if users[nm]:
            storages[out_sid[nm]]["last_use"] = max(users[nm], key=order.__getitem__)

    # -- nodes ----------------------------------------------------------------------------
    nodes: list[Node] = []
    bwd_time: dict[str, float] = {}
    for i, nm in enumerate(names):
        blk = f"blocks.{i // block_size}"
        t = rng.uniform(1e-5, 1e-3)
        bwd_time[nm] = rng.uniform(1e-5, 2e-3)
        nodes.append(Node(
            name=nm, op="call_function", target=rng.choice(_TARGETS), inputs=inputs[i],
            module_path=blk, block=blk, time_s=t, bwd_time_s=bwd_time[nm],
            out_bytes=sum(storages[sid]["bytes"] for k, sid in fwd_events[nm]
                          if k == "a" and storages[sid]["output"]),
            saved=tuple(saved[nm]), shape=f"f32[{sizes[nm] // 4}]"))
    bwd_time[loss] = rng.uniform(1e-6, 1e-4)
    nodes.append(Node(name=loss, op="call_method", target="mean", inputs=(names[-1],),
                      is_loss=True, time_s=rng.uniform(1e-6, 1e-4), bwd_time_s=bwd_time[loss],
                      out_bytes=4, saved=tuple(saved[loss]), shape="f32[]"))

    # -- backward ---------------------------------------------------------------------------
    gid = 0
    seed_time = rng.uniform(1e-6, 1e-4)
    steps = [BwdStep("", seed_time, (("a", gid, 4),))]
    pending: dict[str, list[int]] = {nm: [] for nm in (*names, loss)}  # grads of outputs
    pending[loss].append(gid)
    gid += 1
    grad_bytes = 0
    all_inputs = dict(zip(names, inputs))
    all_inputs[loss] = (names[-1],)
    for nm in reversed((*names, loss)):
        if not saved[nm] and not all_inputs[nm]:
            continue
        ev: list[tuple[str, int, int]] = []
        for u in all_inputs[nm]:
            ev.append(("a", gid, sizes[u]))
            pending[u].append(gid)
            gid += 1
        if nm in params:  # the parameter's gradient, kept after the step
            ev.append(("a", gid, params[nm][1]))
            grad_bytes += params[nm][1]
            gid += 1
        ev.extend(("f", g, 0) for g in pending.pop(nm))
        steps.append(BwdStep(nm, bwd_time[nm], tuple(ev)))

    graph = CostGraph(
        name=f"synthetic-{kind}-{n_nodes}-{seed}",
        nodes=nodes,
        storages={sid: Storage(**{**f, "savers": tuple(f["savers"])})
                  for sid, f in storages.items()},
        fwd_events=fwd_events,
        bwd_steps=steps,
        param_bytes=sum(b for _, b in params.values()),
        buffer_bytes=0,
        input_bytes=input_bytes,
        grad_bytes=grad_bytes,
        measured_step_s=sum(n.time_s for n in nodes) + sum(s.time_s for s in steps),
        # from their own stream, so that the structure above stays what it was before they
        # were added: up to a third of a slow node per checkpoint call, 30 us per saved tensor
        checkpoint_call_s=cost_rng.uniform(0.0, 3e-4),
        checkpoint_saved_s=cost_rng.uniform(0.0, 3e-5),
        meta={"synthetic": {"kind": kind, "n_nodes": n_nodes, "seed": seed,
                            "block_size": block_size, "skip_prob": skip_prob}},
    )
    graph.measured_peak_bytes = simulate(graph, Schedule.none(graph)).peak_bytes
    return graph


def large_dag(n_nodes: int = 2000, seed: int = 0) -> CostGraph:
    """A large random DAG (`random_graph` with ``kind="dag"``), for benchmarks."""
    return random_graph(n_nodes, kind="dag", seed=seed)
