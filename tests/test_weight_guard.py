"""A caller's weights come back as they were, with their copy taken on a model's first run only
(``hookcli.engine.weight_guard``): each test compares the weights with a copy the test took itself."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import hookcli
from hookcli.engine import weight_guard
from hookcli.errors import WeightsChangedWarning


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _scale_through_data(module: nn.Module, args: Any) -> None:
    module.weight.data.mul_(-3.0)


def _assert_same(before: dict[str, torch.Tensor], model: nn.Module) -> None:
    now = dict(model.named_parameters())
    assert set(now) == set(before)
    for name, values in before.items():
        assert torch.equal(now[name].detach(), values), name


def _stats(model: nn.Module, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightsChangedWarning)
        return hookcli.stats(model, **({"input_shapes": ["2x6"]} if "inputs" not in kwargs else {}), **kwargs)


def test_a_model_that_keeps_its_weights_is_copied_on_its_first_run_only() -> None:
    model = _mlp()
    before = _weights(model)
    assert weight_guard.copying(model)
    first = _stats(model)
    assert not weight_guard.copying(model)
    second = _stats(model)
    _assert_same(before, model)
    assert [r.stats for r in first.layers] == [r.stats for r in second.layers]
    assert "data" not in nn.Parameter.__dict__  # (the run-time property is gone)


def test_a_later_write_through_data_is_put_back_from_the_copy_taken_at_its_read() -> None:
    model = _mlp()
    _stats(model)
    before = _weights(model)
    x = torch.randn(2, 6)
    hook = model[0].register_forward_pre_hook(_scale_through_data)
    try:
        report = _stats(model, inputs=x)  # no warning: the write was seen and undone
    finally:
        hook.remove()
    _assert_same(before, model)
    # the run itself saw the written weight, as an unwatched forward would
    w, b = before["0.weight"].double(), before["0.bias"].double()
    first = next(r for r in report.layers if r.name == "0")
    assert first.stats is not None
    assert first.stats["mean"] == pytest.approx((x.double() @ (-3.0 * w).T + b).mean().item(), rel=1e-6)
    assert not weight_guard.copying(model)  # (a write through .data costs a copy of that weight only)


def test_a_later_write_under_no_grad_is_said_and_the_model_is_copied_from_then_on() -> None:
    model = _mlp()
    _stats(model)

    def clamp(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            module.weight.clamp_(-0.01, 0.01)

    hook = model[2].register_forward_pre_hook(clamp)
    try:
        with pytest.warns(WeightsChangedWarning, match=r"1 weight\(s\) in place \(2\.weight\)") as told:
            hookcli.stats(model, input_shapes=["2x6"])
        assert told[0].filename == __file__  # (said at the caller's line)
        assert weight_guard.copying(model)
        with torch.no_grad():
            model[2].weight.copy_(torch.linspace(-1, 1, 24).view(3, 8))
        before = _weights(model)
        _stats(model)  # copied up front now: put back, no warning
        _assert_same(before, model)
    finally:
        hook.remove()


def test_a_write_under_no_grad_before_a_data_read_in_the_same_run_is_not_put_back_from_a_stale_copy() -> None:
    model = _mlp()
    _stats(model)

    def both(module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            module.weight.add_(1.0)
        module.weight.data.mul_(2.0)

    hook = model[0].register_forward_pre_hook(both)
    try:
        with pytest.warns(WeightsChangedWarning, match=r"0\.weight"):
            hookcli.stats(model, input_shapes=["2x6"])
    finally:
        hook.remove()


def test_embedding_max_norm_renormalises_in_every_run_and_every_run_puts_it_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.mul_(5.0)  # every row over max_norm
    before = _weights(model)
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(3):
        _stats(model, inputs=ids)
        _assert_same(before, model)
        assert weight_guard.copying(model)


def test_a_first_run_that_raises_remembers_nothing() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("not this time")

    model = Fails()
    with pytest.raises(hookcli.HookcliError):
        hookcli.stats(model, input_shapes=["2x6"])
    assert weight_guard.copying(model)
    assert "data" not in nn.Parameter.__dict__


def test_a_swapped_layer_makes_the_model_new_again() -> None:
    model = _mlp()
    _stats(model)
    assert not weight_guard.copying(model)
    model[2] = nn.Linear(8, 3)
    assert weight_guard.copying(model)
    before = _weights(model)
    _stats(model)
    _assert_same(before, model)
    assert not weight_guard.copying(model)


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
       special=st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40]),
                        min_size=0, max_size=4))
def test_weights_holding_nan_or_signed_zero_are_kept_as_they_are(dtype: torch.dtype, special: list[float]) -> None:
    """A first run that wrote nothing is seen as such whatever the weights hold (NaN is not equal to
    itself as a float: compared bit for bit), and the values come back bit for bit."""
    model = _mlp().to(dtype)
    with torch.no_grad():
        flat = model[0].weight.view(-1)
        for i, v in enumerate(special):
            flat[i] = v
    before = {n: p.detach().clone().view(torch.int8) for n, p in model.named_parameters()}
    hookcli.stats(model, input_shapes=["2x6"], dtype=str(dtype).removeprefix("torch."))
    assert not weight_guard.copying(model)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int8), before[n]), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_accelerators_weights_are_put_back_on_a_first_run_and_a_later_one() -> None:
    model = _mlp().cuda()
    _stats(model)
    assert not weight_guard.copying(model)
    before = _weights(model)
    hook = model[0].register_forward_pre_hook(_scale_through_data)
    try:
        for _ in range(2):  # a later run (copied at the .data read), then the same again
            _stats(model)
            _assert_same(before, model)
    finally:
        hook.remove()
    writer = _mlp().cuda()
    before = _weights(writer)
    hook = writer[2].register_forward_pre_hook(_scale_through_data)
    try:
        _stats(writer)  # a first run: copied to host up front, put back
    finally:
        hook.remove()
    _assert_same(before, writer)
