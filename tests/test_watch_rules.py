"""The rules of ``hookcli.watch`` (docs/watch.md#rules): a zoo of seeded training bugs, each flagged within 3
logged steps naming the right layer or parameter, and healthy short runs of six families with no finding;
the findings on the log's lines, ``on_finding="raise"``, and ``rules={...}`` validated."""

from __future__ import annotations

import ast
import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import hookcli
from hookcli.errors import CheckFailedError, ConfigError
from hookcli.records import Finding

DataFn = Callable[[nn.Module, int], torch.Tensor]


class Net(nn.Module):
    """A hand-written MLP: fc1 -> act1 -> fc2 -> act2 -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(4, 16), nn.ReLU()
        self.fc2, self.act2 = nn.Linear(16, 16), nn.ReLU()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def regression(spike_at: int | None = None) -> DataFn:
    """Batches of a regression task from a generator of their own; ``spike_at``: that step's targets are
    100x (a corrupted batch)."""
    g = torch.Generator().manual_seed(1)

    def data(model: nn.Module, step: int) -> torch.Tensor:
        x = torch.randn(32, 4, generator=g)
        y = x.sum(1, keepdim=True) * (100 if step == spike_at else 1)
        return nn.functional.mse_loss(model(x), y)

    return data


def train(model: nn.Module, opt: torch.optim.Optimizer, data: DataFn, steps: int, **kwargs: Any) -> Any:
    """``steps`` training steps under a watch that logs every step; the watch."""
    with hookcli.watch(model, opt, every=1, **kwargs) as w:
        for step in range(steps):
            loss = data(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    return w


def flagged(findings: list[Finding], rule: str, by_step: int) -> list[Finding]:
    return [f for f in findings if f.rule == rule and f.step <= by_step]


# -- the zoo: seeded bugs ------------------------------------------------------------------------------------------


def test_a_nan_injected_at_one_layer_is_named_at_its_step() -> None:
    """fc2's output gets a NaN at step 2 (a hook of the test's own, registered first): the first NaN/Inf
    is fc2's output at step 2, forward, though act2 and head are NaN too; counted as plain torch counts."""
    torch.manual_seed(0)
    model = Net()
    seen: list[torch.Tensor] = []

    def inject(_m: nn.Module, _i: Any, out: torch.Tensor) -> torch.Tensor:
        if len(seen) == 2:
            out = out.clone()
            out[0, :3] = float("nan")
        seen.append(out.detach())
        return out

    model.fc2.register_forward_hook(inject)
    w = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), regression(), 4)
    (first,) = [f for f in w.findings if f.rule == "nonfinite"]
    assert (first.step, first.layer, first.direction, first.severity) == (2, "fc2", "forward", "error")
    assert first.value == int(torch.isnan(seen[2]).sum()) == 3
    assert not flagged(w.findings, "nonfinite", 1)


class SqrtBlock(nn.Module):
    """A block with the seeded bug of torch.where: sqrt where positive. The forward is finite (where
    drops sqrt's NaN at the negative values), the backward is not (where's 0 times sqrt's NaN: NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h))


def test_a_nan_born_in_the_backward_is_named_at_the_first_layer_of_the_backward() -> None:
    """The first non-finite gradient in backward order is blk.fc's output's (the layers before it get
    NaN from it), made by blk's own code (its sqrt) between blk.fc and head: blk is named; the forward
    is finite at that step, as plain torch shows."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc0", nn.Linear(4, 16))
    model.add_module("act0", nn.Tanh())
    model.add_module("blk", SqrtBlock())
    model.add_module("head", nn.Linear(16, 1))
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    out = model[2].fc(model[1](model[0](x)))
    y = model[3](torch.where(out > 0, torch.sqrt(out), torch.zeros_like(out)))
    assert torch.isfinite(y).all()
    grad = torch.autograd.grad(y.pow(2).mean(), out)[0]
    assert torch.isnan(grad).any()
    w = train(model, torch.optim.SGD(model.parameters(), lr=1e-2), regression(), 2)
    first = [f for f in w.findings if f.rule == "nonfinite"]
    assert [(f.step, f.layer, f.direction) for f in first] == [(0, "blk", "backward")]  # its sqrt's backward
    assert first[0].message.startswith("first NaN/Inf of the run at step 0: made in blk's own backward (the "
                                       "gradient of blk.fc's output); first seen in blk.fc's gradient")


def test_a_learning_rate_100x_too_high_is_flagged() -> None:
    """Adam at lr 1 where 1e-2 trains (the healthy run below): the weights' median update / norm ratio
    is above 1, and the finding's value is that median, from plain torch's weights around the step."""
    torch.manual_seed(0)
    model = Net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w = train(model, torch.optim.Adam(model.parameters(), lr=1.0), regression(), 1)
    ratios = sorted(float((p.detach() - before[n]).norm() / before[n].norm())
                    for n, p in model.named_parameters() if p.dim() >= 2)
    (found,) = flagged(w.findings, "update_ratio", 2)
    assert found.step == 0 and found.direction == "update" and found.value == pytest.approx(ratios[1], rel=1e-5)
    assert found.layer in ("fc1.weight", "fc2.weight", "head.weight") and found.value > found.limit == 1.0


def test_a_learning_rate_far_too_low_is_flagged() -> None:
    torch.manual_seed(0)
    model = Net()
    w = train(model, torch.optim.Adam(model.parameters(), lr=1e-9), regression(), 1)
    (found,) = flagged(w.findings, "update_ratio", 2)
    assert found.value < found.limit == 1e-6 and "too low" in found.message


def test_a_learning_rate_that_stays_too_low_is_told_once_not_at_every_logged_step() -> None:
    """Adam at lr 1e-9 for 6 logged steps: plain torch's median update ratio is below 1e-6 at each of
    them, and the finding is told once, at step 0 (it was repeated at each logged step)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-9)
    medians = []
    data = regression()
    with hookcli.watch(model, opt, every=1, rules={"frozen": False}) as w:
        for step in range(6):
            before = [p.detach().clone() for p in model.parameters()]
            loss = data(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
            ratios = sorted(float((p.detach() - b).norm() / b.norm())
                            for p, b in zip(model.parameters(), before) if p.dim() >= 2)
            medians.append(ratios[len(ratios) // 2])
    assert all(m < 1e-6 for m in medians)
    assert [(f.rule, f.step) for f in w.findings] == [("update_ratio", 0)]


def test_gradients_that_keep_vanishing_are_told_once() -> None:
    """The twelve-sigmoid MLP (below) for 5 logged steps: one grad_depth finding, at step 0."""
    torch.manual_seed(0)
    body = [m for _ in range(12) for m in (nn.Linear(16, 16), nn.Sigmoid())]
    model = nn.Sequential(nn.Linear(4, 16), *body, nn.Linear(16, 1))
    w = train(model, torch.optim.SGD(model.parameters(), lr=1e-2), regression(), 5, rules={"frozen": False})
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    first = model[0](x)
    last = model[-1](model[1:-1](first))
    g_first, g_last = torch.autograd.grad(nn.functional.mse_loss(last, x.sum(1, keepdim=True)), [first, last])
    assert float(g_first.pow(2).mean().sqrt() / g_last.pow(2).mean().sqrt()) < 1e-6  # still vanishing at the end
    assert [(f.rule, f.step, f.layer) for f in w.findings if f.rule == "grad_depth"] == [("grad_depth", 0, "0")]


def test_a_zero_initialised_head_is_not_gradients_vanishing_across_depth() -> None:
    """timm's MLP-Mixer initialises its head to 0: at step 0 no gradient comes back through it (every
    output before it gets exactly 0, torch.autograd.grad agrees); grad_depth said "vanish ... 0x head's"."""
    mlp_mixer = pytest.importorskip("timm.models.mlp_mixer")
    torch.manual_seed(0)
    model = mlp_mixer.MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=32)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    stem = model.stem(x)
    logits = model.forward_head(model.norm(model.blocks(stem)))
    assert torch.equal(logits, model(x))
    (g_stem,) = torch.autograd.grad(nn.functional.cross_entropy(logits, torch.zeros(2, dtype=torch.long)), [stem])
    assert torch.count_nonzero(g_stem) == 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hookcli.watch(model, opt) as w:
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), torch.zeros(2, dtype=torch.long))
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    assert [f for f in w.findings if f.rule == "grad_depth"] == []


def test_a_layer_left_out_of_the_optimizer_is_frozen() -> None:
    """The head's parameters require grad but were never given to the optimizer: named at the third
    logged step (the rule's 3 steps in a row), and nothing else is."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam([*model.fc1.parameters(), *model.fc2.parameters()], lr=1e-2)
    w = train(model, opt, regression(), 4)
    assert [(f.rule, f.layer, f.step) for f in w.findings] == [("frozen", "head.weight", 2), ("frozen", "head.bias", 2)]


def test_a_bad_init_that_kills_the_relus_is_flagged_at_the_relu() -> None:
    """fc1's bias at -20: act1's output is all zeros (plain torch says so) in every step."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc1.bias.fill_(-20.0)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    assert (model.act1(model.fc1(x)) == 0).all()
    w = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), regression(), 3)
    (dead,) = flagged(w.findings, "dead_units", 2)  # 32 values a channel: judged as a whole output
    assert (dead.layer, dead.direction, dead.value) == ("act1", "forward", 1.0)


class ConvNet(nn.Module):
    """conv1 -> act1 -> conv2 -> act2 -> pool -> head, on 3x16x16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.act1 = nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()
        self.conv2, self.act2 = nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.act2(self.conv2(self.act1(self.conv1(x))))).flatten(1))


def _conv_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


@pytest.mark.parametrize("killed", [[1, 5, 9, 14], [0, 1, 2, 3]])
def test_a_bad_init_that_kills_4_of_16_channels_is_flagged_at_that_layer(killed: list[int]) -> None:
    """conv1's bias at -50 on 4 of its 16 channels: those channels of act1 are zero (plain torch says so)
    while the other 12 live; the whole output is only ~60% zeros, yet the rule names act1 and its 4
    channels within 3 logged steps. Each logged step's per-channel counts are plain torch's."""
    torch.manual_seed(0)
    model = ConvNet()
    with torch.no_grad():
        model.conv1.bias[killed] = -50.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with hookcli.watch(model, opt, every=1) as w:
        for step in range(3):
            x, y = _conv_batch(step)
            with torch.no_grad():
                act1 = model.act1(model.conv1(x))
                act2 = model.act2(model.conv2(act1))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
            layers = {layer.name: layer for layer in w.last.layers}
            for name, out in (("act1", act1), ("act2", act2)):
                zeros = (out == 0).double().mean(dim=(0, 2, 3)).tolist()  # channels first: dim 1
                assert layers[name].channels == 16
                assert layers[name].channel_zero_fraction == pytest.approx(zeros, abs=1e-12)
                assert layers[name].dead_channels == sum(z == 1.0 for z in zeros)
            assert [z == 1.0 for z in layers["act1"].channel_zero_fraction] == [i in killed for i in range(16)]
            assert layers["act1"].stats["zero_fraction"] < 0.9  # the whole output: far below fraction 0.99
    (dead,) = flagged(w.findings, "dead_units", 2)
    assert (dead.layer, dead.step, dead.value, dead.direction) == ("act1", 2, 4.0, "forward")
    assert "4 of the 16 channels of act1's output" in dead.message and ", ".join(map(str, killed)) in dead.message


def test_dead_channels_and_channels_are_on_the_log_line(tmp_path: Path) -> None:
    """The log line of each layer with a channel dimension carries ``dead_channels`` and ``channels``
    (Linear's last dim: [32, 16] -> 16 channels); per-channel fractions stay off the log."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc1.bias[:3] = -20.0
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    dead = int((model.act1(model.fc1(x)) == 0).all(dim=0).sum())
    assert dead >= 3
    log = tmp_path / "log.jsonl"
    train(model, torch.optim.SGD(model.parameters(), lr=0.0), regression(), 1, out=log)
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    layers = {layer["name"]: layer for layer in line["layers"]}
    assert (layers["act1"]["dead_channels"], layers["act1"]["channels"]) == (dead, 16)
    assert (layers["head"]["dead_channels"], layers["head"]["channels"]) == (0, 1)
    assert "channel_zero_fraction" not in layers["act1"]


def test_a_corrupted_batch_is_a_loss_spike_at_its_step() -> None:
    torch.manual_seed(0)
    model = Net()
    w = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), regression(spike_at=5), 6)
    spikes = [f for f in w.findings if f.rule == "loss_spike"]
    assert [(f.step, f.layer, f.direction) for f in spikes] == [(5, None, "loss")]
    assert spikes[0].value > spikes[0].limit == 8.0


def test_sgd_diverging_is_exploding_gradients() -> None:
    """SGD at lr 0.5 on the regression (0.01 trains): the gradient's norm grows step over step; flagged
    within 3 logged steps, naming a parameter of the model."""
    torch.manual_seed(0)
    model = Net()
    w = train(model, torch.optim.SGD(model.parameters(), lr=0.5), regression(), 3)
    found = flagged(w.findings, "grad_explode", 2)
    assert found and found[0].layer in dict(model.named_parameters()) and found[0].direction == "backward"


def test_gradients_vanishing_across_depth_are_flagged_at_the_first_layer() -> None:
    """Twelve sigmoid layers: the gradient's RMS at the first Linear's output over the head's is about
    1e-11; the value is that ratio from torch.autograd.grad."""
    torch.manual_seed(0)
    body = [m for _ in range(12) for m in (nn.Linear(16, 16), nn.Sigmoid())]
    model = nn.Sequential(nn.Linear(4, 16), *body, nn.Linear(16, 1))
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    first = model[0](x)
    last = model[-1](model[1:-1](first))
    g_first, g_last = torch.autograd.grad(nn.functional.mse_loss(last, x.sum(1, keepdim=True)), [first, last])
    want = float(g_first.double().pow(2).mean().sqrt() / g_last.double().pow(2).mean().sqrt())
    w = train(model, torch.optim.SGD(model.parameters(), lr=1e-2), regression(), 1)
    (found,) = flagged(w.findings, "grad_depth", 2)
    assert (found.layer, found.step, found.direction) == ("0", 0, "backward")
    assert found.value == pytest.approx(want, rel=1e-4) and found.value < found.limit == 1e-6


class Tokens(nn.Module):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.head = nn.Linear(64, 50)
        if bad:  # the seeded bug: one dimension of the first token's row at 1e4 (a mis-scaled init)
            with torch.no_grad():
                self.emb.weight[0, 5] = 1e4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def tokens(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randint(1, 50, (4, 128), generator=torch.Generator().manual_seed(step))
    x[0, 0] = 0  # token 0 once in the batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def test_a_massive_activation_is_flagged_at_its_layer() -> None:
    """The value is abs max / RMS of emb's output as plain torch computes it in float64."""
    torch.manual_seed(0)
    model = Tokens(bad=True)
    x = torch.randint(1, 50, (4, 128), generator=torch.Generator().manual_seed(0))
    x[0, 0] = 0
    out = model.emb(x).detach().double()
    want = float(out.abs().max() / out.pow(2).mean().sqrt())
    w = train(model, torch.optim.SGD(model.parameters(), lr=1e-3), tokens, 1)
    found = flagged(w.findings, "activation_growth", 2)[0]  # the first; head, fed by it, may follow
    assert (found.layer, found.step, found.direction) == ("emb", 0, "forward")
    assert found.value == pytest.approx(want, rel=1e-5) and found.value > found.limit


# -- healthy runs: no finding --------------------------------------------------------------------------------------


def _images(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Checkpointed(nn.Module):
    """Blocks under activation checkpointing (their forward runs again in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _family(name: str) -> tuple[nn.Module, torch.optim.Optimizer, DataFn]:
    torch.manual_seed(0)
    if name == "torchvision resnet18":
        torchvision = pytest.importorskip("torchvision")
        model = torchvision.models.resnet18(weights=None, num_classes=10)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), _images
    if name == "timm vit":
        timm = pytest.importorskip("timm")
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                                  num_classes=10, depth=2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), _images
    if name == "gpt2":
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)

        def text(m: nn.Module, step: int) -> torch.Tensor:
            ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(step))
            return m(input_ids=ids, labels=ids).loss

        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), text
    if name == "lstm":
        model = LSTMNet()

        def seqs(m: nn.Module, step: int) -> torch.Tensor:
            x = torch.randn(8, 10, 8, generator=torch.Generator().manual_seed(step))
            return nn.functional.mse_loss(m(x), x.sum((1, 2))[:, None] / 10)

        return model, torch.optim.Adam(model.parameters(), lr=1e-2), seqs
    if name == "mlp":
        model = Net()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2), regression()
    model = Checkpointed()

    def classes(m: nn.Module, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        return nn.functional.cross_entropy(m(torch.randn(16, 16, generator=g)), torch.randint(0, 2, (16,), generator=g))

    return model, torch.optim.Adam(model.parameters(), lr=1e-3), classes


@pytest.mark.parametrize("family", ["torchvision resnet18", "timm vit", "gpt2", "lstm", "mlp", "checkpointing"])
def test_a_healthy_run_has_no_finding(family: str, tmp_path: Path) -> None:
    """Six steps, every one logged, with every rule on; the log's lines carry an empty findings list."""
    model, opt, data = _family(family)
    log = tmp_path / "log.jsonl"
    w = train(model.train(), opt, data, 6, out=log, on_finding="raise")
    assert w.findings == []
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6)) and all(line["findings"] == [] for line in lines)
    assert all(math.isfinite(line["loss"]) for line in lines)


# -- the findings' line, raise, and the rules' settings -------------------------------------------------------------


def test_findings_are_on_their_step_line_and_pandas_reads_them(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    torch.manual_seed(0)
    model = Net()
    log = tmp_path / "log.jsonl"
    opt = torch.optim.Adam([*model.fc1.parameters(), *model.fc2.parameters()], lr=1e-2)
    w = train(model, opt, regression(), 4, out=log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [len(line["findings"]) for line in lines] == [0, 0, 2, 0]
    assert lines[2]["findings"] == [f.to_dict() for f in w.findings]
    frame = pandas.read_json(log, lines=True)
    found = pandas.json_normalize(frame.to_dict("records"), "findings")  # a finding has its step
    assert list(found["layer"]) == ["head.weight", "head.bias"] and set(found["rule"]) == {"frozen"}
    assert list(found["step"]) == [2, 2]


def test_on_finding_raise_raises_after_the_line_is_written(tmp_path: Path) -> None:
    """CheckFailedError (exit 1: a check failed) at w.step() of the finding's step, its line written;
    the hooks are gone and the model's weights are those of the steps that ran."""
    torch.manual_seed(0)
    model = Net()
    log = tmp_path / "log.jsonl"
    opt = torch.optim.Adam([*model.fc1.parameters(), *model.fc2.parameters()], lr=1e-2)
    data = regression()
    steps = []
    with pytest.raises(CheckFailedError) as info:
        with hookcli.watch(model, opt, out=log, on_finding="raise") as w:
            for step in range(10):
                loss = data(model, step)
                loss.backward()
                opt.step()
                opt.zero_grad()
                steps.append(step)
                w.step(loss=loss)
    assert steps == [0, 1, 2] and info.value.exit_code == 1
    assert "frozen" in str(info.value) and "head.weight" in str(info.value) and info.value.hint
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]
    assert not model.fc1._forward_hooks and [f.layer for f in w.findings] == ["head.weight", "head.bias"]


def test_rules_settings_change_the_thresholds_and_switch_rules_off() -> None:
    """frozen switched off finds nothing; its steps at 2 names the frozen weights a step sooner; the
    spike of a corrupted batch passes under a loss_spike ratio above it."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam([*model.fc1.parameters(), *model.fc2.parameters()], lr=1e-2)
    w = train(model, opt, regression(), 4, rules={"frozen": False})
    assert w.findings == []
    torch.manual_seed(0)
    model = Net()
    w = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), regression(), 4, rules={"frozen": {"steps": 2}})
    assert w.findings == []
    model = Net()
    opt = torch.optim.Adam(model.fc1.parameters(), lr=1e-2)
    w = train(model, opt, regression(), 2, rules={"frozen": {"steps": 2}, "dead_units": False})
    assert {f.layer for f in w.findings if f.step == 1} >= {"head.weight", "fc2.weight"}
    torch.manual_seed(0)
    model = Net()
    w = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), regression(spike_at=5), 6,
              rules={"loss_spike": {"ratio": 1e6}, "grad_explode": False})
    assert w.findings == []


@settings(max_examples=30, deadline=None)
@given(rules=st.one_of(
    st.fixed_dictionaries({"loss_spike": st.fixed_dictionaries(
        {"ratio": st.one_of(st.floats(max_value=1.0), st.just(math.inf), st.just(math.nan), st.booleans(),
                            st.text(max_size=3))})}),
    st.fixed_dictionaries({"dead_units": st.fixed_dictionaries({"fraction": st.floats(1.0001, 1e9)})}),
    st.fixed_dictionaries({"frozen": st.fixed_dictionaries({"steps": st.integers(max_value=0)})}),
    st.fixed_dictionaries({"update_ratio": st.fixed_dictionaries({"low": st.just(2.0), "high": st.just(1.0)})}),
    st.fixed_dictionaries({"grad_depth": st.fixed_dictionaries({"low": st.floats(max_value=0.0)})}),
    st.just({"loss_spikes": {}}), st.just({"frozen": {"step": 3}}), st.just({"frozen": 3}), st.just([1])))
def test_bad_rules_are_a_config_error_before_any_hook(rules: Any) -> None:
    """A ConfigError (exit 2) naming the rule, with a hint; nothing hooked."""
    model = Net()
    with pytest.raises(ConfigError) as info:
        hookcli.watch(model, rules=rules)
    assert info.value.exit_code == 2 and info.value.hint and str(info.value).startswith("rules")
    assert not model.fc1._forward_hooks


def test_a_misspelt_rule_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="'loss_spikes'.*loss_spike"):
        hookcli.watch(Net(), rules={"loss_spikes": {"ratio": 2.0}})


def test_on_finding_must_be_warn_or_raise() -> None:
    with pytest.raises(hookcli.errors.UsageError, match="on_finding"):
        hookcli.watch(Net(), on_finding="stop")


def test_the_rules_read_records_only() -> None:
    """The rules are pure functions of the records: their module imports neither torch nor the engine."""
    source = Path(hookcli.__file__).parent / "commands" / "watch_rules.py"
    imported = {alias.name for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(ast.parse(source.read_text()))
                 if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("torch", "numpy") or m.startswith("hookcli.engine")}


def test_when_the_optimizer_ends_steps_raise_comes_at_the_blocks_end(tmp_path: Path) -> None:
    """No w.step(): nothing is raised into optimizer.step(); the watch goes idle after the finding's line
    and CheckFailedError comes when the block ends."""
    torch.manual_seed(0)
    model = Net()
    log = tmp_path / "log.jsonl"
    opt = torch.optim.Adam([*model.fc1.parameters(), *model.fc2.parameters()], lr=1e-2)
    data = regression()
    steps = []
    with pytest.raises(CheckFailedError, match="frozen"):
        with hookcli.watch(model, opt, out=log, on_finding="raise"):
            for step in range(6):
                data(model, step).backward()
                opt.step()
                opt.zero_grad()
                steps.append(step)
    assert steps == list(range(6))
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]


_stat_value = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none())


@st.composite
def _stats(draw: st.DrawFn) -> dict[str, Any] | None:
    if draw(st.booleans()):
        return None
    from hookcli.records import WATCH_STAT_KEYS

    out: dict[str, Any] = {key: draw(_stat_value) for key in WATCH_STAT_KEYS}
    out.update(nan_count=draw(st.sampled_from([0, 0, 0, 2])), inf_count=draw(st.sampled_from([0, 0, 0, 1])), count=draw(st.integers(0, 100)),
               zero_fraction=draw(st.one_of(st.none(), st.floats(0, 1))))
    return out


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(
    st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    st.lists(st.tuples(st.sampled_from(["a", "b"]), _stats(), _stats()), max_size=3),
    st.lists(st.tuples(st.sampled_from(["w", "v"]), st.lists(st.integers(0, 3), max_size=3), _stats(),
                       st.one_of(st.none(), st.floats(0, 1e9)), st.floats(0, 1e9)), max_size=3)),
    max_size=6))
def test_the_rules_take_any_records_without_failing(steps: list[Any]) -> None:
    """The rules are total over the records (any None, NaN, Inf, 0 count): each finding names a known rule,
    its step and a direction; never an exception (an InternalError would be the answer to the user's data)."""
    from hookcli.commands.watch_rules import RULES, Rules, rule_settings
    from hookcli.records import WatchLayer, WatchParam, WatchStep

    rules = Rules(rule_settings(None))
    for i, (loss, layers, params) in enumerate(steps):
        rec = WatchStep(i, loss, [WatchLayer(n, "Linear", "", 1, [2], "float32", s, g) for n, s, g in layers],
                        [WatchParam(n, shape, norm, g, update, None if update is None or not norm else update / norm)
                         for n, shape, g, update, norm in params])
        for found in rules.observe(rec):
            assert found.rule in RULES and found.step == i
            assert found.direction in ("forward", "backward", "update", "loss") and found.message
            json.dumps(found.to_dict())


def test_grad_explode_reads_the_parameters_that_have_a_gradient() -> None:
    """A parameter without a finite norm (an empty one: no values, RMS None) does not hide the others'
    gradient growing 100x; the finding names the largest."""
    from hookcli.commands.watch_rules import Rules, rule_settings
    from hookcli.records import WATCH_STAT_KEYS, WatchParam, WatchStep

    def grad(rms: float | None, count: int) -> dict[str, Any]:
        return {**dict.fromkeys(WATCH_STAT_KEYS, 0.0), "rms": rms, "nan_count": 0, "inf_count": 0, "count": count}

    rules = Rules(rule_settings(None))
    found = []
    for step, scale in enumerate([1.0, 1.0, 100.0]):
        found += rules.observe(WatchStep(step, params=[WatchParam("empty", [0], 0.0, grad(None, 0)),
                                                       WatchParam("w", [2, 2], 1.0, grad(scale, 4)),
                                                       WatchParam("b", [2], 1.0, grad(scale / 2, 2))]))
    assert [(f.rule, f.step, f.layer) for f in found] == [("grad_explode", 2, "w")]
    assert found[0].value == pytest.approx(100.0)


def test_a_model_that_stops_changing_is_one_finding_that_says_why() -> None:
    """A loss with zero gradient everywhere (here: at its minimum) leaves every parameter unchanged: one
    finding for the whole model, saying the gradients are 0, not one per parameter blaming the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, optimizer) as w:
        for _ in range(4):
            loss = (model(torch.randn(8, 4)) * 0).sum()  # flat: every gradient is exactly 0
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)
    assert [(f.rule, f.layer, f.step) for f in w.findings] == [("frozen", "0.weight", 2)]
    assert w.findings[0].message.startswith("no parameter changed in 3 logged steps (4 parameters, 0.weight first;")
    assert "gradient is exactly 0" in w.findings[0].message


def test_a_frozen_parameter_is_told_by_what_its_gradient_was() -> None:
    """One layer left out of the optimizer (it has a gradient) and one cut off by a detach (no gradient)."""
    torch.manual_seed(0)
    first, head = nn.Linear(4, 8), nn.Linear(8, 1)
    unused = nn.Linear(8, 1)  # watched, never called: no gradient reaches it
    model = nn.ModuleDict({"first": first, "head": head, "unused": unused})
    optimizer = torch.optim.SGD([*first.parameters(), *unused.parameters()], lr=0.1)
    with hookcli.watch(model, optimizer) as w:
        for _ in range(3):
            x = torch.randn(8, 4)
            loss = head(first(x).relu()).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)
    messages = {f.layer: f.message for f in w.findings if f.rule == "frozen"}
    assert set(messages) == {"head.weight", "head.bias", "unused.weight", "unused.bias"}
    assert "it has a gradient: not in the optimizer?" in messages["head.weight"]
    assert "no gradient reached it" in messages["unused.weight"]
    assert all("round away" not in message for message in messages.values())  # float32: no rounding to blame


def test_a_bfloat16_weight_whose_updates_round_away_is_frozen_saying_why() -> None:
    """Pure bfloat16 training: AdamW moves each weight by about lr = 1e-3 a step, less than half
    bfloat16's spacing at 1 (2**-8): the LayerNorm's weight of 1 never changes, plain torch agrees."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Linear(16, 1)).to(torch.bfloat16)
    before = model[1].weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hookcli.watch(model, optimizer) as w:
        for _ in range(3):
            loss = model(torch.randn(8, 4, dtype=torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            assert model[1].weight.grad.abs().max() > 0
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)
    assert torch.equal(model[1].weight, before)
    messages = {f.layer: f.message for f in w.findings if f.rule == "frozen"}
    assert "1.weight" in messages
    assert "round away in bfloat16" in messages["1.weight"] and "float32" in messages["1.weight"]


@settings(max_examples=25, deadline=None)
@given(batches=st.lists(st.integers(1, 5), min_size=1, max_size=4), tokens=st.integers(1, 6),
       killed=st.sets(st.integers(0, 7), max_size=8), seed=st.integers(0, 2**16))
def test_channel_counts_merge_the_steps_calls(batches: list[int], tokens: int, killed: set[int], seed: int) -> None:
    """Micro-batches of any sizes through a Linear on [B, T, C] (channels last) and its ReLU: the step's
    per-channel zero fractions and dead count are plain torch's over all the calls' values together."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
    with torch.no_grad():
        model[0].bias[sorted(killed)] = -100.0
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, tokens, 3, generator=g) for b in batches]
    with hookcli.watch(model, every=1) as w:
        for x in xs:
            model(x).sum().backward()
        w.step()
    with torch.no_grad():
        out = torch.cat([model(x).reshape(-1, 8) for x in xs])
    zeros = (out == 0).double().mean(0).tolist()
    layer = {layer.name: layer for layer in w.last.layers}["1"]
    assert layer.calls == len(batches) and layer.channels == 8
    assert layer.channel_zero_fraction == pytest.approx(zeros, abs=1e-12)
    assert layer.dead_channels == sum(z == 1.0 for z in zeros) >= len(killed)


@pytest.mark.parametrize("every", [1, 2])
def test_a_grad_scaler_skipping_overflowed_steps_is_no_nonfinite_finding(every: int, tmp_path: Path) -> None:
    """torch.amp.GradScaler scales the loss and skips optimizer.step() when the scaled gradients hold an
    Inf (its scale then halves): a healthy mixed-precision loop at its first steps. Those steps' NaN/Inf
    gradients are not 'the run's first NaN/Inf' (was: an error finding, exit 1 in report); their lines
    say ``skipped``. The skips are plain torch's; the loop's losses are bitwise those of a run without
    the watch."""

    def run(watch: bool) -> tuple[list[float], list[bool], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # float32 overflows at the first steps
        losses, skipped = [], []
        with hookcli.watch(model, opt, every=every, out=tmp_path / "log.jsonl") if watch \
                else contextlib.nullcontext() as w:
            for _ in range(8):
                x = torch.randn(16, 8)
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                opt.zero_grad()
                scaler.scale(loss).backward()
                grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped.append(not grads_finite and scaler.get_scale() < before)
                losses.append(loss.item())
                if watch:
                    w.step(loss=loss)
        return losses, skipped, w

    plain, skipped, _ = run(False)
    watched, skipped_watched, w = run(True)
    assert watched == plain and skipped_watched == skipped
    assert skipped[0] and not skipped[-1]  # the first steps overflowed and were skipped, later ones stepped
    assert [f for f in w.findings if f.rule == "nonfinite"] == []
    lines = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert any(entry["grad"]["inf_count"] or entry["grad"]["nan_count"]  # what was blamed before
               for entry in lines[0]["layers"] + lines[0]["params"] if entry["grad"] is not None)
    assert [line.get("skipped", False) for line in lines] == [skipped[line["step"]] for line in lines]


def test_a_nan_gradient_at_a_step_the_optimizer_took_is_still_found() -> None:
    """The other side: a step that did run optimizer.step() with a NaN gradient (plain SGD applies it) is
    the run's first NaN/Inf, named at its parameter's layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with hookcli.watch(model, opt) as w:
        for step in range(3):
            x = torch.randn(8, 4)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            if step == 1:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    assert torch.isnan(model[0].weight).any()
    assert [(f.rule, f.step, f.layer) for f in w.findings if f.rule == "nonfinite"][:1] == [("nonfinite", 1, "0.weight")]


class _SqrtOfZero(nn.Module):
    """A bug whose forward is finite and whose backward is NaN: d sqrt(u)/du at u = 0 is Inf, times 0."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0 * torch.sqrt(h - h)


@pytest.mark.parametrize(("every", "rules", "found_at"), [(1, None, 31), (2, {"nonfinite": {"skipped": 3}}, 4)])
def test_a_nan_gradient_a_grad_scaler_skips_forever_is_found_after_skipped_steps_in_a_row(
        every: int, rules: dict[str, Any] | None, found_at: int) -> None:
    """The other side of the GradScaler's skipped steps: a NaN that no scale removes makes the scaler
    skip every step, so the parameters never change again, silently. After ``skipped`` logged steps in
    a row (default 32) with NaN/Inf gradients and no optimizer step, it is the run's first NaN/Inf. That
    the gradient is NaN and that the scaler skipped every step is plain torch's; the loop's losses are
    bitwise those without the watch."""

    def run(watch: bool) -> tuple[list[float], Any, nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), _SqrtOfZero(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        losses = []
        with hookcli.watch(model, opt, every=every, rules=rules) if watch else contextlib.nullcontext() as w:
            for _ in range(40):
                loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                losses.append(loss.item())
                if watch:
                    w.step(loss=loss)
        return losses, w, model

    plain, _, plain_model = run(False)
    watched, w, _ = run(True)
    assert watched == plain and len(set(plain)) == 1  # every step skipped: the loss never moved
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Linear(4, 8), _SqrtOfZero(), nn.Linear(8, 1))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), plain_model.parameters()))
    x, y = torch.randn(16, 4), torch.randn(16, 1)  # (the seed's next draws: the loop's batch)
    grads = torch.autograd.grad(nn.functional.mse_loss(fresh(x), y), list(fresh.parameters()))
    assert torch.isnan(grads[0]).any()
    found = [(f.rule, f.severity, f.step) for f in w.findings if f.rule == "nonfinite"]
    assert found == [("nonfinite", "error", found_at)]
    message = next(f.message for f in w.findings if f.rule == "nonfinite")
    assert "logged steps in a row that the optimizer skipped" in message


@pytest.mark.parametrize("schedule", ["cosine to 0", "one cycle", "linear warmup from 1e-4"])
def test_a_scheduled_learning_rate_low_by_design_is_not_too_low(schedule: str) -> None:
    """A scheduler that anneals the learning rate to (near) 0, or warms it up from (near) 0, makes the
    weights' median update ratio fall below update_ratio's low limit at some steps on purpose (shown in
    plain torch below); the rule judges 'too low' at the rate the weights were configured with (the
    groups' initial_lr), so a healthy scheduled run is quiet. The loop's numbers are those without the watch."""
    steps = 100

    def run(watch: bool) -> tuple[list[float], list[float], Any]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        sched: Any = {
            "cosine to 0": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
            "one cycle": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-4, total_steps=steps),
            "linear warmup from 1e-4": lambda: torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, 1e-4 + s / 30)),
        }[schedule]()
        losses, medians = [], []
        data = regression()
        with hookcli.watch(model, opt, every=1) if watch else contextlib.nullcontext() as w:
            for step in range(steps):
                loss = data(model, step)
                loss.backward()
                before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() >= 2}
                opt.step()
                opt.zero_grad()
                ratios = [float((p.detach() - before[n]).norm() / before[n].norm())
                          for n, p in model.named_parameters() if p.dim() >= 2]
                medians.append(float(torch.tensor(ratios).median()) if len(ratios) % 2 else
                               float(torch.tensor(sorted(ratios)[len(ratios) // 2 - 1:len(ratios) // 2 + 1]).mean()))
                sched.step()
                losses.append(loss.item())
                if watch:
                    w.step(loss=loss)
        return losses, medians, w

    plain, medians, _ = run(False)
    watched, _, w = run(True)
    assert watched == plain
    assert min(m for m in medians if m > 0) < 1e-6  # below the rule's low limit by the schedule's design
    assert [f for f in w.findings if f.rule == "update_ratio"] == []


def test_a_learning_rate_far_too_low_under_a_scheduler_is_still_flagged() -> None:
    """The other side: lr=1e-9 given to a cosine schedule is far too low at the rate it was configured
    with, and is flagged at the first step (the scheduler has not lowered it yet)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    data = regression()
    with hookcli.watch(model, opt, every=1) as w:
        for step in range(5):
            data(model, step).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            w.step()
    (found,) = [f for f in w.findings if f.rule == "update_ratio"]
    assert found.step == 0 and found.value < found.limit == 1e-6 and "too low" in found.message


def test_a_layer_frozen_mid_run_on_purpose_is_not_told_as_frozen() -> None:
    """fc1 is frozen after 3 steps (``requires_grad_(False)``, a common fine-tuning schedule): it stops
    changing on purpose, so the frozen rule (a parameter that requires grad) says nothing of it, where it
    said 'fc1.weight requires grad but did not change'; the other layers keep training (plain torch)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = regression()
    with hookcli.watch(model, opt, every=1) as w:
        for step in range(8):
            if step == 3:
                model.fc1.requires_grad_(False)
                frozen_at = model.fc1.weight.detach().clone()
            data(model, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            w.step()
    assert torch.equal(model.fc1.weight, frozen_at)
    assert w.last is not None and w.last.params[0].name == "fc1.weight" and w.last.params[0].update_norm == 0
    assert [f for f in w.findings if f.rule == "frozen"] == []


def test_a_grad_scaler_skip_merged_into_the_optimizers_step_is_no_nonfinite_finding(tmp_path: Path) -> None:
    """Without ``w.step()`` (``hookcli watch -- CMD`` watches a script so) the optimizer ends steps: the
    iterations a GradScaler skips (their scaled output gradients overflow, the loop zeroes them) are part
    of the step its next ``optimizer.step()`` ends, which applies finite gradients. That step's Inf output
    gradients never reached the update: no 'first NaN/Inf' (was an error finding, exit 1 in report). The
    skips are plain torch's; the losses are bitwise those without the watch."""

    def run(watch: bool) -> tuple[list[float], list[float], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
        losses, scales = [], []
        with hookcli.watch(model, opt, every=1, out=tmp_path / "log.jsonl") if watch \
                else contextlib.nullcontext() as w:
            for _ in range(12):
                x = torch.randn(16, 8)
                out = model(x)
                if not watch:
                    out.retain_grad()
                loss = nn.functional.mse_loss(out, x.sum(1, keepdim=True), reduction="sum")
                scaler.scale(loss).backward()
                if not watch and not scales:
                    assert not torch.isfinite(out.grad).all()  # the first iteration's output gradient overflows
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                scales.append(scaler.get_scale())
                losses.append(loss.item())
        return losses, scales, w

    plain, scales, _ = run(False)
    watched, watched_scales, w = run(True)
    assert watched == plain and watched_scales == scales
    assert scales[0] < 2.0**127 and scales[-1] == scales[-2]  # the first iterations skipped, the last stepped
    first = json.loads(open(tmp_path / "log.jsonl").readline())
    assert first["layers"][0]["calls"] > 1  # the skipped iterations are in the step the optimizer ended
    assert any(layer["grad"]["inf_count"] for layer in first["layers"])  # what was blamed before
    assert [f for f in w.findings if f.rule == "nonfinite"] == []


def test_float16_adam_overflowing_the_weights_is_blamed_on_the_update() -> None:
    """Pure float16 AdamW (eps 1e-8 is 0 in float16): the first step divides by 0 and makes finite weights
    NaN/Inf from finite gradients, as plain torch shows. The run's first NaN/Inf is that update, at step 0
    (was: the next step's forward, 'first NaN/Inf ... 0's output', the wrong cause and step)."""

    def run(watch: bool) -> tuple[list[float], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).half()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        g = torch.Generator().manual_seed(1)
        with hookcli.watch(model, opt, every=1) if watch else contextlib.nullcontext() as w:
            for step in range(3):
                x = torch.randn(16, 8, generator=g).half()
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                loss.backward()
                if not watch and step == 0:
                    assert all(torch.isfinite(p.grad).all() and torch.isfinite(p).all() for p in model.parameters())
                opt.step()
                if not watch and step == 0:
                    assert not torch.isfinite(model[0].weight).all()  # the update made it NaN/Inf
                opt.zero_grad()
                losses.append(loss.item())
                if watch:
                    w.step(loss=loss)
        return losses, w

    plain, _ = run(False)
    watched, w = run(True)
    assert [math.isnan(v) for v in watched] == [math.isnan(v) for v in plain]
    assert [v for v in watched if not math.isnan(v)] == [v for v in plain if not math.isnan(v)]
    (found,) = [f for f in w.findings if f.rule == "nonfinite"]
    assert (found.step, found.layer, found.direction, found.severity) == (0, "0.weight", "update", "error")
    assert "eps 1e-8 is 0 in float16" in found.message


def test_each_watch_rule_is_one_spec_and_the_docs_table_is_its_rows() -> None:
    """``SPECS`` is the only list of the watch's rules: ``RULES`` (the settings and their defaults) and the
    hint are derived from it, and docs/watch.md's rules table is its rows, in its order."""
    from hookcli.commands.watch_rules import RULES, RULES_HINT, SPECS

    names = [spec.name for spec in SPECS]
    assert len(set(names)) == len(names) and list(RULES) == names
    assert all(RULES[spec.name] == dict(spec.settings) for spec in SPECS)
    assert RULES_HINT.endswith(", ".join(names))
    text = (Path(__file__).resolve().parents[1] / "docs" / "watch.md").read_text()
    table = text.split("\n## Rules\n", 1)[1].split("| rule | flags | default limits |\n| --- | --- | --- |\n", 1)[1]
    assert table.split("\n\n", 1)[0].splitlines() == [spec.doc_row() for spec in SPECS]
