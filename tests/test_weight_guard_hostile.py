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
from timeouts import scaled_timeout


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter and buffer's bytes (a contiguous copy: NaN and -0.0 compared as they are)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {n: t.detach().contiguous().clone().view(-1).view(torch.uint8) for n, t in tensors}


def _assert_bits(before: dict[str, torch.Tensor], model: nn.Module, *, alone: bool = True) -> None:
    """``model``'s weights hold ``before``; ``alone`` (no other thread's run going on): the run-time
    ``.data`` property is gone."""
    now = _bits(model)
    assert now.keys() == before.keys()
    for name, values in before.items():
        assert torch.equal(now[name], values), name
    assert not alone or ("data" not in nn.Parameter.__dict__ and "data" not in torch.Tensor.__dict__)


def _runs(model: nn.Module, times: int = 3, *, alone: bool = True, **options: Any) -> list[Any]:
    """``hookcli.stats`` ``times`` times, none of them saying a weight changed, each handing the weights
    back as they were."""
    before = _bits(model)
    reports = []
    for _ in range(times):
        with warnings.catch_warnings():
            warnings.simplefilter("error", WeightsChangedWarning)
            reports.append(hookcli.stats(model, **(options if "inputs" in options else {"input_shapes": ["2x6"]} | options)))
        _assert_bits(before, model, alone=alone)
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


class _Halves(nn.Module):
    """A forward that converts its own module (``self.half()``: ``.data`` of each weight set)."""

    def __init__(self, from_call: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)
        self.from_call = from_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.from_call:
            self.half()
        return self.lin(x.to(self.lin.weight.dtype)).float()


@pytest.mark.parametrize("from_call", [1, 2], ids=["first-run", "later-run"])
def test_a_forward_converting_its_module_leaves_the_weights_in_their_dtype(from_call: int) -> None:
    model = _Halves(from_call)
    _runs(model, times=3)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_gpt2_with_tied_embeddings_keeps_its_weights_and_the_tie() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 50, (2, 5))
    reports = _runs(model, times=3, inputs=ids, layers=["lm_head"])
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not weight_guard.copying(model)  # (its forward writes no weight: later runs copy nothing)
    reference = transformers.GPT2LMHeadModel(config).eval().double()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = reference(ids).logits
    for report in reports:
        (head,) = report.layers
        assert head.stats["mean"] == pytest.approx(logits.mean().item(), rel=1e-5, abs=1e-7)
        assert head.stats["max"] == pytest.approx(logits.max().item(), rel=1e-5)


@pytest.mark.parametrize("wrap", [
    lambda lin: nn.utils.parametrizations.weight_norm(lin),
    lambda lin: nn.utils.parametrizations.spectral_norm(lin),
    lambda lin: nn.utils.spectral_norm(lin),
], ids=["weight_norm", "spectral_norm", "old-spectral_norm"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_parametrized_weights_come_back_in_either_mode(wrap: Callable[[nn.Module], nn.Module], train: bool) -> None:
    """spectral_norm's power iteration updates its vectors in place in train mode."""
    torch.manual_seed(0)
    _runs(nn.Sequential(wrap(nn.Linear(6, 4)), nn.ReLU(), nn.Linear(4, 3)), times=3, train=train)


def test_an_interrupt_from_inside_a_later_run_puts_the_weights_back_and_the_property_away() -> None:
    class Interrupted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(6, 3)
            self.interrupt = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.interrupt:
                self.lin.weight.data.mul_(-2.0)
                raise KeyboardInterrupt
            return self.lin(x)

    model = Interrupted()
    before = _bits(model)
    _runs(model, times=1)
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        hookcli.stats(model, input_shapes=["2x6"])
    _assert_bits(before, model)
    model.interrupt = False
    _runs(model, times=2)


def test_a_hookcli_call_on_another_model_from_inside_a_forward_hands_both_back() -> None:
    inner = _WritesFromItsSecondRun(lambda w: w.data.mul_(-2.0))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hookcli.stats(inner, input_shapes=["2x6"])
            self.lin.weight.data.mul_(3.0)
            return self.lin(x)

    outer = Outer()
    before = _bits(inner)
    _runs(outer, times=3)
    _assert_bits(before, inner)


def test_two_threads_running_two_models_hand_both_back() -> None:
    import threading

    models = [_WritesFromItsSecondRun(lambda w: w.data.mul_(-2.0)), _WritesFromItsSecondRun(lambda w: None)]
    before = [_bits(m) for m in models]
    failures: list[BaseException] = []

    def runs(model: nn.Module) -> None:
        try:
            _runs(model, times=3, alone=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=runs, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=scaled_timeout(120))
    assert not any(thread.is_alive() for thread in threads)
    assert not failures
    for model, bits in zip(models, before):
        _assert_bits(bits, model)


def test_a_compiled_model_writing_through_data_on_later_runs_is_put_back_without_graph_breaks() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _WritesFromItsSecondRun(lambda w: w.data.mul_(-2.0))
    weight = model.weight.detach().double()
    x = torch.randn(2, 6)
    compiled = torch.compile(model, backend="eager")
    reports = _runs(compiled, times=3, inputs=x)
    assert not counters["graph_break"]
    assert not weight_guard.copying(compiled)  # (the later write was caught through .data: not said)
    # each run saw the weights its forward computed with, as an unwatched run would: -2 w from the 2nd on
    for report, scale in zip(reports, [1.0, -2.0, -2.0]):
        (root,) = report.layers
        assert root.stats["mean"] == pytest.approx((x.double() @ (scale * weight).T).mean().item(), rel=1e-5, abs=1e-6)
