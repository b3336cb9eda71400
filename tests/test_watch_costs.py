"""What a logged step of ``hookcli.watch`` costs (docs/watch.md#costs): the norms of the parameters and
of their updates are float64 sums read from each tensor in place, with no widened copy of it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hookcli
from hookcli.engine.kernel import NO_KERNEL_ENV
from hookcli.engine.stats import _fastreduce, l2_norm, to_host

needs_kernel = pytest.mark.skipif(_fastreduce is None, reason="hookcli.engine._fastreduce was not built here")


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       shape=st.lists(st.integers(0, 40), min_size=1, max_size=3), layout=st.sampled_from(["dense", "t", "step"]),
       scale=st.sampled_from([1e-20, 1e-3, 1.0, 1e4]), special=st.sampled_from([None, math.nan, math.inf]),
       kernel=st.booleans(), seed=st.integers(0, 2**16))
def test_l2_norm_is_torchs_float64_norm(dtype: torch.dtype, shape: list[int], layout: str, scale: float,
                                        special: float | None, kernel: bool, seed: int) -> None:
    """Every dtype, dense or not, empty, tiny or large values, NaN/Inf, with the kernel and without."""
    generator = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
    if special is not None and t.numel():
        t.view(-1)[t.numel() // 2] = special
    if layout == "t" and t.dim() > 1:
        t = t.transpose(0, -1)
    elif layout == "step":
        t = t[::2]
    expected = float(t.double().norm())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(NO_KERNEL_ENV, "0" if kernel else "1")
        got = to_host([l2_norm(t)])[0]
    assert len(got) == 1
    if math.isnan(expected):
        assert math.isnan(got[0])
    else:
        assert got[0] == pytest.approx(expected, rel=1e-12, abs=0.0)


class Float64Copies(TorchDispatchMode):
    """Notes every op that makes a float64 value out of a float32 tensor of at least ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        wide = (kwargs or {}).get("dtype") == torch.float64 or (isinstance(out, torch.Tensor)
                                                                 and out.dtype == torch.float64)
        if wide and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.numel() >= self.numel
                        for a in args):
            self.seen.append(str(func))
        return out


@needs_kernel
def test_a_logged_step_widens_no_parameter_to_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms of each parameter (at the pre-step) and of its update (at the post-step) are read in
    place by the C kernel: no op of the logged step turns a parameter-sized float32 tensor into float64
    (``vector_norm(p, dtype=float64)`` did: a float64 copy of every weight, ~9% of a GPT-style step).
    The numbers are still float64 norms: checked against plain torch."""
    monkeypatch.delenv(NO_KERNEL_ENV, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 64)
    with hookcli.watch(model, optimizer, every=1) as w:
        model(x).square().mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with Float64Copies(numel=64 * 256) as mode:
            optimizer.step()
            optimizer.zero_grad()
            w.step()
    assert mode.seen == []
    for entry in w.last.params:
        p = dict(model.named_parameters())[entry.name]
        assert entry.norm == pytest.approx(float(before[entry.name].double().norm()), rel=1e-12)
        assert entry.update_norm == pytest.approx(float((p.detach().double() - before[entry.name].double()).norm()),
                                                  rel=1e-5)


class CountNonzeros(TorchDispatchMode):
    """The size of the input and of the result of every ``count_nonzero`` op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.count_nonzero:
            self.seen.append((args[0].numel(), out.numel()))
        return out


@pytest.mark.parametrize("flight", [None, 2])
def test_channels_cost_one_count_per_output_on_logged_steps_only(flight: int | None) -> None:
    """The per-channel zero counts of ``dead_units``: one ``count_nonzero`` per selected output with a
    channel dimension on a logged step, whose result is one number per channel (the host transfer grows
    by the channel counts, not by the values); none on unlogged steps, flight-recorded ones included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 8, 8)
    counted = []
    with hookcli.watch(model, optimizer, every=2, flight=flight) as w:
        for _step in range(4):
            with CountNonzeros() as mode:
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                w.step()
            counted.append(mode.seen)
    # the selected outputs: conv [2, 8, 6, 6] and its ReLU (8 channels in dim 1), Linear's [2, 4] (4, last)
    assert [(layer.name, layer.channels) for layer in w.last.layers] == [("0", 8), ("1", 8), ("3", 4)]
    per_output = [(2 * 8 * 36, 8), (2 * 8 * 36, 8), (2 * 4, 4)]
    assert sorted(counted[0]) == sorted(per_output) and sorted(counted[2]) == sorted(per_output)
    assert counted[1] == [] and counted[3] == []


def test_channels_are_not_counted_when_dead_units_is_off() -> None:
    """Only the dead_units rule reads the per-channel counts: switched off, a logged step counts none
    (and its layers carry no channel fields)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    with hookcli.watch(model, every=1, rules={"dead_units": False}) as w:
        with CountNonzeros() as mode:
            model(torch.randn(2, 3, 8, 8)).sum().backward()
            w.step()
    assert mode.seen == [] and [layer.channels for layer in w.last.layers] == [None, None]
