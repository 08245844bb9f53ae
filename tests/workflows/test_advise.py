"""`advise`: the measured breakdown of a real training step, every recommendation case, the
gradient-accumulation options, bad input, and the ``scheduler advise`` command line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from _cli import run

import scheduler
from scheduler.measurement.breakdown import PARTS
from scheduler.measurement.storage import StorageTracker
from scheduler.workflows.advice import (
    ACCUMULATE,
    ACCUMULATE_CHECKPOINT,
    BEYOND,
    CHECKPOINT,
    FITS,
    Option,
    recommend,
)

GPT = dict(batch=8, block_size=32, n_layer=2, n_head=2, n_embd=32, vocab_size=64)


def _adamw_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def real_peak(model: nn.Module, inputs: tuple, *, micro_batches: int = 1) -> tuple[int, int]:
    """(peak bytes of the second AdamW step, its optimizer state bytes), on a copy, measured
    here with our own loop: zero_grad, forward + backward per micro-batch, optimizer step."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    n = inputs[0].shape[0] // micro_batches
    micro = [tuple(t[i * n:(i + 1) * n].clone() for t in inputs) for i in range(micro_batches)]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for x in micro:
            out = m(*x)
            loss = out if out.dim() == 0 else out.mean()
            del out
            loss.backward()
            del loss
        opt.step()

    step()
    tracker = StorageTracker()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    for t in [*m.parameters(), *m.buffers(), *state, *(t for x in micro for t in x)]:
        tracker.register(t)
    with tracker:
        step()
    return tracker.peak_bytes, _adamw_state_bytes(opt)


@pytest.fixture(scope="module")
def gpt(build_example):
    return build_example("gpt", **GPT)


@pytest.fixture(scope="module")
def roomy(gpt):
    """advise on the GPT example with plenty of memory."""
    model, inputs = gpt
    return scheduler.advise(model, inputs, device_memory="1GiB", repeats=1)


def test_breakdown_parts_add_up_to_a_real_adamw_step_within_3_percent(gpt, roomy, model_state):
    model, inputs = gpt
    before = model_state(model)
    advice = scheduler.advise(model, inputs, device_memory="1GiB", repeats=1)
    before.assert_unchanged(model)
    peak, state = real_peak(model, inputs)
    parts = advice.breakdown.parts
    assert list(parts) == list(PARTS)
    assert abs(sum(parts.values()) - peak) <= 0.03 * peak, (parts, peak)
    assert advice.breakdown.peak_bytes == sum(parts.values())
    assert parts["parameters"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert parts["optimizer_state"] == state
    assert parts["activations"] > 0 and all(v >= 0 for v in parts.values())
    data = json.loads(advice.to_json())
    assert sum(data["breakdown"]["percent"].values()) == pytest.approx(100)


def test_fits_with_headroom_recommends_nothing(roomy):
    assert roomy.fits and roomy.recommendation == FITS
    assert roomy.options == [] and roomy.plan_module is None
    assert "No checkpointing needed" in roomy.summary
    assert roomy.usable_bytes == int(2**30 * 0.9)
    text = str(roomy)
    assert "Recommendation (fits)" in text and "optimizer state" in text


def test_headroom_decides_fitting(gpt, roomy):
    model, inputs = gpt
    peak = roomy.breakdown.peak_bytes
    # the step fits the device but not the device less 10%
    advice = scheduler.advise(model, inputs, device_memory=int(peak / 0.95), micro_batches=(),
                              repeats=1)
    assert not advice.fits and advice.recommendation != FITS
    assert scheduler.advise(model, inputs, device_memory=int(peak / 0.95), headroom=0.0,
                            repeats=1).recommendation == FITS


def test_activations_dominate_and_the_optimal_plan_fits_checkpoint(gpt, roomy):
    model, inputs = gpt
    peak = roomy.breakdown.peak_bytes
    assert roomy.breakdown.parts["activations"] > 0.5 * peak
    advice = scheduler.advise(model, inputs, device_memory=int(0.75 * peak / 0.9),
                              micro_batches=(), repeats=1)
    assert advice.recommendation == CHECKPOINT, advice.summary
    chosen = advice.chosen
    assert chosen is not None and chosen.checkpoint and chosen.fits
    assert chosen.predicted_peak_bytes <= advice.usable_bytes < peak
    m = advice.measured
    assert m["measured_peak_bytes"] <= advice.usable_bytes
    assert m["predicted_overhead"] > 0 and m["measured_overhead"] > -1
    assert "Checkpoint: predicted overhead" in advice.summary
    assert isinstance(advice.plan_module, nn.Module)
    data = json.loads(advice.to_json())
    assert data["chosen"] == "checkpoint" and data["measured"]["measured_peak_bytes"] > 0


def _wide() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """One block whose activations are all needed at once in backward: checkpointing cannot
    shrink them, a smaller micro-batch can."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 16))
    return model, (torch.randn(2048, 16),)


def test_accumulation_fits_where_checkpointing_does_not():
    model, inputs = _wide()
    least = scheduler.floor(model, inputs, repeats=1)
    assert least.status == "OPTIMAL"  # proven: no schedule fits a byte below least.bytes
    usable = least.bytes - 100_000  # (advise keeps 10% of the device in reserve)
    advice = scheduler.advise(model, inputs, device_memory=int(usable / 0.9),
                              micro_batches=(2,), repeats=1)
    assert advice.recommendation == ACCUMULATE, advice.summary
    by_name = {o.name: o for o in advice.options}
    assert not by_name["checkpoint"].fits
    acc = advice.chosen
    assert acc is by_name["accumulate 2"] and acc.micro_batch_size == 1024
    # the prediction against a real accumulation loop over two micro-batches
    measured, _ = real_peak(model, inputs, micro_batches=2)
    assert measured <= advice.usable_bytes
    assert abs(acc.predicted_peak_bytes - measured) <= 0.03 * measured, (acc, measured)


def test_optimizer_state_dominates_no_schedule_fits_and_checkpointing_is_not_recommended(
        build_example):
    model, inputs = build_example("mlp", batch=4, dim=256, depth=2)
    peak = scheduler.advise(model, inputs, device_memory="1GiB", repeats=1).breakdown.peak_bytes
    advice = scheduler.advise(model, inputs, device_memory=int(0.97 * peak / 0.9),
                              micro_batches=(2,), repeats=1)
    parts = advice.breakdown.parts
    assert max(parts, key=parts.get) == "optimizer_state"
    assert advice.recommendation == BEYOND and advice.chosen is None
    assert advice.plan_module is None and not any(o.fits for o in advice.options)
    least = min(o.predicted_peak_bytes for o in advice.options)
    assert advice.shortfall_bytes == least - advice.usable_bytes > 0
    assert "no schedule fits" in advice.summary and "not the remedy" in advice.summary
    remedies = " ".join(advice.remedies)
    assert "ZeRO" in remedies and "8-bit" in remedies and "smaller model" in remedies
    assert "checkpoint" not in remedies.lower()


def _opt(name: str, k: int, ckpt: bool, time_s: float, fits: bool) -> Option:
    return Option(name, k, 8 // k, ckpt, 100, time_s, fits)


@pytest.mark.parametrize(("options", "kind", "chosen"), [
    ([_opt("as is", 1, False, 1.0, True), _opt("checkpoint", 1, True, 1.2, True)], FITS,
     "as is"),
    ([_opt("as is", 1, False, 1.0, False), _opt("checkpoint", 1, True, 1.2, True),
      _opt("accumulate 2", 2, False, 1.1, True)], ACCUMULATE, "accumulate 2"),
    ([_opt("as is", 1, False, 1.0, False), _opt("checkpoint", 1, True, 1.2, True),
      _opt("accumulate 2", 2, False, 1.3, True)], CHECKPOINT, "checkpoint"),
    ([_opt("as is", 1, False, 1.0, False), _opt("checkpoint", 1, True, 1.2, False),
      _opt("accumulate 2", 2, False, 1.1, False),
      _opt("accumulate 2 + checkpoint", 2, True, 1.4, True)], ACCUMULATE_CHECKPOINT,
     "accumulate 2 + checkpoint"),
    ([_opt("as is", 1, False, 1.0, False), _opt("checkpoint", 1, True, 0.5, False)], BEYOND,
     None),
])
def test_recommend_picks_the_fastest_option_that_fits(options, kind, chosen):
    got_kind, got = recommend(options)
    assert got_kind == kind
    assert (got.name if got else None) == chosen


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(device_memory=0), r"bad device_memory 0: it must be positive"),
    (dict(device_memory=-5), r"bad device_memory -5"),
    (dict(device_memory="lots"), r"bad device_memory 'lots'.*'24GiB'"),
    (dict(device_memory=True), r"bad device_memory True"),
    (dict(device_memory=1.5e9), r"bad device_memory 1500000000.0"),
    (dict(device_memory="1GiB", optimizer="lion"),
     r"unknown optimizer 'lion'; valid optimizers: adamw, adam, sgd"),
    (dict(device_memory="1GiB", headroom=1.0), r"headroom must be a fraction in \[0, 1\).*1\.0"),
    (dict(device_memory="1GiB", headroom=-0.1), r"headroom .*-0\.1"),
    (dict(device_memory="1GiB", micro_batches=(3,)), r"micro_batches=3 does not divide .* 4"),
    (dict(device_memory="1GiB", micro_batches=(1,)), r"micro_batches must be counts >= 2"),
    (dict(device_memory="1GiB", optimizer_state_bytes="x"), r"bad optimizer_state_bytes 'x'"),
])
def test_bad_input_is_rejected_before_measuring(kwargs, match, build_example):
    model, inputs = build_example("mlp", batch=4, dim=8, depth=1)
    with pytest.raises(ValueError, match=match):
        scheduler.advise(model, inputs, **kwargs)


def test_optimizer_state_given_in_bytes(build_example):
    model, inputs = build_example("mlp", batch=4, dim=64, depth=1)
    advice = scheduler.advise(model, inputs, device_memory="1GiB", optimizer_state_bytes=12345,
                              repeats=1)
    b = advice.breakdown
    assert b.optimizer == "given" and b.parts["optimizer_state"] == 12345
    assert b.optimizer_step_peak_bytes == 0 and b.phase != "optimizer step"


# ------------------------------------------------------------------------------ one rank


def _sharded_adamw_state(model: nn.Module, world: int) -> tuple[int, int]:
    """(bytes of one rank's padded parameter shards, the state real AdamW keeps for them),
    from the model's tensors: FSDP2 chunks dim 0 over ``world``, padded to the first chunk."""
    shards = [torch.zeros(-(-p.shape[0] // world), *p.shape[1:]) if p.dim() else
              torch.zeros(()) for p in model.parameters()]
    for t in shards:
        t.requires_grad_(True)
        t.grad = torch.zeros_like(t)
    opt = torch.optim.AdamW(shards, lr=1e-3)
    opt.step()
    return sum(t.untyped_storage().nbytes() for t in shards), _adamw_state_bytes(opt)


def test_per_rank_advice_is_one_ranks_step_predicted(gpt):
    """``parallel="fsdp2:4"``: the parameters are one rank's shards and the state what real
    AdamW keeps for them; the step as it is peaks as `solve` predicts for that rank; where
    it does not fit, the chosen option fits and the report says it is predicted only."""
    model, inputs = gpt
    shards, state = _sharded_adamw_state(model, 4)
    plan = scheduler.solve(model, inputs, budget="100%", parallel="fsdp2:4+adamw")
    peak = plan.unconstrained_peak_bytes
    advice = scheduler.advise(model, inputs, device_memory=int(0.8 * peak), headroom=0.0,
                              parallel="fsdp2:4", micro_batches=(2,), repeats=1)
    b = advice.breakdown
    assert b.parts["parameters"] == shards and b.parts["optimizer_state"] == state
    assert b.peak_bytes == peak == sum(b.parts.values()) and b.parts["gradients"] == 0
    assert not advice.fits and advice.chosen is not None and advice.chosen.fits
    assert advice.chosen.predicted_peak_bytes <= advice.usable_bytes
    assert "predicted" in b.phase and "Predicted for one rank" in advice.summary
    assert "FSDP2 over 4 ranks" in b.optimizer and advice.measured is None
    assert advice.schedules and advice.plan_module is None


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(optimizer="rmsprop"), r"optimizer='rmsprop' cannot be: name one of adamw"),
    (dict(optimizer_state_bytes=100), r"optimizer_state_bytes=100 cannot be"),
    (dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0)), r"counts the optimizer's state "
                                                            r"per rank from its name"),
    (dict(parallel="fsdp2:4+adam"), r"counts 'adam' state but optimizer='adamw'"),
    (dict(parallel="fsdp3"), r"fsdp3"),
])
def test_per_rank_bad_input_is_rejected_before_profiling(kwargs, match, build_example):
    model, inputs = build_example("mlp", batch=4, dim=8, depth=1)
    with pytest.raises(ValueError, match=match):
        scheduler.advise(model, inputs, device_memory="1GiB", **{"parallel": "ddp", **kwargs})


# ------------------------------------------------------------------------------ command line


def test_cli_advise_prints_and_writes_json(tmp_path):
    path = tmp_path / "advice.json"
    code, out, err = run(["advise", "examples/mlp.py:build", "--device-memory", "1GiB",
                          "--json", str(path)])
    assert code == 0, err
    assert "Recommendation (fits)" in out and "parameters" in out
    data = json.loads(path.read_text())
    assert data["recommendation"] == FITS and data["device_memory_bytes"] == 2**30
    code, out, err = run(["advise", "examples/mlp.py:build", "--device-memory", "1GiB",
                          "--quiet"])
    assert (code, out, err) == (0, "", "")
    code, out, err = run(["advise", "examples/mlp.py:build", "--device-memory", "1GiB",
                          "--parallel", "ddp", "--json", str(path)])
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["recommendation"] == FITS and "per rank of DDP" in data["breakdown"]["optimizer"]
    assert "one rank's step fits" in data["summary"]


@pytest.mark.parametrize(("argv", "match"), [
    (["--device-memory", "0"], "bad --device-memory '0'"),
    (["--device-memory", "24G"], "bad --device-memory '24G'"),
    (["--device-memory", "1GiB", "--optimizer", "lion"], "valid optimizers: adamw"),
    (["--device-memory", "1GiB", "--headroom", "150%"], "headroom must be a fraction"),
    (["--device-memory", "1GiB", "--solver", "magic"], "unknown solver 'magic'"),
    (["--device-memory", "1GiB", "--parallel", "fsdp2"], "fsdp2"),
    (["--device-memory", "1GiB", "--parallel", "ddp", "--optimizer", "adagrad"],
     "optimizer='adagrad' cannot be"),
])
def test_cli_advise_errors_are_one_line_exit_2(argv, match):
    code, out, err = run(["advise", "examples/mlp.py:build", *argv])
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scheduler: error: ") and match in lines[0]


def test_cli_help_shows_examples():
    for verb in ("advise", "max-batch"):
        code, out, _ = run([verb, "--help"])
        assert code == 0 and "examples:" in out and f"scheduler {verb} examples/" in out
