"""The JSON document of a `CostGraph`, checked field by field.

`graph_fields` turns a parsed document into the `CostGraph` constructor's arguments, checking
every field's type, sign, finiteness and size (`checks.Checks`); `check_references` checks
what holds between fields (every node, storage and event a field names exists; each storage is
allocated once, by its producer, before it is freed; backward frees only live gradients) and
runs on every `CostGraph`, loaded or built. Each failure is a `CostGraphError` naming the
field, e.g. ``nodes[3].time_s: -4.0 is negative (a time in seconds)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checks import MAX_BYTES, Checks
from .nodes import BwdStep, CostGraphError, Node, Saved, Storage, WrittenRead

if TYPE_CHECKING:
    from .graph import CostGraph

__all__ = ["CHECKPOINT_COSTS", "SCHEMA", "SOURCE_PREFIXES", "VERSION", "check_references",
           "check_version", "graph_fields"]

SCHEMA = "scheduler.costgraph"
VERSION = 1

_C = Checks(CostGraphError)
#: the graph-level byte counts
_BYTES = ("param_bytes", "buffer_bytes", "input_bytes", "grad_bytes", "measured_peak_bytes")
#: the per-checkpoint costs a `CostGraph` may carry (optional in JSON)
CHECKPOINT_COSTS = ("checkpoint_call_s", "checkpoint_saved_s")
_TOP = frozenset({"schema", "version", "name", "fingerprint", *_BYTES, "measured_step_s",
                  *CHECKPOINT_COSTS, "meta", "nodes", "storages", "fwd_events", "bwd_steps",
                  "written_reads", "units", "engine_bytes"})
_NODE_STR = ("name", "op", "target", "module_path", "block", "shape")
_NODE_FIELDS = frozenset({*_NODE_STR, "inputs", "is_loss", "time_s", "bwd_time_s",
                          "out_bytes", "saved", "pack_mark", "sac_s",
                          "flop_share"})
#: where a saved tensor that no node produced comes from (`Saved.source`)
SOURCE_PREFIXES = ("param:", "buffer:", "input:")


def check_version(d: dict[str, Any]) -> None:
    """The document's schema and version are the ones this code reads."""
    if d.get("schema") != SCHEMA:
        _C.fail("schema", f"expected {SCHEMA!r}, got {d.get('schema')!r}")
    v = d.get("version")
    if isinstance(v, int) and not isinstance(v, bool) and v > VERSION:
        _C.fail("version", f"the file has version {v}, newer than the {VERSION} this scheduler "
                "reads; upgrade scheduler (`pip install -U scheduler`)")
    if v != VERSION or isinstance(v, bool):
        _C.fail("version", f"this scheduler reads version {VERSION}, the file has {v!r}; "
                "re-profile the model with `scheduler profile`")


def graph_fields(d: Any) -> tuple[dict[str, Any], str | None]:
    """The `CostGraph` arguments in document ``d`` and the fingerprint it records (None if
    none), every field checked."""
    if not isinstance(d, dict):
        raise CostGraphError(f"expected a JSON object, got {type(d).__name__}")
    check_version(d)
    _C.fields("", d, _TOP)
    nodes = [_node(i, nd) for i, nd in enumerate(_C.type("nodes", _C.key(d, "nodes"), list))]
    if not nodes:
        _C.fail("nodes", "empty; a graph has at least one node")
    if all(n.is_loss for n in nodes):
        _C.fail("nodes", "every node is a loss node (is_loss); a graph needs a model node")
    storages: dict[int, Storage] = {}
    for i, row in enumerate(_C.type("storages", _C.key(d, "storages"), list)):
        st = _storage(f"storages[{i}]", row)
        if st.id in storages:
            _C.fail(f"storages[{i}].id", f"storage {st.id} appears twice")
        storages[st.id] = st
    fwd_events = {}
    for name, evs in _C.type("fwd_events", _C.key(d, "fwd_events"), dict).items():
        where = f"fwd_events[{name!r}]"
        fwd_events[name] = [_fwd_event(f"{where}[{j}]", e)
                            for j, e in enumerate(_C.type(where, evs, list))]
    bwd_steps = [_bwd_step(f"bwd_steps[{i}]", row)
                 for i, row in enumerate(_C.type("bwd_steps", _C.key(d, "bwd_steps"), list))]
    meta = _C.type("meta", _C.key(d, "meta"), dict)
    _C.type("meta.loss_node", meta.get("loss_node", ""), str)
    _C.type("meta.profile", meta.get("profile", {}), dict)
    kw: dict[str, Any] = {k: _C.bytes(k, _C.key(d, k)) for k in _BYTES}
    total = (sum(kw.values()) + sum(s.bytes for s in storages.values())
             + sum(b for st in bwd_steps for _, _, b in st.events))
    if total > 4 * MAX_BYTES:
        _C.fail("storages", f"the graph's byte counts add up to {total}, more than "
                f"{4 * MAX_BYTES}; not a real step")
    kw.update(
        name=_C.type("name", _C.key(d, "name"), str), nodes=nodes, storages=storages,
        fwd_events=fwd_events, bwd_steps=bwd_steps, meta=meta,
        measured_step_s=_C.seconds("measured_step_s", _C.key(d, "measured_step_s")),
        # optional: graphs recorded before these were measured load with zero
        **{k: _C.seconds(k, d[k]) for k in CHECKPOINT_COSTS if k in d})
    # optional: graphs recorded before these were, or of models without in-place writes
    kw["written_reads"] = tuple(
        WrittenRead(*(_C.type(f"written_reads[{i}][{j}]", x, str) for j, x in
                      enumerate(_C.row(f"written_reads[{i}]", row, 3,
                                       "[reader, value, writer]"))))
        for i, row in enumerate(_C.type("written_reads", d.get("written_reads", []), list)))
    kw["units"] = tuple(_C.type(f"units[{i}]", x, str)
                        for i, x in enumerate(_C.type("units", d.get("units", []), list)))
    kw["engine_bytes"] = {
        k: tuple(_C.bytes(f"engine_bytes[{k!r}]", x)
                 for x in _C.row(f"engine_bytes[{k!r}]", v, 2, "[held, spike]"))
        for k, v in _C.type("engine_bytes", d.get("engine_bytes", {}), dict).items()}
    fp = d.get("fingerprint")
    return kw, _C.type("fingerprint", fp, (str, type(None)))


def _node(i: int, nd: Any) -> Node:
    where = f"nodes[{i}]"
    _C.type(where, nd, dict)
    _C.fields(where, nd, _NODE_FIELDS)
    for k in ("name", "op", "target"):
        _C.key(nd, k, f"{where}.")
    kw: dict[str, Any] = {k: _C.type(f"{where}.{k}", nd[k], str) for k in _NODE_STR if k in nd}
    if not kw["name"]:
        _C.fail(f"{where}.name", "empty; every node has a name")
    kw["inputs"] = tuple(_C.strings(f"{where}.inputs", _C.key(nd, "inputs", f"{where}.")))
    if "is_loss" in nd:
        kw["is_loss"] = _C.type(f"{where}.is_loss", nd["is_loss"], bool)
    for k in ("time_s", "bwd_time_s"):
        if k in nd:
            kw[k] = _C.seconds(f"{where}.{k}", nd[k])
    if "out_bytes" in nd:
        kw["out_bytes"] = _C.bytes(f"{where}.out_bytes", nd["out_bytes"])
    saved = []
    for j, s in enumerate(_C.type(f"{where}.saved", _C.key(nd, "saved", f"{where}."),
                                           list)):
        w = f"{where}.saved[{j}]"
        src, sid, b = _C.row(w, s, 3, "[source, storage, bytes]")
        saved.append(Saved(_C.type(f"{w}.source", src, str),
                           _C.count(f"{w}.storage", sid, optional=True), _C.bytes(f"{w}.bytes", b)))
    kw["saved"] = tuple(saved)
    kw["pack_mark"] = _C.count(f"{where}.pack_mark", nd.get("pack_mark"), optional=True)
    kw["sac_s"] = _C.seconds(f"{where}.sac_s", nd.get("sac_s"), optional=True)
    share = _C.number(f"{where}.flop_share", nd.get("flop_share"), optional=True)
    if share is not None and not 0 <= share <= 1:
        _C.fail(f"{where}.flop_share", f"{share!r} is not a fraction in [0, 1]")
    kw["flop_share"] = None if share is None else float(share)
    return Node(**kw)


def _storage(where: str, row: Any) -> Storage:
    sid, b, prod, out, inner, last, savers, views = _C.row(
        where, row, 8, "[id, bytes, producer, output, inner_free, last_use, savers, views]")
    return Storage(_C.count(f"{where}.id", sid), _C.bytes(f"{where}.bytes", b),
                   _C.type(f"{where}.producer", prod, str), _C.type(f"{where}.output", out, bool),
                   _C.type(f"{where}.inner_free", inner, bool),
                   _C.type(f"{where}.last_use", last, str),
                   tuple(_C.strings(f"{where}.savers", savers)),
                   tuple(_C.strings(f"{where}.views", views)))


def _fwd_event(where: str, e: Any) -> tuple[str, int]:
    kind, sid = _C.row(where, e, 2, '["a" or "f", storage id]')
    if kind not in ("a", "f"):
        _C.fail(f"{where}.kind", f"{kind!r} is not an event kind ('a' allocates, 'f' frees)")
    return kind, _C.count(f"{where}.storage", sid)


def _bwd_step(where: str, row: Any) -> BwdStep:
    node, t, evs = _C.row(where, row, 3, "[node, time_s, events]")
    events = []
    for j, e in enumerate(_C.type(f"{where}.events", evs, list)):
        w = f"{where}.events[{j}]"
        kind, gid, b = _C.row(w, e, 3, '["a" or "f", gradient id, bytes]')
        if kind not in ("a", "f"):
            _C.fail(f"{w}.kind", f"{kind!r} is not an event kind ('a' allocates, 'f' frees)")
        events.append((kind, _C.count(f"{w}.gradient", gid), _C.bytes(f"{w}.bytes", b)))
    return BwdStep(_C.type(f"{where}.node", node, str), _C.seconds(f"{where}.time_s", t),
                   tuple(events))


def check_references(g: CostGraph, pos: dict[str, int]) -> None:
    """What holds between ``g``'s fields, for a graph whose nodes are at positions ``pos``:
    saved tensors name known nodes or sources and known storages; each storage is allocated
    once in forward, by its producer, and freed only after that, not last used before it is
    made; backward frees only gradients it allocated and has steps when there are nodes."""
    for n in g.nodes:
        for s in n.saved:
            if s.source not in pos and not s.source.startswith(SOURCE_PREFIXES):
                _C.fail(f"nodes[{n.name!r}].saved", f"unknown source {s.source!r} (a node, or "
                        f"{', '.join(p + '<name>' for p in SOURCE_PREFIXES)})")
    for sid, st in g.storages.items():
        if st.producer in pos and st.last_use in pos and pos[st.last_use] < pos[st.producer]:
            _C.fail(f"storages[{sid}].last_use", f"{st.last_use!r} runs before its producer "
                    f"{st.producer!r}")
    made: dict[int, str] = {}
    order = sorted(g.fwd_events, key=lambda k: pos.get(k, -1))
    for name in order:
        for kind, sid in g.fwd_events[name]:
            where = f"fwd_events[{name!r}]"
            if kind not in ("a", "f"):
                _C.fail(where, f"{kind!r} is not an event kind ('a' allocates, 'f' frees)")
            if sid not in g.storages:
                _C.fail(where, f"unknown storage {sid} (no entry in storages)")
            if kind == "a":
                if sid in made:
                    _C.fail(where, f"storage {sid} is allocated again (first by {made[sid]!r})")
                if g.storages[sid].producer != name:
                    _C.fail(where, f"allocates storage {sid}, whose producer is "
                            f"{g.storages[sid].producer!r}")
                made[sid] = name
            elif sid not in made:
                _C.fail(where, f"frees storage {sid} before it is allocated")
    missing = sorted(set(g.storages) - set(made))
    if missing:
        _C.fail(f"storages[{missing[0]}]", "never allocated in fwd_events (by its producer "
                f"{g.storages[missing[0]].producer!r})")
    if g.nodes and not g.bwd_steps:
        _C.fail("bwd_steps", "empty; a graph with nodes has at least one backward step")
    live: set[int] = set()
    for i, step in enumerate(g.bwd_steps):
        for j, (kind, gid, _) in enumerate(step.events):
            where = f"bwd_steps[{i}].events[{j}]"
            if kind not in ("a", "f"):
                _C.fail(where, f"{kind!r} is not an event kind ('a' allocates, 'f' frees)")
            if kind == "a" and gid in live:
                _C.fail(where, f"gradient {gid} is allocated again while alive")
            if kind == "f" and gid not in live:
                _C.fail(where, f"frees gradient {gid}, which no earlier step allocated")
            (live.add if kind == "a" else live.discard)(gid)
    loss = g.meta.get("loss_node")
    if loss is not None and loss not in pos:
        _C.fail("meta.loss_node", f"unknown node {loss!r}")
