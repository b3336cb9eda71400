"""The loss of a loop that does not hand it to the watch (docs/watch.md#the-loss-without-wstep): the value
``backward()`` is called on, summed over a step's micro-batches, the GradScaler's unscaled; checked
against the loop's own values (plain torch), bit for bit."""

from __future__ import annotations

import torch
from torch import nn

import hookcli
from test_watch import no_hooks_left


def test_accumulated_micro_batches_give_the_sum_of_what_backward_was_called_on() -> None:
    """4 micro-batches a step, each loss divided by 4 as the script scales it: the step's loss is their
    sum (the mean loss), added on the device in backward order: plain torch's float32 sum, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    want = []
    with hookcli.watch(model, opt, every=2) as w:
        for _ in range(5):
            total = None
            for _ in range(4):
                loss = model(torch.randn(8, 4)).pow(2).mean() / 4
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            want.append(total.item())
            opt.step()
            opt.zero_grad()
            logged = w.last
    assert logged is not None and logged.step == 4 and logged.loss == want[4]
    assert w._watcher.roots.notes == []
    no_hooks_left(model, opt)


def test_the_original_backward_and_grad_scaler_come_back() -> None:
    backward, scale = torch.autograd.backward, torch.amp.GradScaler.scale
    model = nn.Linear(3, 1)
    with hookcli.watch(model, every=1) as w:
        assert torch.autograd.backward is not backward
        model(torch.randn(2, 3)).sum().backward()
        w.step()
    assert torch.autograd.backward is backward and torch.amp.GradScaler.scale is scale


def test_a_grad_scalers_root_counts_unscaled() -> None:
    """scaler.scale(loss).backward(): the log's loss is ``loss`` (the scaled one overflows by design)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    losses, logged = [], []
    with hookcli.watch(model, opt, every=1) as w:
        for _ in range(4):
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True), reduction="sum")
            scaled = scaler.scale(loss)
            assert not torch.isfinite(scaled) or len(losses) > 0
            scaled.backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            w.step()
            losses.append(loss.item())
            logged.append(w.last.loss)
    assert logged == losses
    assert [f for f in w.findings if f.rule == "nonfinite"] == []


def test_a_non_scalar_root_leaves_the_step_without_a_loss_and_is_said_once() -> None:
    """``y.backward(gradient)``: no loss (the log's is null), one note for the whole run."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with hookcli.watch(model, every=1) as w:
        for _ in range(3):
            y = model(torch.randn(4, 3))
            y.backward(torch.ones_like(y))
            w.step()
            assert w.last.loss is None
    assert w._watcher.roots.notes == ["backward() was called on a tensor of shape [4, 2]: steps with it have no "
                                      "loss (pass w.step(loss=...) in the script)"]


def test_another_models_backward_is_not_the_watched_models_loss() -> None:
    """Two models in one process, only one watched: the other's backward adds nothing to the loss."""
    torch.manual_seed(0)
    watched, other = nn.Linear(3, 1), nn.Linear(3, 1)
    with hookcli.watch(watched, every=1) as w:
        x = torch.randn(4, 3)
        other(x).pow(2).mean().backward()
        loss = watched(x).pow(2).mean()
        loss.backward()
        w.step()
    assert w.last.loss == loss.item()
