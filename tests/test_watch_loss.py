"""The loss of a loop that does not hand it to the watch (docs/watch.md#the-loss-without-wstep): the value
``backward()`` is called on, summed over a step's micro-batches, the GradScaler's unscaled; checked
against the loop's own values (plain torch), bit for bit."""

from __future__ import annotations

from typing import Any

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


def test_a_cross_entropy_jumping_from_2_45_to_4_is_a_loss_spike() -> None:
    """The rule on its own (records only): a noisy cross-entropy around 2.45 (seeded, spread 0.05) that
    jumps to 4.0 is a spike at that step, told once while it stays up; the same noise without the jump
    finds nothing."""
    from hookcli.commands.watch_rules import Rules, rule_settings
    from hookcli.records import WatchStep

    g = torch.Generator().manual_seed(0)
    noise = (torch.randn(60, generator=g, dtype=torch.float64) * 0.05).tolist()
    for jump in (True, False):
        rules = Rules(rule_settings(None))
        found = []
        for step in range(60):
            loss = 4.0 if jump and step >= 40 else 2.45 + noise[step]
            found += [f for f in rules.observe(WatchStep(step, loss)) if f.rule == "loss_spike"]
        assert [f.step for f in found] == ([40] if jump else [])
        if jump:
            assert found[0].message.startswith("loss spike at step 40: 4, ")


def bigram_run(steps: int, raise_lr_at: int | None = None) -> Any:
    """A char-level bigram model (vocabulary 12) on a seeded Markov chain, Adam at 1e-2, every step
    logged, the loss from backward() alone: a healthy noisy cross-entropy near 2.45 at the start."""
    torch.manual_seed(0)
    vocab = 12
    transitions = torch.softmax(torch.randn(vocab, vocab) * 2, dim=1)
    model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, vocab))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with hookcli.watch(model, opt, every=1) as w:
        for step in range(steps):
            if step == raise_lr_at:
                for group in opt.param_groups:
                    group["lr"] *= 100
            x = torch.randint(0, vocab, (64,))
            y = torch.multinomial(transitions[x], 1).squeeze(1)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return w


def test_a_healthy_noisy_run_has_no_loss_spike_and_a_raised_learning_rate_has_one() -> None:
    healthy = bigram_run(150)
    assert [f for f in healthy.findings if f.rule == "loss_spike"] == []
    raised = bigram_run(150, raise_lr_at=100)
    spikes = [f for f in raised.findings if f.rule == "loss_spike"]
    assert spikes and 100 <= spikes[0].step <= 103
