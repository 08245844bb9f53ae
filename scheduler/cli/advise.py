"""``scheduler advise``: where a training step's memory goes, and whether checkpointing is the
remedy."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.cli.common import (
    EXIT_OK,
    add_model_spec,
    add_parallel_option,
    add_solver_options,
    int_list,
    run_quietly_or_not,
)
from scheduler.cli.spec import load_factory
from scheduler.files import write_atomic

__all__ = ["add_parser", "run"]

_EPILOG = """\
examples:
  scheduler advise examples/gpt.py:build --device-memory 24GiB --optimizer adamw
  scheduler advise examples/mlp.py:build --device-memory 8GiB --micro-batches 2,4 --json advice.json
  scheduler advise examples/unet.py:build --device-memory 16GiB --optimizer-state 2GiB --quiet
  scheduler advise examples/gpt.py:build --device-memory 80GiB --parallel fsdp2:8

The step is measured for real (forward, backward and one optimizer step, on a copy of the
model). When it does not fit the device less headroom, checkpointing and gradient accumulation
over 2, 4, 8 micro-batches are priced and the fastest option that fits is recommended. With
--parallel, everything is one rank's and predicted, not measured (the named optimizer's state
is counted per rank).
"""


def add_parser(subparsers: Any) -> None:
    """Register ``advise``."""
    parser = subparsers.add_parser(
        "advise",
        help="where a training step's memory goes, and whether checkpointing is the remedy",
        description="Measure one real training step with its optimizer, break its peak into\n"
        "parameters, gradients, optimizer state, saved activations and the rest, and recommend\n"
        "what makes it fit the device: nothing, checkpointing, gradient accumulation, or\n"
        "remedies beyond them (sharding, lower-precision optimizer state, a smaller model).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_spec(parser)
    parser.add_argument("--device-memory", required=True, metavar="BYTES",
                        help="the device's memory: '24GiB', '80GB', or bytes")
    parser.add_argument("--optimizer", default="adamw", metavar="NAME",
                        help="optimizer to run one step of: adamw (default), adam, sgd, "
                        "sgd_momentum, rmsprop, adagrad")
    parser.add_argument("--optimizer-state", default=None, metavar="BYTES",
                        help="the optimizer state's size instead of running --optimizer")
    parser.add_argument("--micro-batches", type=int_list, default=None, metavar="K,K",
                        help="micro-batch counts to price for gradient accumulation "
                        "(default: 2,4,8 where they divide the batch; '' for none)")
    add_parallel_option(parser, "; --device-memory is then a rank's, and the advice "
                        "predicted, not measured")
    add_solver_options(parser, headroom=0.1)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure and advise, write --json, and print the report unless --quiet."""
    from scheduler.measurement.breakdown import get_optimizer
    from scheduler.workflows.advise_rank import rank_engine
    from scheduler.solvers import get_solver
    from scheduler.workflows.advise import advise, check_headroom, parse_memory

    # Fail on bad values now, not after minutes of measuring.
    parse_memory(args.device_memory, "--device-memory")
    state = (None if args.optimizer_state is None
             else parse_memory(args.optimizer_state, "--optimizer-state"))
    if state is None:
        get_optimizer(args.optimizer)
    if args.parallel is not None:
        rank_engine(args.parallel, args.optimizer, state)
    check_headroom(args.headroom)
    get_solver(args.solver)
    model, inputs, loss_fn = load_factory(args.model_spec)
    kwargs: dict[str, Any] = dict(
        device_memory=args.device_memory, optimizer=args.optimizer,
        optimizer_state_bytes=state, loss_fn=loss_fn, headroom=args.headroom,
        micro_batches=args.micro_batches, solver=args.solver, time_limit_s=args.time_limit,
        repeats=args.repeats, parallel=args.parallel)
    advice = run_quietly_or_not(args, lambda say: advise(model, inputs, progress=say,
                                                         **kwargs))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, advice.to_json())
    if not args.quiet:
        from rich.console import Console

        console = Console()
        for r in advice.renderables():
            console.print(r)
    return EXIT_OK
