"""Round-2 tryout: models nobody here wrote the engine for, used as a new user would (process-wide hooks,
``diff``, the model index, parametrized / quantized / wrapped models, the user's own hooks).

Every number is checked against plain torch computed here (``torch.autograd.grad`` for gradients);
process-wide hooks (``all_modules=True`` on a model of >= 32 modules) and per-module hooks (a few
``layers``) must give the same rows for the modules both select.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import hookcli

from tests.reference import dummy, float64_stats

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
