"""Running a traced graph node by node, the way profiling and the rewritten module both do.

A `Program` evaluates the nodes of a `trace`d ``GraphModule`` against the module's own
attributes (which are the user's parameter objects), frees each value after its last reader,
and splits the output into the model's output and the loss. Profiling instruments it;
`rewrite` runs slices of it as checkpoint regions. Keeping one executor means the profiled
lifetimes are the lifetimes the rewritten module has.

The graph's attributes (``get_attr`` nodes: parameters and buffers the graph reads directly)
are looked up on a live module at every read, never kept: a wrapper that swaps parameters by
``setattr`` (FSDP2's ``fully_shard`` installs the unsharded parameters before each forward)
is seen by the next run. With a ``root``, an attribute ``model.<path>`` is read as
``root.<path>``, so the module the user wraps is the one whose attributes count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .autocast_cache import cache_off, caches_casts
from .trace import MODEL_ATTR, TraceInfo, model_nodes, module_path
from .usercode import unit_paths

__all__ = ["Program"]


class Program:
    """The executable form of a traced step. ``nodes`` are in execution order.

    Args:
        gm: a graph from `trace`.
        root: the module that stands for the traced model at run time (the rewritten module,
            which a user may wrap in FSDP2): an attribute ``model.<path>`` of the graph is
            read as ``root.<path>`` wherever ``root`` holds, at construction, the very object
            the graph was traced with; other attributes (and all of them without a ``root``)
            are read from ``gm``.
        like: the program of an identical module's trace (`units.share`), whose ``gm``
            this one is: its attributes are read from ``root`` where ``like``'s are read
            from its own (``root`` must hold them: AttributeError where it does not).
    """

    def __init__(self, gm: fx.GraphModule, root: nn.Module | None = None, *,
                 like: "Program | None" = None):
        if like is not None:
            assert root is not None and gm is like.gm
            if any(n.op == "call_module" for n in gm.graph.nodes):  # (``root``'s modules)
                gm = _without(gm, set(), modules_from=root)
            self._attr_paths = {k: (gm, p) if b is like.gm else (root, p)
                                for k, (b, p) in like._attr_paths.items()}
            for base, parts in self._attr_paths.values():
                _walk(base, parts)  # (raises where ``root`` lacks one)
        else:
            self._attr_paths = {n.name: _attr_path(gm, root, n.target)
                                for n in gm.graph.nodes if n.op == "get_attr"}
            live = {n.target for n in gm.graph.nodes
                    if n.op == "get_attr" and self._attr_paths[n.name][0] is root}
            if live:  # (``gm`` would keep the traced objects alive: a copy that does not)
                gm = _without(gm, live)
                self._attr_paths = {k: v if v[0] is root else (gm, v[1])
                                    for k, v in self._attr_paths.items()}
        self.gm = gm
        self.info: TraceInfo = gm.meta["scheduler"]
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.nodes = model_nodes(gm)
        self.by_name = {n.name: n for n in self.nodes}
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        out_leaves = pytree.tree_leaves(self.output.args[0])
        self.model_out_leaves = out_leaves[:-1]
        self.loss_leaf = out_leaves[-1]
        self.model_out_spec = self.info.out_spec.child(0)
        pos = {n: i for i, n in enumerate(self.nodes)}
        end = len(self.nodes)
        # last position at which each value is read; model outputs live to the end of forward
        self.last_read: dict[str, int] = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                self.last_read[a.name] = max(self.last_read.get(a.name, -1), pos[n])
        for leaf in out_leaves:
            if isinstance(leaf, fx.Node):
                self.last_read[leaf.name] = end
        self.pos = pos

    @property
    def attrs(self) -> Mapping[str, Any]:
        """``get_attr`` node name -> its value, read from the live module on each access (a
        read-only view: reading one attribute walks only its own path)."""
        return _LiveAttrs(self._attr_paths)

    @property
    def called_modules(self) -> list[str]:
        """Qualified names, relative to the model, of the submodules the graph calls as modules
        (``call_module`` nodes, fx leaf modules): theirs are the only hooks a run fires."""
        prefix = MODEL_ATTR + "."
        return list(dict.fromkeys(
            n.target.removeprefix(prefix) for n in self.nodes if n.op == "call_module"))

    def inputs_env(self, inputs: Iterable[Any]) -> dict[str, Any]:
        """The environment before any node runs: placeholders and attributes."""
        flat = pytree.tree_leaves(tuple(inputs))
        if len(flat) != len(self.placeholders):
            raise TypeError(f"the traced model takes {len(self.placeholders)} inputs, got "
                            f"{len(flat)}")
        env = {p.name: v for p, v in zip(self.placeholders, flat)}
        env.update(self.attrs)
        return env

    def run_node(self, node: fx.Node, env: dict[str, Any]) -> Any:
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: env[a.name])
        if node.op == "call_module":
            return self.gm.get_submodule(node.target)(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        self_obj, *rest = args  # call_method
        return getattr(self_obj, node.target)(*rest, **kwargs)

    def free_after(self, i: int, env: dict[str, Any]) -> None:
        """Drop every value whose last reader is the node at position ``i``."""
        node = self.nodes[i]
        for a in (*node.all_input_nodes, node):
            if self.last_read.get(a.name, -1) <= i and a.name in env and a.op != "get_attr":
                del env[a.name]

    def planned(self) -> frozenset[str]:
        """The nodes a plan of this step runs itself (`regions.CheckpointedStep`), with
        autocast's cache off (`autocast_cache.cache_off`): while a units plan's step is
        profiled (`usercode.within_units`), those inside its units; else every node but the
        loss's (which the user's code computes)."""
        units = unit_paths()
        if not units:
            return frozenset(n.name for n in self.nodes if n.name not in self.info.loss_nodes)
        inside = tuple(u + "." for u in units)
        return frozenset(n.name for n in self.nodes
                         if (p := module_path(n)) in units or p.startswith(inside))

    def run(self, inputs: Iterable[Any], *,
            around: Callable[[int, fx.Node, Callable[[], Any]], Any] | None = None
            ) -> tuple[Any, torch.Tensor]:
        """Run the whole step and return ``(model_output, loss)``. ``around(i, node, thunk)``,
        when given, wraps each node's execution (for timing and attribution). Under autocast
        with its cache on, the nodes a plan runs (`planned`) run with the cache off, as the
        plan runs them."""
        env = self.inputs_env(inputs)
        uncached = self.planned() if caches_casts() else frozenset()
        for i, node in enumerate(self.nodes):
            with cache_off() if node.name in uncached else contextlib.nullcontext():
                if around is None:
                    env[node.name] = self.run_node(node, env)
                else:
                    env[node.name] = around(i, node, lambda n=node: self.run_node(n, env))
            self.free_after(i, env)
        return self.outputs(env)

    def outputs(self, env: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        """``(model_output, loss)`` from a finished environment."""
        return self.model_output(env), _val(self.loss_leaf, env)

    def model_output(self, env: dict[str, Any]) -> Any:
        """The model's output (in its own structure) from an environment."""
        return pytree.tree_unflatten([_val(x, env) for x in self.model_out_leaves],
                                     self.model_out_spec)


def _val(leaf: Any, env: dict[str, Any]) -> Any:
    return env[leaf.name] if isinstance(leaf, fx.Node) else leaf


class _LiveAttrs(Mapping[str, Any]):
    """A read-only mapping whose values are looked up on their modules when read."""

    __slots__ = ("_paths",)

    def __init__(self, paths: dict[str, tuple[Any, tuple[str, ...]]]):
        self._paths = paths

    def __getitem__(self, name: str) -> Any:
        base, parts = self._paths[name]
        return _walk(base, parts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def _walk(obj: Any, parts: tuple[str, ...]) -> Any:
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _without(gm: fx.GraphModule, live: set[str], modules_from: nn.Module | None = None
             ) -> fx.GraphModule:
    """A copy of ``gm`` (graph, node names and metadata) that holds none of the ``live``
    attributes, which are read from the planned module at every run (a placeholder on the
    meta device stands for each): so that what the graph was traced with (the parameters
    before ``fully_shard`` swapped its shards in) is not kept alive by the plan. With
    ``modules_from``, the modules it calls (``call_module``, fx leaves) are that module's at
    the same paths (`Program`'s ``like``)."""
    holder = nn.Module()
    made = {id(holder)}  # (modules of its own: a module of the user's is never written to)
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module"):
            *prefix, field = str(n.target).split(".")
            owner = holder
            for part in prefix:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                    made.add(id(getattr(owner, part)))
                owner = getattr(owner, part)
            if id(owner) not in made:
                continue  # (inside a module the graph calls: the user's, read live already)
            if n.target in live:
                value = torch.empty(0, device="meta")
            elif (n.op == "call_module" and modules_from is not None and prefix
                  and prefix[0] == MODEL_ATTR):
                value = _walk(modules_from, tuple(prefix[1:]) + (field,))
            else:
                value = _walk(gm, (*prefix, field))
            if isinstance(value, nn.Module):
                owner.add_module(field, value)
            elif isinstance(value, torch.Tensor):
                owner.register_buffer(field, value)
            else:
                setattr(owner, field, value)
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(holder, graph, class_name=type(gm).__name__)
    copy.meta = dict(gm.meta)
    return copy


def _attr_path(gm: fx.GraphModule, root: nn.Module | None, target: str
               ) -> tuple[Any, tuple[str, ...]]:
    """Where to read attribute ``target`` at run time: ``(base, path)``. On ``root`` when it
    holds the traced object under the model-relative path (export's lifted constants, for
    one, are not attributes of the model), else on ``gm``."""
    parts = tuple(target.split("."))
    traced = _walk(gm, parts)
    if root is not None and len(parts) > 1 and parts[0] == MODEL_ATTR:
        try:
            live = _walk(root, parts[1:])
        except AttributeError:
            live = None
        if live is traced:
            return root, parts[1:]
    return gm, parts
