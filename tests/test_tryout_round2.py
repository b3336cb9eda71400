"""Round-2 tryout: models nobody here wrote the engine for, used as a new user would (process-wide hooks,
``diff``, the model index, parametrized / quantized / wrapped models, the user's own hooks).

Every number is checked against plain torch computed here (``torch.autograd.grad`` for gradients);
process-wide hooks (``all_modules=True`` on a model of >= 32 modules) and per-module hooks (a few
``layers``) must give the same rows for the modules both select.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import hookcli

from reference import dummy, float64_stats, outputs_by_call

STAT_KEYS = ("mean", "std", "min", "max", "norm")


def mlp(blocks: int = 20, width: int = 8) -> nn.Sequential:
    """``blocks`` x (Linear, GELU): 61 modules, enough for process-wide hooks under ``all_modules``."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)])


def assert_stats(actual: dict[str, Any] | None, tensor: torch.Tensor, rel: float = 1e-5) -> None:
    assert actual is not None
    expected = float64_stats(tensor)
    for key in STAT_KEYS:
        assert actual[key] == pytest.approx(expected[key], rel=rel, abs=1e-6), key


def rows(report: Any, names: set[str]) -> list[tuple[Any, ...]]:
    return [(r.name, r.call, r.output, r.input_shapes, r.shape, r.stats, r.grad) for r in report.layers
            if r.name in names]


def hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


# --------------------------------------------------------------------------- the user's own hooks


def users_hooks(model: nn.Sequential, fired: list[str]) -> None:
    """A forward hook that replaces block 2's Linear output, and a pre-hook that replaces block 3's
    Linear input with a wider tensor cut back by the Linear's own forward: the model goes on with both."""
    def scale_output(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        fired.append("forward")
        return out * 100

    def widen_input(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        fired.append("pre")
        return (torch.cat([args[0], args[0]], dim=0) - 1,)

    model[2][0].register_forward_hook(scale_output)
    model[3][0].register_forward_pre_hook(widen_input)


def test_users_hooks_that_replace_inputs_and_outputs_are_seen_alike_by_both_hook_modes() -> None:
    model = mlp().eval()
    fired: list[str] = []
    users_hooks(model, fired)
    x = dummy(2, 8)
    seen: dict[str, tuple[list[int], torch.Tensor]] = {}
    probes = [model[i][0].register_forward_hook(
        lambda _m, args, out, i=i: seen.__setitem__(f"{i}.0", (list(args[0].shape), out.detach().clone())))
        for i in (2, 3)]  # registered after the user's: what the model goes on with
    with torch.no_grad():
        model(x)
    for p in probes:
        p.remove()
    counts = hook_counts(model)
    fired.clear()

    everything = hookcli.stats(model, all_modules=True, input_shapes=["2x8"])
    few = hookcli.stats(model, layers=["2.0", "3.0"], input_shapes=["2x8"])

    assert fired == ["forward", "pre"] * 2  # the user's hooks ran in both runs, and are still there
    assert hook_counts(model) == counts
    assert not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
    assert rows(everything, {"2.0", "3.0"}) == rows(few, {"2.0", "3.0"})
    by_name = {r.name: r for r in everything.layers}
    for name, (input_shape, out) in seen.items():
        assert by_name[name].input_shapes == [input_shape] and by_name[name].shape == list(out.shape)
        assert_stats(by_name[name].stats, out)
    assert by_name["3.0"].input_shapes == [[4, 8]]  # the pre-hook's wider input, not the block's


def test_gradients_are_taken_at_the_output_the_users_hook_returned() -> None:
    model = mlp().eval()
    users_hooks(model, [])
    x = dummy(2, 8)
    kept: dict[str, torch.Tensor] = {}
    probe = model[2][0].register_forward_hook(lambda _m, _a, out: kept.__setitem__("out", out))
    loss = nn.functional.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
    probe.remove()
    (expected,) = torch.autograd.grad(loss, [kept["out"]])
    model.zero_grad(set_to_none=True)

    everything = hookcli.grads(model, all_modules=True, input_shapes=["2x8"], params="none")
    few = hookcli.grads(model, layers=["2.0"], input_shapes=["2x8"], params="none")

    assert everything.loss["value"] == pytest.approx(float(loss.detach()), rel=1e-6)
    assert rows(everything, {"2.0"}) == rows(few, {"2.0"})
    (row,) = [r for r in everything.layers if r.name == "2.0"]
    assert_stats(row.grad, expected, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- shapes: meta build fallback

READS_VALUES = '''
import torch
from torch import nn

class ReadsValues(nn.Module):
    """Its __init__ reads a tensor's value (as quantize_dynamic, or a scale computed once, do)."""
    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.k = int(torch.ones(2).sum().item())
    def forward(self, x):
        return self.fc(x) * self.k

def broken():
    return int(torch.ones(1).sum().item()) / 0
'''


def test_shapes_of_a_model_whose_init_reads_values_falls_back_to_a_real_run(tmp_path: Any, cli: Any) -> None:
    (tmp_path / "reads.py").write_text(READS_VALUES)
    report = hookcli.shapes(f"{tmp_path / 'reads.py'}:ReadsValues", input_shapes=["3x4"], model_args={"width": 4})
    assert report.device == "cpu"
    assert any("cannot run on the meta device" in n and ".item()" in n for n in report.notes)
    assert [(r.name, r.input_shapes, r.shape) for r in report.layers] == [("fc", [[3, 4]], [3, 4])]

    # a build that fails for real as well still reports the model's own error, exit 2 as before
    result = cli("shapes", f"{tmp_path / 'reads.py'}:broken", "--input-shape", "3x4")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0] == f"Error: building '{tmp_path / 'reads.py'}:broken' failed: " \
        "ZeroDivisionError: division by zero"
    assert "hint:" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- wrapped and rewritten models


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything of the model's that hookcli must hand back: values, modes, flags, gradients, hooks."""
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
                  if isinstance(v, torch.Tensor)},
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grad": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "hooks": hook_counts(model),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert after["state"][key].dtype == value.dtype and torch.equal(after["state"][key], value), key
    for key in ("training", "requires_grad", "hooks"):
        assert after[key] == before[key], key
    for a, b in zip(before["grad"], after["grad"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def plain_outputs(model: nn.Module, x: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """{(name, call): output copy} of every submodule returning one tensor, with plain hooks."""
    return {key: out for key, out in outputs_by_call(model, x).items() if key[0]}


def spectral_and_weight_norm() -> nn.Sequential:
    model = mlp()
    for i in range(0, 20, 3):
        torch.nn.utils.parametrizations.weight_norm(model[i][0])
        torch.nn.utils.parametrizations.spectral_norm(model[i + 1][0])  # power iteration updates u, v in train
    return model


@pytest.mark.parametrize("case", ["parametrized, train", "fx GraphModule", "DataParallel", "quantize_dynamic"])
def test_wrapped_models_give_torchs_numbers_in_both_hook_modes_and_come_back_unchanged(case: str) -> None:
    torch.manual_seed(0)
    shape = [2, 8]
    if case == "parametrized, train":
        model = spectral_and_weight_norm().train()
        model[0][0].parametrizations.weight.original1.grad = torch.ones(8, 8)
    elif case == "fx GraphModule":
        torchvision = pytest.importorskip("torchvision")
        model, shape = torch.fx.symbolic_trace(torchvision.models.resnet18(weights=None, num_classes=5)).eval(), \
            [1, 3, 32, 32]
    elif case == "DataParallel":
        model = nn.DataParallel(mlp()).eval()  # on CPU it calls the wrapped module directly
    else:
        with pytest.warns(Warning):  # torch.ao.quantization is deprecated
            model = torch.ao.quantization.quantize_dynamic(mlp(), {nn.Linear}, dtype=torch.qint8)
    text = "x".join(map(str, shape))
    before = snapshot(model)
    # plain torch on a copy: spectral norm's u, v move in train mode; a DataParallel's layers are
    # reported under the wrapped module's names (as DDP's), so torch's are taken there
    wrapped = model.module if isinstance(model, nn.DataParallel) else model
    expected = plain_outputs(copy.deepcopy(wrapped), dummy(*shape))

    everything = hookcli.stats(model, all_modules=True, input_shapes=[text])
    assert_same(before, snapshot(model))
    picked = sorted({r.name for r in everything.layers if r.called and r.stats})[:3]
    few = hookcli.stats(model, layers=picked, input_shapes=[text])
    assert_same(before, snapshot(model))

    assert rows(everything, set(picked)) == rows(few, set(picked))
    checked = 0
    for r in everything.layers:
        if r.output == "" and (r.name, r.call) in expected and r.stats is not None:
            assert_stats(r.stats, expected[(r.name, r.call)], rel=1e-4)
            checked += 1
    assert checked >= 30


class PackedLSTM(nn.Module):
    """A bidirectional LSTM on a packed batch of sequences of different lengths: its output is
    (PackedSequence, (h, c)), a namedtuple holding integer tensors inside a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 6, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([x.shape[1]] + [x.shape[1] - 2] * (x.shape[0] - 1))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _state = self.rnn(packed)
        return self.head(nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0])


def test_packed_sequence_outputs_get_torchs_stats_and_gradients() -> None:
    torch.manual_seed(0)
    model = PackedLSTM().eval()
    x = dummy(3, 5, 8)
    captured: dict[str, Any] = {}
    probe = model.rnn.register_forward_hook(lambda _m, _a, out: captured.__setitem__("out", out))
    loss = (model(x) ** 2).mean()
    probe.remove()
    packed, (h, c) = captured["out"]
    (grad_data,) = torch.autograd.grad(loss, [packed.data])

    stats = {r.output: r for r in hookcli.stats(model, layers=["rnn"], input_shapes=["3x5x8"]).layers}
    grads = {r.output: r for r in hookcli.grads(model, layers=["rnn"], input_shapes=["3x5x8"], loss="mean_square",
                                                  params="none").layers}

    assert list(stats) == ["[0].data", "[0].batch_sizes", "[0].sorted_indices", "[0].unsorted_indices",
                           "[1][0]", "[1][1]"]
    assert stats["[0].data"].shape == [11, 12] and stats["[0].batch_sizes"].stats is None  # integers: shape only
    assert stats["[0].batch_sizes"].dtype == "int64"
    for path, tensor in (("[0].data", packed.data), ("[1][0]", h), ("[1][1]", c)):
        assert_stats(stats[path].stats, tensor)
    assert_stats(grads["[0].data"].grad, grad_data, rel=1e-4)
    assert grads["[1][0]"].grad is None  # the final states are not used: no gradient reaches them


COUNTER = '''
import torch
from torch import nn

class Counter(nn.Module):
    """Counts its calls in a buffer and scales its output by the count; dropout in train mode."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros(()))
    def forward(self, x):
        self.calls += 1
        return self.drop(self.fc(x)) * self.calls

def quantized():
    return torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), {nn.Linear})
'''


@pytest.mark.parametrize("mode", ["--eval", "--train"])
def test_diff_of_a_model_that_updates_a_buffer_in_forward_against_itself_is_identical(
        tmp_path: Any, cli: Any, mode: str) -> None:
    (tmp_path / "counter.py").write_text(COUNTER)
    result = cli("diff", f"{tmp_path / 'counter.py'}:Counter", "--input-shape", "2x4", "--all", "--grads", mode,
                 "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["summary"]["diverged"] == 0 and report["summary"]["ok"] >= 2
    assert all(r["status"] == "ok" and r["grad_status"] in ("ok", None) for r in report["rows"])
    assert result.stderr == ""

    table = cli("diff", f"{tmp_path / 'counter.py'}:Counter", "--input-shape", "2x4", mode)
    assert table.exit_code == 0 and "first divergence: none" in table.stdout and table.stderr == ""


def test_an_instance_that_updates_buffers_in_forward_comes_back_with_its_values_and_diffs_identical() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    model[1].running_mean.fill_(0.25)
    before = snapshot(model)
    rng = torch.get_rng_state()
    report = hookcli.diff(model, input_shapes=["4x4"], all_modules=True, train=True, grads=True)
    assert report.ok and report.first_divergence is None and report.first_grad_divergence is None
    assert_same(before, snapshot(model))
    assert int(model[1].num_batches_tracked) == 0 and torch.equal(torch.get_rng_state(), rng)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_grads_of_a_dynamically_quantized_model_is_a_clear_exit_2(tmp_path: Any, cli: Any) -> None:
    (tmp_path / "counter.py").write_text(COUNTER)
    result = cli("grads", f"{tmp_path / 'counter.py'}:quantized", "--input-shape", "2x4")
    assert result.exit_code == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.startswith(("Error:", "  hint:"))]
    assert len(lines) == 2 and "quantized" in lines[0] and "Traceback" not in result.stderr
    stats = cli("stats", f"{tmp_path / 'counter.py'}:quantized", "--input-shape", "2x4", "-f", "json")
    assert stats.exit_code == 0
    assert [r["name"] for r in json.loads(stats.stdout)["layers"] if r["called"]] == ["0", "1"]


class GrowsInForward(nn.Module):
    """Adds a submodule the first time it runs (a lazy-init pattern): the tree changes during the run."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "proj"):
            self.proj = nn.Linear(4, 3)
        return self.proj(self.fc(x))


@pytest.mark.parametrize("command", ["grads", "diff", "check"])
def test_a_model_that_adds_a_submodule_in_forward_runs_and_counts_its_parameters(command: str) -> None:
    torch.manual_seed(0)
    model = GrowsInForward()
    options: dict[str, Any] = {"input_shapes": ["2x4"], "layers": ["(model)", "fc"]}
    before = copy.deepcopy(model)
    report = getattr(hookcli, command)(model, **options)  # was a KeyError from the parameter count: exit 3
    # the model comes back as it was: the submodule the run made (in hookcli's seeded run) is removed
    assert report.ok and not hasattr(model, "proj") and [n for n, _ in model.named_modules()] == ["", "fc"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    if command == "grads":
        reference = copy.deepcopy(before)
        kept: dict[str, torch.Tensor] = {}
        probe = reference.fc.register_forward_hook(lambda _m, _a, out: kept.__setitem__("fc", out))
        torch.manual_seed(0)  # the run's RNG starts as after torch.manual_seed(seed): the same proj
        loss = nn.functional.cross_entropy(reference(dummy(2, 4)), torch.zeros(2, dtype=torch.long))
        probe.remove()
        (expected,) = torch.autograd.grad(loss, [kept["fc"]])
        by_name = {r.name: r for r in report.layers}
        assert by_name[""].params == 20 + 15  # counted during the run, with proj
        assert by_name["fc"].params == 20
        assert_stats(by_name["fc"].grad, expected, rel=1e-4)
        assert model.fc.weight.grad is None


class LearnedQueries(nn.Module):
    """Returns its parameter itself (DETR-style learned queries): the output is a leaf tensor that
    outlives the run."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self) -> torch.Tensor:
        return self.weight


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.queries = LearnedQueries()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj(self.queries()).T


@pytest.mark.parametrize("input_grads", [False, True])
def test_no_gradient_hook_is_left_on_a_parameter_a_module_returned(input_grads: bool) -> None:
    torch.manual_seed(0)
    model = Decoder()
    weight = model.queries.weight
    loss = nn.functional.cross_entropy(model(dummy(2, 4)), torch.zeros(2, dtype=torch.long))
    (expected,) = torch.autograd.grad(loss, [weight])

    report = hookcli.grads(model, input_shapes=["2x4"], layers=["queries", "proj"], input_grads=input_grads,
                           params="none")

    (row,) = [r for r in report.layers if r.name == "queries"]
    assert_stats(row.grad, expected, rel=1e-4)
    if input_grads:
        (proj,) = [r for r in report.layers if r.name == "proj"]
        assert proj.grad_input is not None
        assert_stats(proj.grad_input[0], expected, rel=1e-4)  # proj's input is that parameter
    assert not weight._backward_hooks and weight.grad is None  # hookcli's hooks went with its run
    model(dummy(2, 4)).sum().backward()  # the user's own backward afterwards calls nothing of hookcli's
    assert weight.grad is not None and not weight._backward_hooks


def test_the_users_process_wide_hooks_stay_registered_and_both_hook_modes_see_what_they_return() -> None:
    model = mlp().eval()
    target = model[2][0]
    seen: list[str] = []

    def scale(module: nn.Module, _args: Any, out: Any) -> Any:
        if module is target:
            seen.append("scaled")
            return out * 100
        return None

    handle = torch_module.register_module_forward_hook(scale)
    try:
        probe = target.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
        with torch.no_grad():
            model(dummy(2, 8))
        probe.remove()
        expected = seen[-1]
        everything = hookcli.stats(model, all_modules=True, input_shapes=["2x8"])
        few = hookcli.stats(model, layers=["2.0"], input_shapes=["2x8"])
        assert handle.id in torch_module._global_forward_hooks  # the user's hook is still there
        assert seen.count("scaled") == 3
    finally:
        handle.remove()
    assert rows(everything, {"2.0"}) == rows(few, {"2.0"})
    (row,) = [r for r in everything.layers if r.name == "2.0"]
    assert_stats(row.stats, expected)
    assert float64_stats(expected)["max"] > 1  # the scaled output, not the Linear's own
