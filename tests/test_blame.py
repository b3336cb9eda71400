"""hookcli never blames the model for its own failure (issue 11, section 3).

Exit 1: the model itself raised or exited, or a check failed. Exit 2: usage/input, or something
hookcli does not support (UnsupportedError: what, and what to do instead). Exit 3: a bug in hookcli
("internal error", with the --debug hint). Each case asserts the exit code, the one-line message on
stderr (no traceback), what reached stdout, and that the model came back as it went in. Numbers are
checked against plain torch computed here (torch.autograd.grad for gradients).

Models used by CLI specs live in this module (``test_blame:NAME``; tests/ is on sys.path).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.engine import run as api  # the run machinery (prepare, forward_report, blame)
from hookcli.errors import InternalError, ModelRaisedError, UnsupportedError
from hookcli.engine.loading import load_model

warnings.filterwarnings("ignore", message=r".*torch\.jit\.(script|trace|trace_method|save|load)` is deprecated.*")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    """8 -> 16 -> 4."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def quantized_mlp() -> nn.Module:
    """A real dynamically quantized model (int8 Linear kernels: no backward)."""
    return torch.ao.quantization.quantize_dynamic(mlp().eval(), {nn.Linear}, dtype=torch.qint8)


class Sparsify(nn.Module):
    """Returns a sparse COO tensor (every value nonzero: abs + 0.5)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() + 0.5).to_sparse()


class SparseOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.sp = Sparsify()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sp(self.fc(x))


class SparseMaps(nn.Module):
    """A sparse (batch, channels, h, w) output, for fmaps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.sp = Sparsify()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sp(self.conv(x))


def scripted() -> nn.Module:
    return torch.jit.script(mlp())


def traced() -> nn.Module:
    return torch.jit.trace(mlp(), torch.randn(2, 8))


class WithTracedPart(nn.Module):
    """An eager model with a traced submodule: hooks cannot see inside ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.jit.trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Exits(nn.Module):
    """Calls ``sys.exit(code)`` in forward, after ``fc`` ran."""

    def __init__(self, code: Any = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.code = code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        sys.exit(self.code)
        return y  # pragma: no cover


def exits_while_building(code: int = 4) -> nn.Module:
    sys.exit(code)


class _ExitInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        sys.exit(5)


class ExitsInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ExitInBackward.apply(self.fc(x))


class Interrupted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc(x)
        raise KeyboardInterrupt


class SkipsItsModule(nn.Module):
    """``unused`` is never called: forward uses ``used`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class CallsHookcli(nn.Module):
    """A model whose forward calls into hookcli code that fails (for the traceback-origin rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hookcli.engine.selection import split_patterns

        split_patterns(5)  # type: ignore[arg-type]  # TypeError inside hookcli's own code
        return self.fc(x)


#: Instances the CLI loads by spec (``test_blame:SHARED_MLP``), so a CLI test can see them restored.
SHARED_MLP = mlp(1)
SHARED_EXITS = Exits(3)
SHARED_INTERRUPTED = Interrupted()


# --------------------------------------------------------------------------- helpers


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything a run must hand back: values, requires_grad, .grad, modes, and no hooks."""
    return {
        "state": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                  for k, v in model.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "grad": {n: p.grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
    }


def assert_restored(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["requires_grad"] == before["requires_grad"]
    assert after["training"] == before["training"]
    assert all(after["grad"][n] is before["grad"][n] for n in before["grad"])
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        if isinstance(value, torch.Tensor) and value.is_quantized:
            assert torch.equal(after["state"][key].int_repr(), value.int_repr()), key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(after["state"][key], value), key
        else:  # packed quantized weights: (weight, bias) tuples, dtypes
            assert repr(after["state"][key]) == repr(value), key
    for name, module in model.named_modules():
        hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                 module._backward_pre_hooks)
        assert not any(hooks), f"hooks left on {name or '(model)'}"
    for name, p in model.named_parameters():
        assert not p._backward_hooks, f"tensor hooks left on {name}"


def assert_one_error(result: Any, code: int, *needles: str, hint: str | None = None) -> str:
    """Exit ``code``; stderr ends with one ``Error:`` line (containing ``needles``) and a hint line."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    message = lines[errors[0]]
    for needle in needles:
        assert needle in message, (needle, message)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    rest = lines[errors[0] + 1:]
    assert len(rest) == 1 and rest[0].startswith("  hint: "), rest  # every error says what to do
    if hint is not None:
        assert hint in rest[0], rest
    return message


def save_input(tmp_path: Path, x: torch.Tensor, name: str = "x.pt") -> str:
    path = tmp_path / name
    torch.save(x, path)
    return str(path)


# --------------------------------------------------------------------------- hookcli's own failures


def test_a_failing_reducer_is_an_internal_error_not_the_model(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in hookcli's statistics (inside a forward hook) is exit 3 'internal error', never 'the
    model raised'; the model's forward was not aborted and the model comes back unchanged."""
    from hookcli.engine.stats import Reducer

    def broken(self: Reducer, t: torch.Tensor, *, zeros: bool = True) -> Any:
        raise RuntimeError("reducer bug")

    monkeypatch.setattr(Reducer, "reduce", broken)
    before = snapshot(SHARED_MLP)
    result = cli("stats", "test_blame:SHARED_MLP", "--input-shape", "2x8")
    message = assert_one_error(result, 3, "internal error: hookcli's forward hook on fc1 raised RuntimeError: "
                               "reducer bug", hint="--debug")
    assert "model raised" not in message
    assert result.stdout == ""
    assert_restored(SHARED_MLP, before)
    debug = cli("stats", "test_blame:SHARED_MLP", "--input-shape", "2x8", "--debug")
    assert debug.exit_code == 3 and "Traceback" in debug.stderr and "reducer bug" in debug.stderr
    assert_restored(SHARED_MLP, before)


def test_a_failing_gradient_hook_is_an_internal_error(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same in backward: hookcli's tensor hook on an output gradient fails -> exit 3."""
    from hookcli.engine.stats import Reducer

    original = Reducer.reduce

    def broken_for_grads(self: Reducer, t: torch.Tensor, *, zeros: bool = True) -> Any:
        if not zeros:  # gradients are reduced without the zero count
            raise ValueError("gradient reducer bug")
        return original(self, t, zeros=zeros)

    monkeypatch.setattr(Reducer, "reduce", broken_for_grads)
    before = snapshot(SHARED_MLP)
    result = cli("grads", "test_blame:SHARED_MLP", "--input-shape", "2x8")
    assert_one_error(result, 3, "internal error: hookcli's gradient hook on an output of fc2 raised ValueError",
                     hint="please report it")
    assert result.stdout == ""
    assert_restored(SHARED_MLP, before)


def test_api_keep_callback_failure_is_internal_and_model_restored() -> None:
    """``keep`` runs inside the forward hook: its exception is hookcli's (InternalError), the
    model's forward still completes, and hooks are removed."""
    model = mlp()
    model.train()
    before = snapshot(model)
    seen: list[str] = []

    def keep(name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        seen.append(name)
        if name == "act":
            raise KeyError("keep bug")

    prep = api.prepare(api.RunOptions(model=model, model_source="python", input_shapes=["2x8"]))
    with pytest.raises(InternalError) as info:
        api.forward_report(prep, "stats", stats=True, keep=keep)
    assert str(info.value).startswith("internal error: hookcli's forward hook on act raised KeyError")
    assert info.value.exit_code == 3
    assert seen == ["fc1", "act", "fc2"]  # the forward ran to the end: the model was not interrupted
    assert isinstance(info.value.__cause__, KeyError)
    assert_restored(model, before)


def test_unexpected_exception_in_the_cli_is_exit_3(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(api, "forward_report", bug)
    result = cli("stats", "test_blame:SHARED_MLP", "--input-shape", "2x8")
    assert_one_error(result, 3, "Error: internal error: ZeroDivisionError: division by zero",
                     hint="run again with --debug for the traceback, and please report it")
    assert result.stdout == ""
    with pytest.raises(ZeroDivisionError):  # --debug: the real traceback
        cli("stats", "test_blame:SHARED_MLP", "--input-shape", "2x8", "--debug")


def test_traceback_origin_decides_who_raised() -> None:
    """The backstop: an exception whose innermost non-library frame is hookcli's code is hookcli's;
    one raised in the model's code, or in torch called by the model, is the model's."""
    model = CallsHookcli()
    with pytest.raises(TypeError) as ours:
        model(torch.randn(2, 8))
    assert api.raised_in_hookcli(ours.value) == "split_patterns"
    with pytest.raises(InternalError, match="internal error: hookcli's split_patterns"):
        api.blame(ours.value, model, "forward")

    bad = nn.Sequential(nn.Linear(8, 4), nn.Linear(5, 2))  # torch raises inside torch's own modules
    with pytest.raises(RuntimeError) as theirs:
        bad(torch.randn(2, 8))
    assert api.raised_in_hookcli(theirs.value) is None
    failure = api.blame(theirs.value, bad, "forward")
    assert failure.module == "1" and failure.input_shapes == [[2, 4]]


def test_model_that_calls_failing_hookcli_code_in_a_run_is_internal() -> None:
    model = CallsHookcli()
    before = snapshot(model)
    with pytest.raises(InternalError, match="split_patterns"):
        hookcli.stats(model, input_shapes=["2x8"])
    assert_restored(model, before)


def test_the_model_raising_is_still_exit_1(cli) -> None:
    """The control: the model's own exception stays 'the model raised', exit 1, partial rows."""
    result = cli("stats", "tiny_models:Raises", "--input-shape", "2x4", "-f", "json")
    assert_one_error(result, 1, "the model raised in forward at bad (CheckedLinear)")
    assert json.loads(result.stdout)["failure"]["module"] == "bad"


# --------------------------------------------------------------------------- quantized models


def test_quantized_model_grads_is_unsupported(cli) -> None:
    result = cli("grads", "test_blame:quantized_mlp", "--input-shape", "2x8")
    message = assert_one_error(result, 2, "has no gradients: it is quantized", "fc1", "fc2",
                               hint="run hookcli stats or shapes on it")
    assert "model raised" not in message and "internal error" not in message
    assert result.stdout == ""
    check = cli("check", "test_blame:quantized_mlp", "--input-shape", "2x8")
    assert_one_error(check, 2, "has no gradients: it is quantized", hint="float model")
    assert check.stdout == ""


def test_quantized_model_api_grads_unsupported_and_restored() -> None:
    model = quantized_mlp()
    before = snapshot(model)
    with warnings.catch_warnings(record=True) as caught, \
            pytest.raises(UnsupportedError, match="has no gradients: it is quantized") as info:
        warnings.simplefilter("always")
        hookcli.grads(model, input_shapes=["2x8"])
    assert info.value.exit_code == 2 and "stats or shapes" in (info.value.hint or "")
    # torch's "autograd kernel was not registered" warning is said by the error instead
    assert not [w for w in caught if "autograd kernel" in str(w.message)]
    assert_restored(model, before)


def test_quantized_model_stats_still_work(tmp_path: Path) -> None:
    """stats on the same quantized model: numbers of the int8 path, checked against running it."""
    model = quantized_mlp()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))
    report = hookcli.stats(model, inputs=[save_input(tmp_path, x)])
    expected = model(x)
    row = next(r for r in report.layers if r.name == "fc2")
    assert row.shape == [3, 4]
    assert row.stats["mean"] == pytest.approx(expected.double().mean().item(), rel=1e-5, abs=1e-7)
    assert row.stats["max"] == pytest.approx(expected.max().item(), rel=1e-6)


def test_frozen_model_has_no_gradients_unsupported() -> None:
    """No parameter or input requires grad (integer input, frozen weights): not 'the model raised'."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))
    for p in model.parameters():
        p.requires_grad_(False)
    before = snapshot(model)
    with pytest.raises(UnsupportedError, match="has no gradients: the loss does not depend"):
        hookcli.grads(model, input_shapes=["2x2:int64"])
    assert_restored(model, before)


# --------------------------------------------------------------------------- sparse outputs


def test_features_exports_sparse_outputs_dense(cli, tmp_path: Path) -> None:
    model = SparseOut()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    before = snapshot(model)
    result = hookcli.features(model, inputs=[save_input(tmp_path, x)], output=tmp_path / "f.pt")
    with torch.no_grad():
        dense = model(x).to_dense()
        fc = model.fc(x)
    assert result.tensors["sp"].layout == torch.strided
    assert torch.equal(result.tensors["sp"], dense) and torch.equal(result.tensors["fc"], fc)
    saved = torch.load(tmp_path / "f.pt", weights_only=True)["tensors"]
    assert torch.equal(saved["sp"], dense)
    assert_restored(model, before)
    out = cli("features", "test_blame:SparseOut", "--input-shape", "2x8", "-o", tmp_path / "g.safetensors",
              "-f", "json")
    assert out.exit_code == 0, out.stderr
    assert "Error" not in out.stderr
    entries = {e["label"]: e for e in json.loads(out.stdout)["tensors"]}
    assert entries["sp"]["shape"] == [2, 4]
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "g.safetensors"))["sp"].layout == torch.strided


def test_fmaps_draws_a_sparse_output(cli, tmp_path: Path) -> None:
    model = SparseMaps()
    x = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(4))
    result = hookcli.fmaps(model, layer="sp", inputs=[save_input(tmp_path, x)], output=tmp_path / "m.png")
    with torch.no_grad():
        dense = model(x).to_dense()[0]
    for channel in result.channels:
        values = dense[channel.index]
        assert channel.min == pytest.approx(values.min().item(), rel=1e-6)
        assert channel.max == pytest.approx(values.max().item(), rel=1e-6)
        assert channel.mean == pytest.approx(values.double().mean().item(), rel=1e-5)
    assert (tmp_path / "m.png").stat().st_size > 0
    out = cli("fmaps", "test_blame:SparseMaps", "--input-shape", "1x3x6x6", "--layer", "sp",
              "-o", tmp_path / "c.png")
    assert out.exit_code == 0, out.stderr


def test_check_of_a_sparse_output_passes(cli) -> None:
    """A sparse output's implicit zeros are finite values, not NaN/Inf; its channels are read dense."""
    result = cli("check", "test_blame:SparseMaps", "--input-shape", "2x3x6x6", "--params", "selected", "-f", "json")
    assert result.exit_code == 0, result.stderr
    statuses = {r["rule"]: r["status"] for r in json.loads(result.stdout)["rules"]}
    assert statuses["runs"] == "PASS" and statuses["finite"] == "PASS"


def test_grads_of_a_sparse_output_match_autograd(tmp_path: Path) -> None:
    model = SparseOut()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(5))
    report = hookcli.grads(model, inputs=[save_input(tmp_path, x)], layers="sp,fc", params="all")
    out_fc = model.fc(x)
    out_sp = model.sp(out_fc)
    loss = F.cross_entropy(out_sp.to_dense(), torch.zeros(2, dtype=torch.long))
    g_sp, g_w = torch.autograd.grad(loss, [out_sp, model.fc.weight])
    rows = {r.name: r for r in report.layers}
    assert rows["sp"].grad["norm"] == pytest.approx(g_sp.to_dense().norm().item(), rel=1e-5)
    weight = next(p for p in report.params if p.name == "fc.weight")
    assert weight.grad["norm"] == pytest.approx(g_w.norm().item(), rel=1e-5)
    assert report.loss["value"] == pytest.approx(loss.item(), rel=1e-6)


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with a padding mask: in eval its layers take the nested-tensor fast path
    (their inputs and outputs are ragged nested tensors)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
        mask[0, -2:] = True  # sample 0 has 3 tokens, sample 1 has 4
        mask[1, -1:] = True
        return self.enc(x, src_key_padding_mask=mask)


def test_nested_tensor_outputs_are_reported_not_blamed(cli, tmp_path: Path) -> None:
    """Nested (ragged) outputs get statistics of their values and a shape with -1 where ragged;
    keeping them as one array (features) is unsupported (exit 2), never 'the model raised'."""
    model = PaddedEncoder().eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
    captured: list[torch.Tensor] = []
    handle = model.enc.layers[0].register_forward_hook(lambda m, a, o: captured.append(o.detach()))
    report = hookcli.stats(model, inputs=[save_input(tmp_path, x)], layers="enc.layers.0")
    handle.remove()
    (out,) = captured
    assert out.is_nested
    values = torch.cat([c.reshape(-1) for c in out.unbind()]).double()
    (row,) = report.layers
    assert row.shape == [2, -1, 8]
    assert row.stats["mean"] == pytest.approx(values.mean().item(), rel=1e-5, abs=1e-7)
    assert row.stats["std"] == pytest.approx(values.std(correction=0).item(), rel=1e-5)
    assert row.stats["max"] == pytest.approx(values.max().item(), rel=1e-6)
    result = cli("features", "test_blame:PaddedEncoder", "--input-shape", "2x5x8", "--layers", "enc.layers.0",
                 "-o", tmp_path / "f.pt")
    assert_one_error(result, 2, "enc.layers.0 returned a nested (ragged) tensor", hint="--layers")
    assert not (tmp_path / "f.pt").exists()


# --------------------------------------------------------------------------- inference_mode / no_grad


def _expected_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, _ in model.named_parameters()]
    loss = F.cross_entropy(model(x), torch.zeros(x.shape[0], dtype=torch.long))
    grads = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    return dict(zip(names, grads))


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
def test_grads_work_under_the_callers_inference_mode_and_no_grad(context: Any, tmp_path: Path) -> None:
    model = mlp()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    path = save_input(tmp_path, x)
    expected = _expected_grads(model, x)
    before = snapshot(model)
    with context():
        report = hookcli.grads(model, inputs=[path], params="all")
        assert not torch.is_grad_enabled()  # the caller's mode is left as it was
    for p in report.params:
        assert p.grad["norm"] == pytest.approx(expected[p.name].norm().item(), rel=1e-5), p.name
    assert_restored(model, before)


def test_grads_of_a_model_hookcli_builds_under_inference_mode() -> None:
    """A spec built inside the caller's inference_mode gets normal tensors: grads work."""
    with torch.inference_mode():
        report = hookcli.grads("test_blame:mlp", input_shapes=["2x8"], params="all")
    assert all(p.grad is not None and p.grad["norm"] > 0 for p in report.params)


def test_check_under_inference_mode_gives_the_same_verdict() -> None:
    model = mlp()
    outside = hookcli.check(model, input_shapes=["2x8"])
    with torch.inference_mode():
        inside = hookcli.check(model, input_shapes=["2x8"])
    assert outside.ok and inside.ok
    assert [(r.rule, r.status) for r in inside.rules] == [(r.rule, r.status) for r in outside.rules]


def test_stats_and_shapes_inside_inference_mode(tmp_path: Path) -> None:
    model = mlp()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    path = save_input(tmp_path, x)
    before = snapshot(model)
    with torch.inference_mode():
        report = hookcli.stats(model, inputs=[path])
        shapes = hookcli.shapes(model, inputs=[path])
    with torch.no_grad():
        h = model.fc1(x)
    row = next(r for r in report.layers if r.name == "fc1")
    assert row.stats["mean"] == pytest.approx(h.double().mean().item(), rel=1e-5, abs=1e-7)
    assert row.stats["std"] == pytest.approx(h.double().std(correction=0).item(), rel=1e-5)
    assert [r.shape for r in shapes.layers] == [[2, 16], [2, 16], [2, 4]]
    assert_restored(model, before)


def test_model_built_under_inference_mode_grads_unsupported_stats_fine() -> None:
    with torch.inference_mode():
        model = mlp()
    before = snapshot(model)
    with pytest.raises(UnsupportedError, match="inference tensors") as info:
        hookcli.grads(model, input_shapes=["2x8"])
    assert "outside torch.inference_mode" in (info.value.hint or "")
    assert_restored(model, before)
    report = hookcli.stats(model, input_shapes=["2x8"])
    assert all(r.called for r in report.layers)
    assert_restored(model, before)


# --------------------------------------------------------------------------- TorchScript


@pytest.mark.parametrize("spec", ["test_blame:scripted", "test_blame:traced"])
@pytest.mark.parametrize("command", ["stats", "shapes", "grads", "check"])
def test_torchscript_models_are_refused(cli, spec: str, command: str) -> None:
    """Scripted: hooks cannot be registered; traced: they never fire inside. Never a silent pass."""
    result = cli(command, spec, "--input-shape", "2x8")
    message = assert_one_error(result, 2, "TorchScript", hint="eager nn.Module")
    assert "internal error" not in message and "model raised" not in message
    assert result.stdout == ""


def test_torchscript_api_instance_refused_and_untouched(tmp_path: Path) -> None:
    model = traced()
    before = snapshot(model)
    for fn in (hookcli.stats, hookcli.grads, hookcli.check):
        with pytest.raises(UnsupportedError, match="TorchScript"):
            fn(model, input_shapes=["2x8"])
    with pytest.raises(UnsupportedError, match="TorchScript"):
        hookcli.features(model, input_shapes=["2x8"], output=tmp_path / "f.pt")
    assert not (tmp_path / "f.pt").exists()
    assert_restored(model, before)


def test_a_traced_submodule_is_refused_unless_left_out(cli) -> None:
    result = cli("stats", "test_blame:WithTracedPart", "--input-shape", "2x8")
    assert_one_error(result, 2, "selected modules are TorchScript (body)", hint="--layers")
    ok = cli("stats", "test_blame:WithTracedPart", "--input-shape", "2x8", "--layers", "head", "-f", "json")
    assert ok.exit_code == 0, ok.stderr
    assert [(r["name"], r["called"]) for r in json.loads(ok.stdout)["layers"]] == [("head", True)]


def test_torchscript_archive_as_model_or_weights(cli, tmp_path: Path) -> None:
    archive = tmp_path / "net.pt"
    source = scripted()
    torch.jit.save(source, str(archive))
    as_model = cli("stats", archive, "--input-shape", "2x8")
    assert_one_error(as_model, 2, "is a TorchScript archive", hint="eager nn.Module")
    state = tmp_path / "state.pt"
    torch.save(mlp().state_dict(), state)
    assert_one_error(cli("stats", state), 2, "is a weights file, not a model", hint="--weights")
    as_weights = cli("stats", "test_blame:MLP", "--weights", archive, "--input-shape", "2x8")
    assert_one_error(as_weights, 2, "is a TorchScript archive, not a state dict", hint="--trust-pickle")
    assert as_weights.stdout == ""
    loaded = load_model("test_blame:MLP", weights=str(archive), trust_pickle=True).model
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


# --------------------------------------------------------------------------- check sees something


def test_check_fails_when_no_selected_module_ran(cli) -> None:
    result = cli("check", "test_blame:SkipsItsModule", "--input-shape", "2x8", "--layers", "unused", "-f", "json")
    assert_one_error(result, 1, "none of the 1 selected module(s) was called (unused)")
    data = json.loads(result.stdout)
    statuses = {r["rule"]: r["status"] for r in data["rules"]}
    assert statuses.pop("runs") == "FAIL" and set(statuses.values()) == {"SKIP"}
    ran = cli("check", "test_blame:SkipsItsModule", "--input-shape", "2x8", "--layers", "used", "--params", "selected")
    assert ran.exit_code == 0, ran.stderr


def test_check_api_not_ok_when_nothing_observed() -> None:
    model = SkipsItsModule()
    result = hookcli.check(model, input_shapes=["2x8"], layers="unused")
    assert not result.ok and result.rule("runs").status == "FAIL"
    assert "nothing was checked" in result.rule("runs").message


# --------------------------------------------------------------------------- sys.exit and Ctrl-C


@pytest.mark.parametrize(("code", "said"), [(3, "code 3"), (0, "code 0"), (None, "code 0"), ("bye", "code 1 ('bye')")])
def test_sys_exit_in_forward_is_said_exit_1(cli, monkeypatch: pytest.MonkeyPatch, code: Any, said: str) -> None:
    """Whatever the code (0 too: the run did not complete), exit 1 and one line; the partial report
    (rows gathered before the exit) reaches stdout; the model is restored."""
    monkeypatch.setattr(SHARED_EXITS, "code", code)
    before = snapshot(SHARED_EXITS)
    result = cli("stats", "test_blame:SHARED_EXITS", "--input-shape", "2x8", "-f", "json")
    assert_one_error(result, 1, f"the model exited with {said} in forward at (model) (Exits)", "sys.exit")
    report = json.loads(result.stdout)
    assert report["failure"]["exception"] == "SystemExit"
    assert [(r["name"], r["called"]) for r in report["layers"]] == [("fc", True)]
    assert_restored(SHARED_EXITS, before)


def test_sys_exit_in_grads_and_check(cli) -> None:
    grads = cli("grads", "test_blame:ExitsInBackward", "--input-shape", "2x8")
    assert_one_error(grads, 1, "the model exited with code 5 in backward")
    check = cli("check", "test_blame:Exits", "--input-shape", "2x8")
    assert_one_error(check, 1, "check failed: the model exited with code 3 in forward")


def test_sys_exit_while_building_or_importing(cli, tmp_path: Path) -> None:
    built = cli("stats", "test_blame:exits_while_building", "--input-shape", "2x8")
    assert_one_error(built, 1, "the model exited with code 4 while building 'test_blame:exits_while_building'",
                     hint="sys.exit")
    script = tmp_path / "quits.py"
    script.write_text("import sys\nsys.exit(7)\n")
    imported = cli("stats", f"{script}:Net")
    assert_one_error(imported, 1, "the model exited with code 7 while importing", hint="sys.exit")


def test_sys_exit_api_raises_model_raised_and_restores() -> None:
    model = Exits(9)
    model.train()
    before = snapshot(model)
    with pytest.raises(ModelRaisedError, match="the model exited with code 9 in forward") as info:
        hookcli.stats(model, input_shapes=["2x8"])
    assert info.value.exit_code == 1 and info.value.report is not None
    assert_restored(model, before)
    with pytest.raises(ModelRaisedError, match="exited with code 9"):
        hookcli.features(model, input_shapes=["2x8"])
    assert_restored(model, before)


def test_a_stray_sys_exit_is_said_not_silent(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model code that exits outside the guarded run (here: in place of the run) still gets one
    line and exit 1 from the CLI's one place, never a silent end with the model's code."""
    def exits(*args: Any, **kwargs: Any) -> Any:
        sys.exit(6)

    monkeypatch.setattr(api, "forward_report", exits)
    result = cli("stats", "test_blame:SHARED_MLP", "--input-shape", "2x8")
    assert_one_error(result, 1, "the model exited with code 6", hint="sys.exit")
    assert result.stdout == ""


def test_keyboard_interrupt_stays_130(cli) -> None:
    before = snapshot(SHARED_INTERRUPTED)
    result = cli("stats", "test_blame:SHARED_INTERRUPTED", "--input-shape", "2x8")
    assert result.exit_code == 130
    assert result.stderr.strip() == "interrupted" and result.stdout == ""
    assert_restored(SHARED_INTERRUPTED, before)


# --------------------------------------------------------------------------- property: who raised


@settings(max_examples=15, deadline=None)
@given(where=st.sampled_from(["fc1", "act", "fc2"]), kind=st.sampled_from(["hookcli", "model"]))
def test_blame_follows_who_raised(where: str, kind: str) -> None:
    """Wherever it happens, hookcli's failure is internal and the model's is the model's."""
    model = mlp()
    before = snapshot(model)
    target = dict(model.named_modules())[where]
    if kind == "model":
        def users_hook(module: nn.Module, args: Any, output: Any) -> None:  # the user's code, not hookcli's
            raise RuntimeError("model bug")

        handle = target.register_forward_hook(users_hook)
        with pytest.raises(ModelRaisedError) as info:
            hookcli.stats(model, input_shapes=["2x8"])
        handle.remove()
        assert info.value.module == where
    else:
        def keep(name: str, call: int, path: str, tensor: torch.Tensor) -> None:
            if name == where:
                raise RuntimeError("hookcli bug")

        prep = api.prepare(api.RunOptions(model=model, model_source="python", input_shapes=["2x8"]))
        with pytest.raises(InternalError, match=f"forward hook on {where} raised RuntimeError"):
            api.forward_report(prep, "stats", stats=True, keep=keep)
    assert_restored(model, before)
