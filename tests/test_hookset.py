"""The long-lived hook set (``engine.hooks.HookSet``): installed once around the user's own training
loop, records per step, hands the step back at the boundary and empties itself; parameter gradients
from the user's own ``backward()`` (accumulation included); checkpoint reruns not counted; nothing left
hooked after removal. Numbers are checked against plain torch (``torch.autograd.grad``)."""

from __future__ import annotations

import copy
import gc
import threading
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as torch_module

from reference import float64_stats
from transcripts import one_thread
from hookcli.engine.selection import select_modules
from hookcli.engine.hooks import HookSet
from hookcli.engine.taps import ChannelCounts, Gradients, InputGradients, Keep, Statistics
from hookcli.engine.state import run_lock
from hookcli.errors import UsageError
from tiny_models import Checkpointed
from timeouts import scaled_timeout


class ConvMLP(nn.Module):
    """A small conv -> MLP model: the loop's model."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.fc1 = nn.Linear(4 * 5 * 5, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.act(self.conv(x)).flatten(1))))


def _hooked_anywhere(model: nn.Module, tensors: list[torch.Tensor]) -> list[str]:
    """Every hook on ``model``'s modules, on ``tensors`` (parameters, inputs) or process-wide."""
    found = []
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs", "_backward_hooks"):
            if getattr(m, attr, None):
                found.append(f"{name or '(model)'}.{attr}")
    for i, t in enumerate(tensors):
        if t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None):
            found.append(f"tensor {i}")
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs", "_global_backward_hooks"):
        if getattr(torch_module, attr, None):
            found.append(attr)
    return found


def _assert_grad_stats(stats: dict[str, Any], g: torch.Tensor) -> None:
    want = float64_stats(g)
    for key in ("mean", "std", "min", "max", "norm"):
        assert stats[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_a_thousand_steps_keep_memory_flat_empty_the_set_at_each_boundary_and_leave_no_hook() -> None:
    with one_thread():  # (tiny ops on a busy machine cost 10x more with a thread pool)
        _thousand_steps()


def _thousand_steps() -> None:
    torch.manual_seed(0)
    model = ConvMLP()
    selection = select_modules(model, all_modules=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, target = torch.randn(4, 2, 5, 5), torch.randn(4, 3)
    lock_free: list[bool] = []
    hooks = HookSet().install(model, selection, [Statistics(), Gradients()],
                              params=list(model.named_parameters()))
    assert hooks.session is not None
    with hooks:
        for step in range(1000):
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            records = hooks.step_records()
            opt.step()
            opt.zero_grad()
            assert records.step == step
            assert [(r.name, r.call) for r in records.layers] == [(n, 0) for n, _ in selection]
            assert all(r.grad is not None for r in records.layers)
            assert all(p.grad is not None for p in records.params)
            assert set(hooks.session.sizes().values()) == {0}, hooks.session.sizes()  # emptied each step
            assert not hooks._accumulated
            if step == 100:
                gc.collect()
                objects = len(gc.get_objects())
            if step == 649:  # (traced steps cost 4x: the last 300 of them are measured)
                tracemalloc.start()
            if step == 699:
                gc.collect()
                baseline, _ = tracemalloc.get_traced_memory()
            if step in (100, 999):
                # between steps: no lock held (another thread takes it at once) and the collector runs
                t = threading.Thread(target=lambda: lock_free.append(run_lock().acquire(timeout=scaled_timeout(5)) and
                                                                     (run_lock().release() or True)))
                t.start()
                t.join()
                assert gc.isenabled()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - baseline
        tracemalloc.stop()
        # (torch's op dispatch and the first traced steps keep 10-20 KB once, then a few bytes a step:
        # 12.4, 13.0, 15.0, 15.5 KB after 300, 600, 900, 1200 traced steps; without the step boundary's
        # emptying the set keeps ~12 KB and ~40 objects a step, 3.6 MB over these 300)
        assert grown < 64 * 1024, f"{grown} bytes allocated and kept over the last 300 steps"
        assert len(gc.get_objects()) - objects < 50, "Python objects kept over 900 steps"
    assert lock_free == [True, True]
    assert _hooked_anywhere(model, list(model.parameters())) == []


@settings(max_examples=12, deadline=None)
@given(micro_steps=st.integers(1, 4), batch=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_user_backward_with_accumulation_gives_the_gradient_of_the_summed_loss(
        micro_steps: int, batch: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = ConvMLP()
    reference = copy.deepcopy(model)
    xs = [torch.randn(batch, 2, 5, 5) for _ in range(micro_steps)]
    with HookSet().install(model, select_modules(model, layers=["fc1"]), [Statistics(), Gradients()],
                           params=list(model.named_parameters())) as hooks:
        for x in xs:
            model(x).pow(2).mean().backward()  # the user's own backward, .grad accumulating
        records = hooks.step_records()
    params = list(reference.parameters())
    total = sum(reference(x).pow(2).mean() for x in xs)
    want = dict(zip([n for n, _ in reference.named_parameters()], torch.autograd.grad(total, params)))
    assert [p.name for p in records.params] == list(want)
    for p in records.params:
        assert records.accumulations[p.name] == micro_steps
        _assert_grad_stats(p.grad, want[p.name])
        assert p.norm == pytest.approx(float(dict(reference.named_parameters())[p.name].detach().double().norm()), rel=1e-6)
    # activations: one record per call (one call per micro-step), each with its own micro-step's gradient
    assert [(r.name, r.call) for r in records.layers] == [("fc1", i) for i in range(micro_steps)]
    for x, row in zip(xs, records.layers):
        out: list[torch.Tensor] = []
        handle = reference.fc1.register_forward_hook(lambda m, a, o, out=out: out.append(o))
        loss = reference(x).pow(2).mean()
        handle.remove()
        (g,) = torch.autograd.grad(loss, out)
        _assert_grad_stats(row.grad, g)


def test_a_parameter_no_backward_of_the_step_reached_has_no_gradient_even_with_an_old_grad() -> None:
    torch.manual_seed(0)
    model = ConvMLP()
    with HookSet().install(model, [], [], params=list(model.named_parameters())) as hooks:
        model(torch.randn(2, 2, 5, 5)).sum().backward()
        assert all(p.grad is not None for p in hooks.step_records().params)
        records = hooks.step_records()  # nothing ran in this step; the .grad of the last one is still there
    assert all(p.grad is not None for p in model.parameters())
    assert [p.grad for p in records.params] == [None] * 6 and records.accumulations == {}


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recomputation_is_not_counted_and_parameter_gradients_match(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    plain = copy.deepcopy(model)
    plain.reentrant = None
    names = ["a", "block", "block.0", "block.1", "head"]
    with HookSet().install(model, select_modules(model, all_modules=True), [Statistics(), Gradients()],
                           params=list(model.named_parameters())) as hooks:
        for step in range(2):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            records = hooks.step_records()
            model.zero_grad()
            assert [(r.name, r.call) for r in records.layers if r.called] == [(n, 0) for n in names]
            assert not any(r.raised for r in records.layers)
            # the reentrant flavour runs the block's first forward under no_grad: no output gradient there
            inside = {"block", "block.0", "block.1"} if reentrant else set()
            assert [r.name for r in records.layers if r.grad is None] == [n for n in names if n in inside]
            want = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
            for p, g in zip(records.params, want):
                assert records.accumulations[p.name] == 1
                _assert_grad_stats(p.grad, g)
    assert _hooked_anywhere(model, list(model.parameters())) == []


class Boom(Exception):
    pass


@pytest.mark.parametrize("process_wide", [True, False])
def test_no_hook_is_left_after_removal_also_when_the_loop_raises(process_wide: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(40)))
    selection = select_modules(model, all_modules=True)
    x = torch.randn(2, 4, requires_grad=True)  # a leaf input: its gradient hook is a leaf hook
    hooks = HookSet()
    with pytest.raises(Boom), hooks.install(
            model, selection, [Statistics(), Gradients(), *([] if process_wide else [InputGradients()])],
            params=list(model.named_parameters()), model_modules=len(list(model.modules())) if process_wide else None):
        assert bool(torch_module._global_forward_hooks) == process_wide
        model(x).sum().backward()
        assert hooks.session is not None
        assert bool(hooks.session.leaf_hooks) != process_wide
        hooks.step_records()
        assert not x._backward_hooks  # leaf hooks go at the step boundary
        model(x)  # a step in progress, with the loop raising
        raise Boom
    assert _hooked_anywhere(model, [x, *model.parameters()]) == []
    hooks.remove()  # twice is fine


def test_a_hook_failure_is_raised_at_the_boundary_and_the_next_step_starts_clean() -> None:
    model = ConvMLP()
    failures = iter([ValueError("broken keep"), None])

    def keep(name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc

    with HookSet().install(model, select_modules(model, layers=["fc2"]), [Keep(keep)]) as hooks:
        with torch.no_grad():
            model(torch.randn(1, 2, 5, 5))
        with pytest.raises(Exception, match="broken keep"):
            hooks.step_records()
        with torch.no_grad():
            model(torch.randn(1, 2, 5, 5))
        records = hooks.step_records()
    assert records.step == 1 and [(r.name, r.call) for r in records.layers] == [("fc2", 0)]


def test_a_hook_set_is_installed_once_and_records_only_once_installed() -> None:
    model = ConvMLP()
    hooks = HookSet()
    with pytest.raises(UsageError, match="not installed"):
        hooks.step_records()
    with hooks.install(model, select_modules(model)):
        with pytest.raises(UsageError, match="installed already"):
            hooks.install(model, select_modules(model))
        assert model.conv._forward_hooks  # the refused second install took nothing away
    assert _hooked_anywhere(model, list(model.parameters())) == []


def test_begin_step_switches_recording_and_channel_counts_and_the_training_root_leaves_validation_out() -> None:
    """The session's step switches are its own (``begin_step``, ``go_idle``; ``idle`` is read-only): an idle
    step records nothing, a recording step counts each output's nonzeros per channel only when it is
    measured in full (its ``ChannelCounts`` tap hears it begin; equal to plain torch's count), and with a ``training_root`` a forward of that model in eval mode under
    ``no_grad`` (validation) is left out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU())
    x = torch.randn(4, 2, 5, 5)
    counts = ChannelCounts([("1", model[1])])
    hooks = HookSet().install(model, [("1", model[1])], [Statistics(), counts], training_root=model)
    session = hooks.session
    assert session is not None
    try:
        with pytest.raises(AttributeError):
            session.idle = True  # type: ignore[misc]
        session.begin_step(recording=False)
        model(x)
        assert session.idle and session.calls == []
        session.begin_step(recording=True, full=False)
        model(x)
        assert [c.outputs[0].nonzeros for c in session.calls] == [None]
        hooks.end_step()
        session.begin_step(recording=True, full=True)
        out = model(x)
        expected = (out.detach() != 0).sum(dim=(0, 2, 3))
        assert session.calls[0].outputs[0].nonzeros.tolist() == expected.tolist()
        hooks.end_step()
        model.eval()
        with torch.no_grad():
            model(x)  # validation: not the training's step
        assert session.calls == []
        model.train()
        session.go_idle()
        model(x)
        assert session.calls == []
    finally:
        hooks.remove()
