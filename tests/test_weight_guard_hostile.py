"""The weight guard (``hookcli.engine.weight_guard``) against forwards that write their weights in ways
its speculation could miss: each test runs a model several times (a first run copies, later ones do not)
and compares every weight bit for bit with a copy the test took itself."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from hookcli.engine import weight_guard
from hookcli.errors import WeightsChangedWarning


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter and buffer's bytes (a contiguous copy: NaN and -0.0 compared as they are)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {n: t.detach().contiguous().clone().view(-1).view(torch.uint8) for n, t in tensors}


def _assert_bits(before: dict[str, torch.Tensor], model: nn.Module) -> None:
    now = _bits(model)
    assert now.keys() == before.keys()
    for name, values in before.items():
        assert torch.equal(now[name], values), name
    assert "data" not in nn.Parameter.__dict__ and "data" not in torch.Tensor.__dict__


def _runs(model: nn.Module, times: int = 3, **options: Any) -> list[Any]:
    """``hookcli.stats`` ``times`` times, none of them saying a weight changed, each handing the weights
    back as they were."""
    before = _bits(model)
    reports = []
    for _ in range(times):
        with warnings.catch_warnings():
            warnings.simplefilter("error", WeightsChangedWarning)
            reports.append(hookcli.stats(model, **(options if "inputs" in options else {"input_shapes": ["2x6"]} | options)))
        _assert_bits(before, model)
    return reports


class _WritesFromItsSecondRun(nn.Module):
    """A linear layer whose forward, from its second call on, writes its weight as ``write`` does."""

    def __init__(self, write: Callable[[nn.Parameter], None], weight: torch.Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(3, 6) if weight is None else weight)
        self.write = write
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= 2:
            self.write(self.weight)
        return x @ self.weight.T


@pytest.mark.parametrize("write", [
    lambda w: w[0].data.mul_(2.0),        # a row of it
    lambda w: w.T.data.mul_(2.0),         # its transpose
    lambda w: w.view(-1).data.zero_(),    # a flat view
], ids=["row", "transpose", "flat"])
def test_a_later_write_through_data_of_a_view_of_a_weight_is_put_back(write: Callable[[Any], None]) -> None:
    """``.data`` of a view bumps no version counter, like ``.data`` of the weight itself."""
    model = _WritesFromItsSecondRun(write)
    reports = _runs(model, times=3)
    # the run saw the write, as an unwatched forward would
    assert reports[1].layers[0].stats != reports[0].layers[0].stats


def test_a_first_run_that_flips_the_sign_of_a_zero_in_a_transposed_weight_puts_it_back() -> None:
    """A non-contiguous weight is compared bit for bit too (-0.0 == 0.0 as floats)."""

    class FlipsZeros(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3, 6).T)  # (6, 3), strides (1, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.weight.data.mul_(-1.0)
            return x @ self.weight

    model = FlipsZeros()
    assert not model.weight.is_contiguous()
    _runs(model, times=3)
    assert weight_guard.copying(model)  # (seen writing on its first run)


class _TiesThroughData(nn.Module):
    """Legacy weight tying in the forward: the head's ``.data`` set to the embedding's."""

    def __init__(self, from_call: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(5, 6)
        self.head = nn.Linear(6, 5, bias=False)
        self.from_call = from_call
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.from_call:
            self.head.weight.data = self.emb.weight.data
        return self.head(self.emb(ids))


@pytest.mark.parametrize("from_call", [1, 2], ids=["first-run", "later-run"])
def test_a_weight_whose_data_the_forward_replaces_gets_its_own_memory_back(from_call: int) -> None:
    """Putting the head's values back into the embedding's memory would overwrite the embedding."""
    model = _TiesThroughData(from_call)
    head, emb = model.head.weight, model.emb.weight
    pointers = (head.data_ptr(), emb.data_ptr())
    _runs(model, times=3, inputs=torch.tensor([[0, 1, 4]]))
    assert model.head.weight is head and (head.data_ptr(), emb.data_ptr()) == pointers


@pytest.mark.parametrize("from_call", [1, 2], ids=["first-run", "later-run"])
def test_a_weight_whose_data_the_forward_replaces_with_another_shape_comes_back_whole(from_call: int) -> None:
    model = _WritesFromItsSecondRun(lambda w: setattr(w, "data", torch.zeros(2, 6)))
    model.calls = 2 - from_call  # (writes from its ``from_call``-th run on)
    shape = model.weight.shape
    _runs(model, times=3)
    assert model.weight.shape == shape


def test_a_model_made_under_inference_mode_is_copied_on_every_run() -> None:
    """Its weights keep no version counter: a write on a later run could not be seen, so none is
    speculated on (and ``copying`` says so)."""

    class ScalesLater(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls >= 3:
                with torch.inference_mode():
                    self.lin.weight.mul_(-2.0)
            return self.lin(x)

    torch.manual_seed(0)
    with torch.inference_mode():
        model = ScalesLater()
    assert model.lin.weight.is_inference()
    _runs(model, times=1)
    assert weight_guard.copying(model)  # (though its first run wrote nothing)
    _runs(model, times=3)
