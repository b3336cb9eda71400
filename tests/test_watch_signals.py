"""The watch's transformer-instability signals and their rules (docs/watch.md#rules): Adam's normalised
gradient RMS (``adam_rms``), the cosine between update and gradient (``update_grad_cosine``) and the
per-channel peaks of an output (``massive_activation``). Each is checked against plain torch computed
here (float64), is silent on healthy runs, and fires on a seeded cause, named by parameter or layer and
step."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.records import WatchStep

NEW_RULES = ("adam_rms", "update_grad_cosine", "massive_activation")


def mlp() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    x = torch.randn(256, 16)
    y = x[:, :4].sin()

    def loss() -> torch.Tensor:
        i = torch.randint(0, 256, (32,))
        return (model(x[i]) - y[i]).pow(2).mean()
    return model, loss


def gpt2() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)

    def loss() -> torch.Tensor:
        ids = torch.randint(0, 64, (4, 16))
        return model(input_ids=ids, labels=ids).loss
    return model, loss


def train(model: nn.Module, loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, steps: int,
          every: int = 1, after: Callable[[int], None] | None = None,
          before: Callable[[int], None] | None = None) -> tuple[Any, dict[int, WatchStep]]:
    """The watched loop (``w.step()`` ends each step); ``after(step)`` runs after ``optimizer.step()``
    (before ``zero_grad``). Returns the watch and its records by step."""
    records: dict[int, WatchStep] = {}
    with hookcli.watch(model, optimizer, every=every, on_finding="warn") as w:
        for step in range(steps):
            if before is not None:
                before(step)
            loss().backward()
            optimizer.step()
            if after is not None:
                after(step)
            optimizer.zero_grad()
            w.step()
            if w.last is not None:
                records[w.last.step] = w.last
    return w, records


@pytest.mark.parametrize("make", [mlp, gpt2])
def test_healthy_adamw_runs_give_no_finding_of_the_new_rules(make: Callable[..., Any]) -> None:
    """A tiny GPT-2 and a small MLP (random init) trained with AdamW for 100 steps, all logged: none of the
    three rules fires, while each has its numbers at every step."""
    torch.manual_seed(0)
    model, loss = make()
    w, _ = train(model, loss, torch.optim.AdamW(model.parameters(), lr=1e-3), 100)
    assert [f for f in w.findings if f.rule in NEW_RULES] == []
    assert all(p.adam_rms is not None and p.update_grad_cosine is not None for p in w.last.params)
    assert any(layer.channel_peak_ratio is not None for layer in w.last.layers)


def assert_adam_rms(records: dict[int, Any], reference: Any, rel: float) -> None:
    """Each logged parameter's adam_rms (with and without eps) equals the float64 recomputation."""
    for step, record in records.items():
        for entry in record.params:
            rms, without = reference.want[(step, entry.name)]
            assert entry.adam_rms == pytest.approx(rms, rel=rel)
            assert entry.adam_rms_without_eps == pytest.approx(without, rel=rel)


class AdamReference:
    """Adam's normalised-gradient RMS computed here in float64 from the gradients the loop saw (not from
    the optimizer's state): call it after ``optimizer.step()``; ``want[(step, name)]`` is (RMS of
    g / (sqrt(v_hat) + eps), the same without eps)."""

    def __init__(self, model: nn.Module, beta2: float, eps: float) -> None:
        self.params, self.beta2, self.eps = dict(model.named_parameters()), beta2, eps
        self.v = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in self.params.items()}
        self.want: dict[tuple[int, str], tuple[float, float]] = {}

    def __call__(self, step: int) -> None:
        for name, p in self.params.items():
            g = p.grad.double()
            self.v[name].mul_(self.beta2).add_((1 - self.beta2) * g * g)
            root = (self.v[name] / (1 - self.beta2 ** (step + 1))).sqrt()
            self.want[(step, name)] = ((g / (root + self.eps)).square().mean().sqrt().item(),
                                       torch.where(root > 0, g / root, 0.0).square().mean().sqrt().item())


def test_adam_rms_is_the_normalised_gradients_rms_from_the_gradients_seen() -> None:
    """adam_rms equals sqrt(mean((g / (sqrt(v_hat) + eps))^2)) at every step; with eps = 1.0 (far above
    sqrt(v_hat)) the rule fires at the first logged step, its value the median over the parameters of
    that RMS over the same without eps, naming the parameter where eps shrinks it the most."""
    for eps in (1e-8, 1.0):
        torch.manual_seed(0)
        model, loss = mlp()
        reference = AdamReference(model, 0.99, eps)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=eps)
        w, records = train(model, loss, optimizer, 6, after=reference)
        assert sorted(records) == list(range(6))
        assert_adam_rms(records, reference, 1e-4)
        found = [f for f in w.findings if f.rule == "adam_rms"]
        shares = sorted((reference.want[(0, n)][0] / reference.want[(0, n)][1], n) for n in reference.params)
        if eps == 1e-8:
            assert found == [] and shares[0][0] > 0.99
        else:
            assert [(f.step, f.layer) for f in found] == [(0, shares[0][1])]
            median = (shares[2][0] + shares[3][0]) / 2  # 6 parameters
            assert found[0].value == pytest.approx(median, rel=1e-4) and found[0].value < 0.01
            assert "eps dominates" in found[0].message


@pytest.mark.parametrize("piece", [7, 64, 1 << 19])
def test_adam_rms_is_the_same_however_the_parameters_are_cut_into_pieces(monkeypatch: Any, piece: int) -> None:
    """adam_rms works through the parameters by pieces of ADAM_RMS_PIECE elements (a parameter larger than
    a piece split into slices, small ones packed together): cut into 7 (every parameter split, slices of
    one parameter in two pieces), 64 or 2^19 elements (all in one piece), its values equal the float64
    recomputation, without eps too, with an embedding whose unseen rows keep v = 0 (0 there, not NaN)."""
    from hookcli.engine import watch_params

    monkeypatch.setattr(watch_params, "ADAM_RMS_PIECE", piece)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 12), nn.Flatten(), nn.Linear(36, 5), nn.Tanh(), nn.Linear(5, 3))
    ids = torch.randint(0, 10, (64, 3))  # rows 10.. of the embedding never get a gradient

    def loss() -> torch.Tensor:
        return model(ids[torch.randint(0, 64, (16,))]).square().mean()
    reference = AdamReference(model, 0.95, 1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-3)
    _, records = train(model, loss, optimizer, 4, after=reference)
    assert sorted(records) == list(range(4))
    assert_adam_rms(records, reference, 1e-5)


def test_adam_rms_names_the_step_where_the_gradient_outruns_the_second_moment() -> None:
    """The loss scaled 1000x from step 60 (beta2 0.999: the second moment follows slowly): adam_rms jumps
    at step 60, one finding naming the parameter whose RMS rose the most over the largest of its previous
    10 logged values, with that ratio (from the float64 reference); none before."""
    torch.manual_seed(0)
    model, loss = mlp()
    reference = AdamReference(model, 0.999, 1e-8)
    scale = [1.0]

    def before(step: int) -> None:
        scale[0] = 1000.0 if step >= 60 else 1.0

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w, _ = train(model, lambda: loss() * scale[0], optimizer, 70, before=before, after=reference)
    found = [f for f in w.findings if f.rule == "adam_rms"]
    ratios = []
    for name in reference.params:
        previous = max(reference.want[(step, name)][0] for step in range(50, 60))
        ratios.append((reference.want[(60, name)][0] / previous, name))
    ratio, name = max(ratios)
    assert [(f.step, f.layer) for f in found] == [(60, name)]
    assert found[0].value == pytest.approx(ratio, rel=1e-4) and ratio > 5
    jumped = sum(r > 5 for r, _ in ratios)
    assert jumped > 1 and found[0].message.startswith(
        f"{jumped} parameters' (the most: {name}'s) Adam normalised gradient RMS jumped")


def test_beta2_of_0_5_keeps_adam_rms_bounded() -> None:
    """With beta2 = 0.5 the second moment follows each gradient (g^2 / v_hat <= 1 / (1 - beta2) = 2 per
    value): adam_rms stays below sqrt(2), so it is no cause this rule can see; the rule stays quiet."""
    torch.manual_seed(0)
    model, loss = mlp()
    reference = AdamReference(model, 0.5, 1e-8)
    w, records = train(model, loss, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.5)), 30,
                       after=reference)
    assert all(entry.adam_rms <= math.sqrt(2) for record in records.values() for entry in record.params)
    assert max(rms for rms, _ in reference.want.values()) <= math.sqrt(2)
    assert [f for f in w.findings if f.rule == "adam_rms"] == []


class RandomSteps(torch.optim.Optimizer):
    """A broken optimizer: each step moves every parameter that has a gradient by random noise."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.randn_like(p) * group["lr"])


class CosineReference:
    """The cosine between each parameter's update (w_after - w_before) and its gradient, in float64:
    ``before`` at the step's start, ``after`` after ``optimizer.step()``."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.weights: dict[str, torch.Tensor] = {}
        self.want: dict[tuple[int, str], float] = {}

    def before(self, _step: int) -> None:
        self.weights = {name: p.detach().double().clone() for name, p in self.params.items()}

    def after(self, step: int) -> None:
        for name, p in self.params.items():
            update, g = (p.detach().double() - self.weights[name]).flatten(), p.grad.double().flatten()
            self.want[(step, name)] = (update @ g / (update.norm() * g.norm())).item()


@pytest.mark.parametrize("kind", ["sgd", "adamw", "random"])
def test_update_grad_cosine_is_the_cosine_of_update_and_gradient(kind: str) -> None:
    """The logged cosine equals float64 torch's at every step: -1 for SGD, clearly negative for AdamW
    (no finding either way); an optimizer making random updates gives the finding at the 5th logged
    step (its window), its value the mean of the weights' median cosines, naming the weight whose
    cosine is highest."""
    torch.manual_seed(0)
    model, loss = mlp()
    reference = CosineReference(model)
    optimizer = {"sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.01),
                 "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
                 "random": lambda: RandomSteps(model.parameters(), lr=1e-3)}[kind]()
    w, records = train(model, loss, optimizer, 8, before=reference.before, after=reference.after)
    for step, record in records.items():
        for entry in record.params:
            assert entry.update_grad_cosine == pytest.approx(reference.want[(step, entry.name)], rel=1e-4, abs=1e-6)
    found = [f for f in w.findings if f.rule == "update_grad_cosine"]
    if kind == "sgd":
        assert all(c == pytest.approx(-1.0, abs=1e-5) for c in reference.want.values())
    if kind != "random":
        assert found == []
        return
    weights = [name for name, p in reference.params.items() if p.dim() >= 2]
    medians = [sorted(reference.want[(step, n)] for n in weights)[1] for step in range(5)]  # 3 weights
    top = max(weights, key=lambda n: reference.want[(4, n)])
    assert [(f.step, f.layer) for f in found] == [(4, top)]
    assert found[0].value == pytest.approx(sum(medians) / 5, abs=1e-6) and abs(found[0].value) < 0.05


def peak_ratio(out: torch.Tensor) -> float:
    """Per channel (the last dimension) the largest |x|, in float64: the largest over their median (the
    mean of the two middle ones for an even count)."""
    peaks = out.double().abs().amax(dim=0).sort().values
    n = len(peaks)
    median = peaks[n // 2] if n % 2 else (peaks[n // 2 - 1] + peaks[n // 2]) / 2
    return (peaks[-1] / median).item()


@pytest.mark.parametrize("scaled", [False, True])
def test_massive_activation_names_a_channel_scaled_1000x(scaled: bool) -> None:
    """Channel 7 of the MLP's second Linear scaled 1000x (its weights' row and bias): the logged
    channel_peak_ratio of every output equals float64 torch's at every step; the rule names that
    Linear and channel 7 at the third logged step (steps = 3), and nothing in the unscaled twin
    (``activation_growth``, over the whole output, misses it)."""
    torch.manual_seed(0)
    model, loss = mlp()
    if scaled:
        with torch.no_grad():
            model[2].weight[7] *= 1000
            model[2].bias[7] *= 1000
    outputs: dict[str, torch.Tensor] = {}
    for name, module in model.named_children():
        module.register_forward_hook(lambda _m, _i, out, name=name: outputs.__setitem__(name, out.detach()))
    want: dict[tuple[int, str], float] = {}

    def after(step: int) -> None:
        want.update({(step, name): peak_ratio(out) for name, out in outputs.items()})

    w, records = train(model, loss, torch.optim.AdamW(model.parameters(), lr=1e-3), 4, after=after)
    for step, record in records.items():
        for layer in record.layers:
            assert layer.channel_peak_ratio == pytest.approx(want[(step, layer.name)], rel=1e-5)
    found = [f for f in w.findings if f.rule == "massive_activation"]
    if not scaled:
        assert found == [] and max(want.values()) < 10
        return
    assert ("2", 2) in [(f.layer, f.step) for f in found]
    f = next(f for f in found if f.layer == "2")
    assert f.value == pytest.approx(want[(2, "2")], rel=1e-5) and f.value > 100
    assert f.message.startswith("channel 7 of 2's output reaches")
    assert all(want[(step, f.layer)] > 100 for f in found for step in range(3))
    # one channel of 64 keeps abs max / RMS under sqrt(64): activation_growth cannot see it
    assert [f for f in w.findings if f.rule == "activation_growth"] == []


@pytest.mark.parametrize("stat", ["adam_rms", "update_grad_cosine", "channel_peak_ratio"])
def test_hookcli_report_shows_the_new_keys_of_the_log(tmp_path: Any, stat: str) -> None:
    """The log's new keys are ``hookcli report --stat`` choices, read where the other per-parameter
    (and per-layer) keys are: the series are the logged values, one row per parameter (layer)."""
    from click.testing import CliRunner

    from hookcli.cli import main

    torch.manual_seed(0)
    model, loss = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = tmp_path / "log.jsonl"
    records: dict[int, WatchStep] = {}
    with hookcli.watch(model, optimizer, out=log, on_finding="warn") as w:
        for _ in range(3):
            loss().backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step()
            records[w.last.step] = w.last
    report = hookcli.report(log, stat=stat)
    entries = (lambda r: r.params) if stat != "channel_peak_ratio" else (lambda r: r.layers)
    want = {x.name: [getattr(e, stat) for _, r in sorted(records.items()) for e in entries(r) if e.name == x.name]
            for x in entries(records[0])}
    assert {s.name: s.values for s in report.series} == pytest.approx(want)
    result = CliRunner().invoke(main, ["report", str(log), "--stat", stat])
    assert result.exit_code == 0, result.output
    assert f"{stat} of each" in result.output and all(name in result.output for name in want)


def test_the_new_rules_settings_are_checked_like_the_others() -> None:
    """``rules=`` (and ``[watch.rules]``) check the new rules' keys through their specs: an unknown key,
    a value out of range, a warmup above its window are ConfigErrors (exit 2) naming the rule."""
    from hookcli.errors import ConfigError

    for rules, match in (({"adam_rms": {"warmup": 20}}, "adam_rms's warmup"),
                         ({"update_grad_cosine": {"high": 2}}, "update_grad_cosine.high"),
                         ({"massive_activation": {"channels": 3}}, "'massive_activation' has no key")):
        with pytest.raises(ConfigError, match=match) as info:
            hookcli.watch(nn.Linear(2, 2), rules=rules)
        assert info.value.exit_code == 2


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-3),
    lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.1, amsgrad=True, maximize=True),
], ids=["adamw", "adam-amsgrad-coupled-decay"])
def test_reading_the_optimizers_state_changes_nothing(make_optimizer: Callable[..., Any]) -> None:
    """A GPT-2 trained 6 steps watched (every step logged, the three signals on) and unwatched: the same
    losses, weights and optimizer state, bit for bit; the RNG untouched."""
    def run(watched: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any], torch.Tensor]:
        torch.manual_seed(0)
        model, loss = gpt2()
        optimizer = make_optimizer(model.parameters())
        losses = []
        with hookcli.watch(model, optimizer, on_finding="warn") if watched else contextlib.nullcontext() as w:
            for _ in range(6):
                value = loss()
                value.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(value.item())
        if watched:
            assert all(p.adam_rms is not None for p in w.last.params)
        return losses, model.state_dict(), optimizer.state_dict(), torch.get_rng_state()

    plain, watched = run(False), run(True)
    assert plain[0] == watched[0] and torch.equal(plain[3], watched[3])
    assert all(torch.equal(plain[1][k], watched[1][k]) for k in plain[1])
    for index, state in plain[2]["state"].items():
        assert all(torch.equal(value, watched[2]["state"][index][key]) for key, value in state.items())


def test_adam_rms_of_adam_with_amsgrad_coupled_decay_and_maximize() -> None:
    """Adam (not AdamW) with weight_decay adds wd * w to the gradient (its sign flipped first under
    ``maximize``) and with ``amsgrad`` divides by the running maximum of v: adam_rms follows, equal to
    the float64 recomputation from the gradients and weights seen (each of the three left out fails it)."""
    torch.manual_seed(0)
    model, loss = mlp()
    params = dict(model.named_parameters())
    beta2, eps, decay = 0.9, 1e-8, 0.1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, beta2), weight_decay=decay,
                                 amsgrad=True, maximize=True)
    weights: dict[str, torch.Tensor] = {}
    v = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    v_max = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params.items()}
    want: dict[tuple[int, str], float] = {}

    def before(_step: int) -> None:
        weights.update({name: p.detach().double().clone() for name, p in params.items()})

    def after(step: int) -> None:
        for name, p in params.items():
            g = -p.grad.double() + decay * weights[name]
            v[name].mul_(beta2).add_((1 - beta2) * g * g)
            torch.maximum(v_max[name], v[name], out=v_max[name])
            root = (v_max[name] / (1 - beta2 ** (step + 1))).sqrt()
            want[(step, name)] = (g / (root + eps)).square().mean().sqrt().item()

    # 100x larger gradients at the first two steps: v then falls below its running maximum
    _, records = train(model, lambda: -loss() * (100.0 if len(want) < 2 * len(params) else 1.0), optimizer, 6,
                       before=before, after=after)
    for step, record in records.items():
        for entry in record.params:
            assert entry.adam_rms == pytest.approx(want[(step, entry.name)], rel=1e-4)


_value = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(
    st.lists(st.tuples(st.sampled_from(["w", "v"]), st.sampled_from([[2, 2], [3]]), _value, _value, _value),
             max_size=3),
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.one_of(st.none(), st.lists(
        st.floats(allow_nan=True, allow_infinity=True), max_size=5))), max_size=2)), max_size=8))
@example(steps=[([("w", [2, 2], math.nan, 1.0, math.nan)], [("a", [math.nan, 1.0])])] * 8)
def test_the_new_rules_take_any_values_without_failing(steps: list[Any]) -> None:
    """The three rules are total over their fields (None, NaN, Inf, 0, negative, empty): each finding
    names its rule and step and is JSON; never an exception."""
    import json

    from hookcli.commands.watch_rules import Rules, rule_settings
    from hookcli.records import WatchLayer, WatchParam

    rules = Rules(rule_settings({name: name in NEW_RULES for name in
                                 ("nonfinite", "frozen", "update_ratio", "loss_spike", "grad_explode",
                                  "grad_depth", "dead_units", "activation_growth", *NEW_RULES)}))
    for i, (params, layers) in enumerate(steps):
        record = WatchStep(i, None, [WatchLayer(n, "Linear", "", 1, [2], "float32", None, None, channel_abs_max=peaks)
                                     for n, peaks in layers],
                           [WatchParam(n, shape, 1.0, None, adam_rms=rms, adam_rms_without_eps=without,
                                       update_grad_cosine=cosine) for n, shape, rms, without, cosine in params])
        for found in rules.observe(record):
            assert found.rule in NEW_RULES and found.step == i and found.message
            assert found.value is not None and not math.isnan(found.value)  # (a NaN is no measurement)
            json.dumps(found.to_dict())
        json.dumps([layer.to_dict() for layer in record.layers])


def test_channel_peaks_of_a_module_called_twice_are_over_both_calls() -> None:
    """A Linear called twice in a step (its calls merged into one entry): its channel_peak_ratio is that
    of each channel's largest |x| over both calls' outputs, as float64 torch gives it."""
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    with torch.no_grad():
        shared.weight.copy_(torch.diag(torch.arange(1.0, 17.0)))  # channel k is (k + 1) x input k
        shared.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    outputs: list[torch.Tensor] = []
    shared.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach()))
    x = torch.randn(4, 16) * 0.1
    x[:, 0] = 50.0  # the first call's channel 0 is large; the second call's (after tanh) is not
    with hookcli.watch(model, optimizer, on_finding="warn") as w:
        model(x).sum().backward()
        optimizer.step()
        w.step()
    (entry,) = [layer for layer in w.last.layers if layer.name == "0"]
    assert entry.calls == 2
    assert entry.channel_peak_ratio == pytest.approx(peak_ratio(torch.cat(outputs)), rel=1e-6)
    assert entry.channel_peak_ratio != pytest.approx(peak_ratio(outputs[1]), rel=1e-3)
