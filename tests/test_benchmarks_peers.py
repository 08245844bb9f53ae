"""benchmarks/peers.py: the race against what users would pick instead runs end to end in its
quick mode and writes its section and plot; torchtitan's selective policy decides as
torchtitan's does; the storage tracker and the profiler's memory events agree on eager peaks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from conftest import benchmark_modules

_peers_variants, _record, peers = benchmark_modules("_peers_variants", "_record", "peers")

aten = torch.ops.aten
MUST, PREFER = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def test_titan_policy_saves_compute_ops_but_every_second_mm() -> None:
    policy = _peers_variants.titan_policy()
    fwd, rec = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    ops = [aten.mm.default, aten.mm.default, aten.addmm.default, aten.relu.default,
           aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten.convolution.default, aten.add.Tensor]
    # torchtitan: count mm in forward and in the recompute apart; every second mm recomputes,
    # other save-list ops (addmm, attention, convolution) always save, the rest recompute
    want = [MUST, PREFER, MUST, PREFER, MUST, MUST, MUST, PREFER]
    assert [policy(fwd, op) for op in ops] == want
    assert [policy(rec, op) for op in ops] == want  # the recompute's own count, from 0


def test_budgets_within_one_percent_merge_into_the_lower() -> None:
    got = peers.merged([(300, False), (100, False), (101, True), (200, True), (303, True)])
    assert got == [(100, True), (200, True), (300, True)]


def test_wrapped_blocks_compute_the_models_gradients() -> None:
    from examples.gpt import build

    model, inputs = build(**peers.QUICK["gpt"], dropout=0.0)
    paths = ["transformer.h.0", "transformer.h.1"]
    for policy in (None, _peers_variants.titan_policy):
        wrapped = _peers_variants.wrap_blocks(model, paths, policy)
        grads = []
        for m in (model, wrapped):
            m.zero_grad(set_to_none=True)
            m(*inputs).backward()
            grads.append([p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


@pytest.mark.slow  # (a whole race, compiled variants included)
def test_quick_race_writes_its_section_and_plot(tmp_path, monkeypatch) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- begin peers -->\nold\n<!-- end peers -->\n")
    monkeypatch.setattr(_record, "DOC", doc)
    png = tmp_path / "peers.png"
    assert peers.main(["--quick", "--no-compile", "--examples", "gpt", "--png", str(png),
                       "--write"]) == 0
    text = doc.read_text()
    assert "old" not in text and png.stat().st_size > 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in text.splitlines() if line.startswith("| ")}
    assert {"none", "every_block", "sqrt", "selective AC"} <= set(rows)
    # two independent counts of the same eager step: the profiler's memory events and the
    # storage tracker
    profiler, tracker = rows["none"][2], rows["none"][3]
    assert profiler == tracker



def test_cuda_race_is_refused_by_name_without_a_cuda_device(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the race would run")
    try:
        peers.main(["--quick", "--no-compile", "--examples", "gpt", "--device", "cuda"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--device cuda ran without a CUDA device")
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device is available here" in err


def test_an_unknown_device_is_refused() -> None:
    try:
        peers.main(["--quick", "--examples", "gpt", "--device", "tpu"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--device tpu was accepted")


@pytest.mark.parametrize("bad", ("1.5", "x", ","))
def test_compile_budgets_outside_zero_to_one_are_refused_by_value(bad, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        peers.main(["--examples", "gpt", "--compile-budgets", bad])
    assert e.value.code == 2 and f"got {bad!r}" in capsys.readouterr().err


def test_compile_budgets_are_the_ones_raced(monkeypatch) -> None:
    class Raced(Exception):
        pass

    def race(key, **kwargs):
        raise Raced(kwargs["compile_budgets"])

    monkeypatch.setattr(peers, "race", race)
    with pytest.raises(Raced) as e:
        peers.main(["--examples", "gpt", "--compile-budgets", "1.0,0.2"])
    assert e.value.args[0] == (1.0, 0.2)


def test_device_of_is_the_first_parameters_device() -> None:
    assert _peers_variants.device_of(torch.nn.Linear(2, 2)).type == "cpu"
    assert _peers_variants.device_of(torch.nn.ReLU()).type == "cpu"  # (no parameters)


def test_a_compiled_plans_predicted_step_is_the_compiled_base_plus_its_compiled_replays() -> None:
    def variant(name: str, **predicted: float) -> _peers_variants.Variant:
        return _peers_variants.Variant(name, "ours compiled", None, (), compiled=True,
                                       predicted=dict(predicted))

    vs = [variant("none"), variant("ours none compiled", compiled_recompute_s=0.0),
          variant("ours 1 MiB compiled", compiled_recompute_s=0.004),
          variant("ours 2 MiB", step_ratio=1.2)]
    # this run's none step is 0.05 s against 0.04 s profiled: profiled seconds count 1.25x
    peers.compiled_step_ratios(vs, [0.05, 0.03, 0.036, 0.06], profiled_step_s=0.04)
    assert vs[1].predicted["step_ratio"] == pytest.approx(0.03 / 0.05)
    assert vs[2].predicted["step_ratio"] == pytest.approx((0.03 + 0.004 * 1.25) / 0.05)
    assert vs[3].predicted["step_ratio"] == 1.2  # (an eager plan keeps its own)


@pytest.mark.parametrize("device,label", (("cpu", "peak MiB (profiler)"),
                                          ("cuda", "peak MiB (allocator)")))
def test_the_peak_column_names_the_count_of_its_device(device, label) -> None:
    row = dict(name="none", family="user", budget=None, peak=2**20, tracked=None, step_s=1e-3,
               note="", ratio=1.0, graphs=None)
    result = dict(label="GPT", nodes=3, blocks=1, inputs="", rounds=5, rows=[row],
                  device=device)
    assert [c.header for c in peers.table(result).columns][2] == label


def _row(name: str, family: str, peak: int, round_s: list[float] | None) -> dict:
    step = sorted(round_s or [1.0] * 3)[1]  # (the median of 3; none's is 1 s)
    return dict(name=name, family=family, budget=None, peak=peak, tracked=None,
                step_s=step, note="", ratio=step, graphs=None, round_s=round_s)


@pytest.mark.parametrize("its,ours,ours_peak,cells", (
    # medians 1.1 and 1.14 (1.036); round by round 1.3, 0.95, 0.909
    ([1.0, 1.2, 1.1], [1.3, 1.14, 1.0], 90, "1.036 | 0.909-1.300 | within spread"),
    ([1.0, 1.0, 1.0], [1.2, 1.1, 1.3], 90, "1.200 | 1.100-1.300 | slower"),
    ([1.0, 1.0, 1.0], [0.9, 0.95, 0.8], 90, "0.900 | 0.800-0.950 | faster"),
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 90, "1.000 | 1.000-1.000 | faster"),
    (None, [0.9, 0.95, 0.8], 90, "0.900 | - | -"),  # (rounds not kept: no spread)
    ([1.0, 1.0, 1.0], [0.9, 0.95, 0.8], 101, "none fits | - | - | -")))
def test_ours_over_each_choice_is_read_against_its_ratio_round_by_round(
        its, ours, ours_peak, cells) -> None:
    rows = [_row("none", "user", 300, [1.0, 1.0, 1.0]), _row("compile 0.6", "compile", 100, its),
            _row("ours 0.6 compiled", "ours compiled", ours_peak, ours)]
    text = _record.markdown_table(peers.matched(dict(label="GPT", rows=rows)))
    line = next(x for x in text.splitlines() if x.startswith("| compile 0.6 |"))
    assert line.endswith(f"| {cells} |"), line


@pytest.mark.parametrize("twin,reading", (([1.05] * 3, "within spread"),
                                          ([0.95] * 3, "within spread"),
                                          ([1.02] * 3, "slower"), (None, "slower")))
def test_a_loss_no_larger_than_the_twins_differ_by_is_within_the_spread(twin, reading) -> None:
    # ours 3% slower in every round; the twin (compile 0.6 compiled again) 5%, 5% or 2% apart
    rows = [_row("none", "user", 300, [1.0] * 3), _row("compile 0.6", "compile", 100, [1.0] * 3),
            _row("ours 0.6 compiled", "ours compiled", 90, [1.03, 1.04, 1.02])]
    if twin is not None:
        rows.insert(2, _row("compile 0.6 twin", "twin", 100, twin))
    table = peers.matched(dict(label="GPT", rows=rows))
    lines = _record.markdown_table(table).splitlines()
    choices = [x.split(" | ")[0] for x in lines if x.startswith("| compile")]
    assert choices == ["| compile 0.6"]  # (the twin is not a choice)
    assert lines[-1].endswith(f"| 1.030 | 1.020-1.040 | {reading} |"), lines[-1]
    if twin is None:
        assert "twins" not in table.title
    else:
        assert f"differed by {abs(twin[0] - 1):.1%}" in table.title, table.title
