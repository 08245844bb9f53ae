"""What the verbs of the command line share: exit codes, argument types, output paths, the
spinner, and the profiler hook.

Every verb module (``profile``, ``solve``, ...) has ``add_parser(subparsers)``, which builds
its parser and sets ``func`` to its ``run(args) -> int``. Errors a user can fix are the
`USER_ERRORS`; ``main`` prints them as one line and exits with `EXIT_USAGE`.
"""

# Imports deferred into functions (in scheduler/cli/ only) keep torch out of `scheduler --help`.

from __future__ import annotations

import argparse
import errno
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.cli.spec import SpecError, split_spec
from scheduler.quantities import check_time_limit

__all__ = ["EXIT_BUG", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "PROG", "USER_ERRORS",
           "add_json_and_quiet", "add_model_spec", "add_parallel_option", "add_profile_options",
           "add_solver_options", "add_units_option", "units_arg",
           "default_out", "describe_user_error", "fraction", "int_list", "names",
           "need_matplotlib", "positive_float", "positive_int", "prepare_out", "profile_model",
           "profile_options", "run_quietly_or_not", "time_limit", "user_errors"]

PROG = "scheduler"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130

#: errors that print one line and exit with EXIT_USAGE (``--debug`` shows the trace), by type:
#: every ValueError (`SpecError`, ``ScheduleError``, ``CostGraphError``,
#: ``InfeasibleBudgetError``, ``FakeProfileError``, ``RejectedInputsError``, a bad value, a file
#: that is not UTF-8 or not JSON) and every OSError (a missing file, a directory where a file
#: was expected, no permission, a full disk); `user_errors` adds the ones of torch's modules
USER_ERRORS: tuple[type[BaseException], ...] = (SpecError, ValueError, OSError)


def user_errors() -> tuple[type[BaseException], ...]:
    """`USER_ERRORS`, plus the user errors that live with torch: ``TraceError`` (a model the
    tracers cannot capture) and ``torch.OutOfMemoryError`` (a step that does not fit).
    Called only once an error has happened, so that ``scheduler --help`` does not import
    torch."""
    import torch

    from scheduler.capture.trace import TraceError

    return (*USER_ERRORS, TraceError, torch.OutOfMemoryError)


def describe_user_error(exc: BaseException) -> str:
    """The one line printed for a user error: its message on one line, with the file and the
    fix for an OSError (whose own text is ``[Errno 28] No space left on device``)."""
    if isinstance(exc, OSError) and exc.strerror:
        where = " -> ".join(repr(str(f)) for f in (exc.filename, exc.filename2) if f)
        fix = {"ENOSPC": "free some space or write elsewhere",
               "EFBIG": "raise the file-size limit (ulimit -f) or write elsewhere",
               "ENAMETOOLONG": "use a shorter file name",
               "EACCES": "check its permissions or write elsewhere",
               "EPERM": "check its permissions or write elsewhere",
               "EROFS": "write elsewhere", "ENOENT": "check the path",
               "EISDIR": "give a file, not a directory",
               "ENOTDIR": "a folder in the path is a file; check the path"}
        name = errno.errorcode.get(exc.errno or 0, "")
        text = f"{exc.strerror}: {where}" if where else exc.strerror
        return f"{text} ({fix.get(name, 'check the path')})"
    return " ".join(str(exc).split()) or type(exc).__name__


def profile_model(model: Any, inputs: tuple[Any, ...], *, loss_fn: Any, repeats: int | None,
                  units: Any = "default", **options: Any) -> Any:
    """The `CostGraph` `scheduler.solve` would plan for ``units`` (`scheduler.profile`, as
    from Python), with the profiler's default ``repeats`` where None, and the
    `profile_options` given; the tests replace this hook with a fake (the ``profile`` verb
    looks it up at each call)."""
    from scheduler.plan import profile

    kwargs: dict[str, Any] = {"loss_fn": loss_fn, **options}
    if repeats is not None:
        kwargs["repeats"] = repeats
    return profile(model, inputs, units=units, **kwargs)


def add_units_option(parser: argparse.ArgumentParser) -> None:
    """``--units``: which submodules a plan takes over (`units.find_units`)."""
    parser.add_argument(
        "--units", default="default", type=units_arg, metavar="auto|none|GLOB",
        help="run the plan inside the model's own forward, taking over these submodules: "
        "auto (repeated blocks: docs/units.md) or a glob of module paths ('model.layers.*'); "
        "none: one traced graph of the whole step; default: auto for a model with "
        "_no_split_modules (Hugging Face), none for the rest",
    )


def units_arg(text: str) -> str | None:
    """``--units``: ``none`` is one traced graph (None); anything else as given."""
    return None if text.lower() == "none" else text


def add_profile_options(parser: argparse.ArgumentParser) -> None:
    """``--mode``, ``--times``, ``--device`` and ``--device-spec``: how the step is profiled."""
    parser.add_argument(
        "--mode", choices=("auto", "real", "fake"), default="auto",
        help="how memory is recorded: 'real' runs the step; 'fake' runs it under fake tensors, "
        "allocating no activations (for a model that does not fit); 'auto' (default) records "
        "it fake and runs it for real only if its predicted peak fits free memory",
    )
    parser.add_argument(
        "--times", choices=("measured", "isolated", "scaled", "roofline"), default=None,
        help="node times of a fake profile: 'isolated' (default: each node run alone at full "
        "size), 'scaled' (a real profile at a smaller batch, scaled by FLOPs and bytes), "
        "'roofline' (no run: --device-spec's peak rates); a real profile measures them",
    )
    parser.add_argument(
        "--device", default=None, metavar="DEVICE",
        help="the device to plan for (default: the model's); with a fake profile it may be "
        "one the model is not on, e.g. cuda",
    )
    parser.add_argument(
        "--device-spec", default=None, metavar="NAME",
        help="for --times roofline: a100, h100, h200, l4 or cpu",
    )
    add_parallel_option(parser)


def add_parallel_option(parser: argparse.ArgumentParser, then: str = "") -> None:
    """``--parallel``: plan one rank of DDP or FSDP2 (``then`` adds to its help)."""
    parser.add_argument(
        "--parallel", default=None, metavar="ddp|fsdp2:N",
        help="plan one rank of data-parallel training: ddp (DistributedDataParallel) or "
        "fsdp2:N (fully_shard on each unit, then the root, over N ranks); +adamw counts its "
        "state; budgets and peaks are then per rank (docs/distributed.md)" + then,
    )


def profile_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `add_profile_options` for ``profile``/``solve``."""
    from scheduler.capture.profile import check_profile_options

    from scheduler.parallel import parse_parallel

    check_profile_options(args.mode, args.times, args.device_spec)
    parse_parallel(args.parallel)  # (a bad one fails now, not after profiling)
    return {"mode": args.mode, "times": args.times, "device": args.device,
            "device_spec": args.device_spec, "parallel": args.parallel}


# ---------------------------------------------------------------------------- argument types


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def time_limit(text: str) -> float:
    """An argparse type: ``--time-limit``, checked by `units.check_time_limit` as the API
    checks ``time_limit_s``."""
    try:
        value = float(text)
    except ValueError:
        value = text  # not a number: check_time_limit says so
    try:
        limit = check_time_limit(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert limit is not None
    return limit


def fraction(text: str) -> float:
    """An argparse type: '30%' or '0.3' as 0.3 (finite, >= 0)."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.3 or 30%, got "
                                         f"{text!r}") from None
    if not value == value or value < 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a fraction >= 0 such as 0.3 or 30%, got "
                                         f"{text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: '2,4' as (2, 4); '' as ()."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4, "
                                         f"got {text!r}") from None


def names(values: list[str] | None) -> list[str] | None:
    """Repeated and comma-separated names (``--strategy auto,greedy --strategy sqrt``)."""
    if values is None:
        return None
    found = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if not found:
        raise ValueError("--strategy/--solver was given without a name; e.g. --strategy auto")
    return found


# ---------------------------------------------------------------------------- shared arguments


def add_model_spec(parser: argparse.ArgumentParser, *, graphs: bool = False) -> None:
    """The positional MODEL_SPEC (``graphs``: or a saved CostGraph's ``.json`` file)."""
    parser.add_argument(
        "model_spec",
        metavar="MODEL_SPEC",
        help="'path/to/file.py:factory' or 'package.module:factory'; the factory takes no "
        "arguments and returns (model, inputs) or (model, inputs, loss_fn)" + (
            "; or GRAPH.json, a profile saved by 'scheduler profile'" if graphs else ""),
    )


def add_json_and_quiet(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` (the rows) and ``--quiet`` (no progress bar, no table)."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="write the rows as JSON")
    parser.add_argument(
        "--quiet", action="store_true",
        help="print no progress bar and no table; errors still go to stderr",
    )


def add_solver_options(parser: argparse.ArgumentParser, *, headroom: float) -> None:
    """``--headroom``, ``--solver``, ``--time-limit``, ``--repeats``, ``--json`` and ``--quiet``
    of the verbs that measure and solve (``advise``, ``max-batch``)."""
    parser.add_argument(
        "--headroom", type=fraction, default=headroom, metavar="FRACTION",
        help=f"fraction of the memory held back, '0.1' or '10%%' (default: {headroom:g})")
    parser.add_argument("--solver", default="auto", metavar="NAME",
                        help="solver for the checkpointing plans (default: auto)")
    parser.add_argument("--time-limit", type=time_limit, default=30.0, metavar="SECONDS",
                        help="the solver's time limit in seconds (default: 30)")
    parser.add_argument("--repeats", type=positive_int, default=1, metavar="N",
                        help="timed steps per measurement (default: 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the result as JSON")
    parser.add_argument("--quiet", action="store_true",
                        help="print no spinner and no report; errors still go to stderr")


# ---------------------------------------------------------------------------- output paths


def default_out(spec: str) -> Path:
    """``<file-or-module>-<factory>.json`` in the current folder, for a MODEL_SPEC."""
    target, attr = split_spec(spec)
    stem = Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
    return Path(f"{stem}-{attr}.json")


def prepare_out(path: Path | None, flag: str, example: str) -> None:
    """Check before any long work starts that ``path`` can be written as a file of the kind
    ``example`` names by its suffix (``schedule.json``, ``compare.png``, ``compare.csv``):
    its folder made, not a directory, writable, and not an existing file of another kind
    (`files.check_destination`)."""
    if path is None:
        return
    from scheduler.files import check_destination

    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; give a file path such as "
                         f"{str(path / example)!r}")
    check_destination(path, example.rsplit(".", 1)[-1], what=flag)


def need_matplotlib(flag: str) -> None:
    """Fail now, naming the install, when ``flag`` needs matplotlib and it is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} needs matplotlib, which is not installed: pip install "
                         "matplotlib (or pip install -e '.[plot]'), or leave out " + flag)


# ---------------------------------------------------------------------------- progress


def run_quietly_or_not(args: argparse.Namespace, work: Callable[[Callable[[str], None]], Any]
                       ) -> Any:
    """``work(progress)`` under a spinner, or silently with --quiet."""
    if args.quiet:
        return work(lambda _msg: None)
    from rich.console import Console

    with Console(stderr=True).status(f"{args.model_spec} ...") as status:
        return work(lambda msg: status.update(f"{args.model_spec}: {msg} ..."))
