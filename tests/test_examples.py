"""Tests for the example models in ``examples/``.

Each example's ``build()`` must give a train-mode model and example inputs that run
forward and backward, give every parameter a gradient, are reproducible from the seed,
and can be captured as a graph: ``torch.fx.symbolic_trace`` for the plain-PyTorch
examples, ``torch.export.export(..., strict=False)`` for Hugging Face GPT-2 (which
``symbolic_trace`` cannot handle).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import ROOT
from torch import nn

# Small sizes keep the whole file fast; the defaults are exercised in test_default_shapes.
SMALL: dict[str, dict[str, Any]] = {
    "mlp": dict(batch=4, dim=32, depth=3),
    "gpt": dict(batch=2, block_size=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64),
    "unet": dict(batch=2, channels=3, size=16, base=4, classes=2),
}
FX_EXAMPLES = sorted(SMALL)


def _example(name: str) -> ModuleType:
    return importlib.import_module(f"examples.{name}")


def _loss(out: Any) -> torch.Tensor:
    """Reduce a model output (tensor or HF ModelOutput) to a scalar."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().mean()
    return out.logits.mean()


def _assert_all_grads(model: nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {n}"


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=f"state differs at {k}")


# ---------------------------------------------------------------- plain-PyTorch examples


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet", "hf_gpt2"])
def test_loads_by_file_path(name: str) -> None:
    """``examples/<name>.py:build`` must work when the file is loaded by path, even by a
    loader that does not register the module in ``sys.modules``."""
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location(f"_examples_by_path_{name}",
                                                  ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert callable(mod.build)
    if name in SMALL:
        model, _ = mod.build(**SMALL[name])
        assert isinstance(model, nn.Module)


@pytest.mark.parametrize("name", FX_EXAMPLES)
def test_build_is_train_mode_with_tensor_inputs(name: str) -> None:
    model, inputs = _example(name).build(**SMALL[name])
    assert isinstance(model, nn.Module)
    assert all(m.training for m in model.modules())
    assert isinstance(inputs, tuple) and all(isinstance(t, torch.Tensor) for t in inputs)


@torch.no_grad()
def test_default_shapes() -> None:
    from examples import gpt, mlp, unet

    model, (x,) = mlp.build()
    assert x.shape == (512, 256)
    assert len(model.blocks) == 8
    assert model(x).shape == (512, 256)

    model, (idx, targets) = gpt.build()
    assert idx.shape == targets.shape == (4, 64)
    assert idx.dtype == targets.dtype == torch.long
    assert int(idx.max()) < 512 and int(idx.min()) >= 0
    assert len(model.transformer.h) == 4
    loss = model(idx, targets)
    assert loss.dim() == 0 and loss.dtype == torch.float32

    model, (x,) = unet.build()
    assert x.shape == (4, 3, 64, 64)
    assert model(x).shape == (4, 2, 64, 64)


def test_output_shapes_small() -> None:
    from examples import gpt, mlp, unet

    model, (x,) = mlp.build(**SMALL["mlp"])
    assert model(x).shape == (4, 32)

    model, (idx, targets) = gpt.build(**SMALL["gpt"])
    assert model(idx, targets).shape == ()
    assert model(idx).shape == (2, 16, 64)  # nanoGPT style: logits when targets is None
    assert model.logits(idx).shape == (2, 16, 64)

    model, (x,) = unet.build(**SMALL["unet"])
    assert model(x).shape == (2, 2, 16, 16)


def test_gpt_loss_matches_logits() -> None:
    from examples import gpt

    model, (idx, targets) = gpt.build(**SMALL["gpt"], dropout=0.0)
    logits = model.logits(idx)
    expected = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    torch.testing.assert_close(model(idx, targets), expected)


def test_gpt_weight_tying() -> None:
    from examples import gpt

    model, _ = gpt.build(**SMALL["gpt"])
    assert model.lm_head.weight is model.transformer.wte.weight


def test_unet_rejects_bad_size() -> None:
    from examples import unet

    with pytest.raises(ValueError):
        unet.build(size=20)


@pytest.mark.parametrize("name", FX_EXAMPLES)
def test_forward_backward_all_params_get_grads(name: str) -> None:
    model, inputs = _example(name).build(**SMALL[name])
    loss = _loss(model(*inputs))
    assert torch.isfinite(loss)
    loss.backward()
    _assert_all_grads(model)


@pytest.mark.parametrize("name", FX_EXAMPLES)
def test_same_seed_same_model_and_inputs(name: str) -> None:
    mod = _example(name)
    m1, in1 = mod.build(**SMALL[name], seed=3)
    m2, in2 = mod.build(**SMALL[name], seed=3)
    _assert_same_state(m1, m2)
    for a, b in zip(in1, in2):
        assert torch.equal(a, b)
    m3, in3 = mod.build(**SMALL[name], seed=4)
    assert not torch.equal(in1[0], in3[0])
    assert any(not torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters()))


@pytest.mark.parametrize("name", FX_EXAMPLES)
def test_symbolic_trace_matches_eager(name: str) -> None:
    model, inputs = _example(name).build(**SMALL[name])
    gm = torch.fx.symbolic_trace(model)
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    torch.manual_seed(123)  # same dropout masks for both runs (gpt)
    expected = model(*inputs)
    torch.manual_seed(123)
    got = gm(*inputs)
    torch.testing.assert_close(got, expected)


def test_gpt_trace_keeps_random_ops() -> None:
    from examples import gpt

    model, _ = gpt.build(**SMALL["gpt"])
    gm = torch.fx.symbolic_trace(model)
    dropouts = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Dropout)]
    # embedding dropout + (attention-residual, mlp) dropout per block
    assert len(dropouts) == 1 + 2 * SMALL["gpt"]["n_layer"]
    sdpa = [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == SMALL["gpt"]["n_layer"]
    assert all(n.kwargs["dropout_p"] == 0.1 and n.kwargs["is_causal"] for n in sdpa)


def test_unet_trace_is_a_dag_with_skips() -> None:
    from examples import unet

    model, _ = unet.build(**SMALL["unet"])
    gm = torch.fx.symbolic_trace(model)
    cats = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert len(cats) == 3
    # each encoder output feeds both the next level and a skip connection
    for i in range(3):
        last = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith(f"down.{i}.")][-1]
        assert len(last.users) == 2


# ------------------------------------------------------------------- Hugging Face GPT-2

HF_SMALL: dict[str, Any] = dict(batch=2, seq_len=16, n_layer=2, n_head=2, n_embd=32, vocab_size=64)


@pytest.fixture(scope="module")
def hf_gpt2() -> ModuleType:
    pytest.importorskip("transformers")
    return _example("hf_gpt2")


def test_hf_build_defaults(hf_gpt2: ModuleType) -> None:
    model, (input_ids,) = hf_gpt2.build()
    assert model.training
    assert input_ids.shape == (2, 64) and input_ids.dtype == torch.long
    assert model.config.use_cache is False
    with torch.no_grad():
        assert model(input_ids).logits.shape == (2, 64, 512)


def test_hf_forward_backward_all_params_get_grads(hf_gpt2: ModuleType) -> None:
    model, inputs = hf_gpt2.build(**HF_SMALL)
    out = model(*inputs)
    assert out.logits.shape == (2, 16, 64)
    _loss(out).backward()
    _assert_all_grads(model)


def test_hf_same_seed_same_model(hf_gpt2: ModuleType) -> None:
    m1, (a,) = hf_gpt2.build(**HF_SMALL, seed=5)
    m2, (b,) = hf_gpt2.build(**HF_SMALL, seed=5)
    _assert_same_state(m1, m2)
    assert torch.equal(a, b)
    # dropout is off, so the train-mode forward is deterministic too
    torch.testing.assert_close(m1(a).logits, m2(b).logits, rtol=0, atol=0)


def test_hf_symbolic_trace_fails(hf_gpt2: ModuleType) -> None:
    model, _ = hf_gpt2.build(**HF_SMALL)
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_export_works(hf_gpt2: ModuleType, attn: str) -> None:
    model, inputs = hf_gpt2.build(**HF_SMALL, attn_implementation=attn)
    ep = torch.export.export(model, inputs, strict=False)
    expected = model(*inputs).logits
    torch.testing.assert_close(ep.module()(*inputs).logits, expected)


def test_hf_with_labels(hf_gpt2: ModuleType) -> None:
    model, (input_ids, labels) = hf_gpt2.build_with_labels(**HF_SMALL)
    assert torch.equal(input_ids, labels)
    assert all(k.startswith("gpt2.") for k in model.state_dict())
    plain, _ = hf_gpt2.build(**HF_SMALL)
    _assert_same_state(model.gpt2, plain)
    loss = model(input_ids, labels)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    _assert_all_grads(model)
    ep = torch.export.export(model, (input_ids, labels), strict=False)
    torch.testing.assert_close(ep.module()(input_ids, labels), model(input_ids, labels))
