"""Solve the GPT example under a memory budget, then train a few steps with the checkpointed
module, beside the same steps of the plain model.

    python examples/train_gpt.py                          # default GPT, 50% budget, 5 steps
    python examples/train_gpt.py --small --steps 2        # seconds
    python examples/train_gpt.py --budget 30% --solver auto

The checkpointed module is a drop-in: it shares the model's parameters, so an optimizer built
on ``model.parameters()`` trains it. Its losses equal the plain model's step for step (the
dropout masks are replayed), while its predicted peak memory fits the budget.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is not an installed package
    sys.path.insert(0, str(ROOT))

import scheduler  # noqa: E402
from examples.gpt import build  # noqa: E402

#: ``--small``: a GPT that profiles and trains in seconds
SMALL = dict(batch=8, block_size=32, n_layer=2, n_head=2, n_embd=32, vocab_size=64)


def train(module: torch.nn.Module, params: Any, inputs: Sequence[torch.Tensor], *,
          steps: int, lr: float, seed: int = 0) -> list[float]:
    """``steps`` AdamW steps of ``module(*inputs)`` (the GPT returns its loss); the losses."""
    torch.manual_seed(seed)  # the same dropout masks for every module trained from this seed
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = module(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="50%", help="memory budget (default: 50%%)")
    parser.add_argument("--solver", default="auto", help="solver name (default: auto)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: 5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--small", action="store_true", help="a tiny GPT (seconds)")
    args = parser.parse_args(argv)

    model, inputs = build(**(SMALL if args.small else {}))
    plain = copy.deepcopy(model)  # trained separately, for the side-by-side losses
    plan = scheduler.solve(model, inputs, budget=args.budget, solver=args.solver, repeats=1)
    print(plan.summary())
    measured = scheduler.measure(plan.module, inputs, repeats=1)
    print(f"measured peak of one checkpointed step: "
          f"{scheduler.quantities.format_bytes(measured.peak_bytes)} "
          f"(budget {scheduler.quantities.format_bytes(plan.budget_bytes)})")

    checkpointed = train(plan.module, model.parameters(), inputs, steps=args.steps, lr=args.lr)
    reference = train(plain, plain.parameters(), inputs, steps=args.steps, lr=args.lr)
    print("step  checkpointed loss  plain loss")
    for i, (a, b) in enumerate(zip(checkpointed, reference)):
        print(f"{i:4d}  {a:17.6f}  {b:10.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
