"""Round-3 tryout: inputs and models nobody here wrote, used as a new user would.

Every number is checked against plain torch computed here (``torch.autograd.grad`` for gradients);
the faults these found have bad-input rows in ``tests/test_bad_inputs.py`` besides.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hookcli
from hookcli.errors import UnsupportedError, WatchWarning

from reference import float64_stats

LINEAR_FILE = """
from torch import nn


def build():
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh())
"""


@pytest.fixture
def linear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file model ``net.py:build`` in a scratch working directory."""
    (tmp_path / "net.py").write_text(LINEAR_FILE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _layer_stats(stdout: str, name: str) -> dict[str, float]:
    (layer,) = [r for r in json.loads(stdout)["layers"] if r["name"] == name]
    return layer["stats"]


@pytest.mark.parametrize("npz", [False, True], ids=["npy", "npz"])
@pytest.mark.parametrize("kind", ["f4", "f8"])
@pytest.mark.parametrize("order", [">", "<"], ids=["big-endian", "little-endian"])
def test_a_big_endian_npy_is_read_as_its_values(cli, linear: Path, order: str, kind: str, npz: bool) -> None:
    """numpy writes the byte order into the file (``>f4``); torch.from_numpy refused a non-native one
    (exit 2, "is it a complete .npy file?"). The values must arrive as they were saved."""
    values = np.linspace(-2, 2, 8).reshape(2, 4)
    array = values.astype(order + kind)
    if npz:
        np.savez(linear / "x.npz", input=array)
    else:
        np.save(linear / "x.npy", array)
    linear_layer = torch.nn.Linear(4, 3)
    torch.save(torch.nn.Sequential(linear_layer, torch.nn.Tanh()).state_dict(), linear / "w.pt")
    dtype = ["--dtype", "float64"] if kind == "f8" else []
    result = cli("stats", "net.py:build", "--weights", "w.pt", "--input", "x.npz" if npz else "x.npy",
                 "--layers", "0", "--format", "json", *dtype)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    with torch.no_grad():
        expected = float64_stats(linear_layer.double()(torch.from_numpy(values)))
    stats = _layer_stats(result.stdout, "0")
    for key in ("mean", "std", "min", "max", "norm"):
        assert stats[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key


SCALED_FILE = """
import torch
from torch import nn


class Scaled(nn.Module):
    '''x * SCALE through an Identity: a float64 model whose activations have grown huge.'''

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.out = nn.Identity()

    def forward(self, x):
        return self.out(x * self.scale)
"""


@pytest.mark.parametrize("kernel", ["kernel", "torch"])
@pytest.mark.parametrize("scale, offset", [(1e100, 0.0), (1e160, 1.0)], ids=["spread-1e100", "mean-1e160"])
def test_huge_float64_activations_are_reported_not_an_internal_error(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scale: float, offset: float, kernel: str) -> None:
    """A float64 model whose activations have grown huge. Values spread over 1e100: the fourth moment
    overflows, and Python's ``float ** 4`` raised OverflowError inside the hook (exit 3, internal
    error). Values near 1e160 spread by 1e150: the norm's ``mean ** 2`` raised the same. The statistics
    must be reported (the kurtosis may be NaN); the norm is compared with torch's of the values scaled
    down, since ``vector_norm`` itself overflows there."""
    from hookcli.engine.kernel import NO_KERNEL_ENV

    monkeypatch.setenv(NO_KERNEL_ENV, "0" if kernel == "kernel" else "1")
    (tmp_path / "scaled.py").write_text(SCALED_FILE)
    monkeypatch.chdir(tmp_path)
    spread = 1e-10 if offset else 1.0
    x = offset + spread * torch.randn(4, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.save(x, tmp_path / "x.pt")
    result = cli("stats", "scaled.py:Scaled", "--model-arg", f"scale={scale!r}", "--dtype", "float64",
                 "--input", "x.pt", "--layers", "out", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    expected = float64_stats(x * scale)
    expected["norm"] = float(torch.linalg.vector_norm(x)) * scale
    stats = _layer_stats(result.stdout, "out")
    for key in ("mean", "std", "min", "max", "norm"):
        assert stats[key] == pytest.approx(expected[key], rel=1e-6), key


@pytest.mark.parametrize("loss", ["ce", "mean_square", "mean"])
def test_a_float64_models_loss_and_gradients_are_float64(cli, linear: Path, loss: str) -> None:
    """``grads --dtype float64``: the loss was computed on ``output.float()``, so a float64 model's
    loss and every gradient carried float32 rounding (relative errors of 1e-8..1e-7) and outputs above
    3e38 became inf. They must equal float64 torch to float64 precision."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).double()
    torch.save(model.state_dict(), linear / "w.pt")
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.save(x, linear / "x.pt")
    result = cli("grads", "net.py:build", "--weights", "w.pt", "--dtype", "float64", "--input", "x.pt",
                 "--loss", loss, "--params", "all", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    out = model(x)
    value = {"ce": lambda: torch.nn.functional.cross_entropy(out, torch.zeros(5, dtype=torch.long)),
             "mean_square": lambda: out.square().mean(), "mean": lambda: out.mean()}[loss]()
    report = json.loads(result.stdout)
    assert report["loss"]["value"] == pytest.approx(value.item(), rel=1e-13)
    grads = dict(zip(("0.weight", "0.bias"), torch.autograd.grad(value, [model[0].weight, model[0].bias])))
    for param in report["params"]:
        assert param["grad"]["norm"] == pytest.approx(float(grads[param["name"]].norm()), rel=1e-12), param["name"]


TINY_GPT2 = ("--model-arg", "n_layer=1", "--model-arg", "n_embd=16", "--model-arg", "n_head=2",
             "--model-arg", "vocab_size=50", "--seq-len", "4")


@pytest.mark.parametrize("command", ["stats", "grads", "check"])
def test_an_hf_model_too_large_for_the_memory_is_refused_before_it_is_built(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """``hookcli stats hf:llama`` (the default config: 7B parameters, 25 GiB) was built for real and
    killed by the system (exit 137) after minutes of swapping. The weights are counted on the meta
    device first: over half the memory is exit 2 with a hint. Here the machine is told it has 64 KiB,
    less than twice this tiny GPT-2's weights."""
    from hookcli import limits

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(limits, "memory_bytes", lambda: 64 << 10)
    result = cli(command, "hf:gpt2", *TINY_GPT2)
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "hf:gpt2 has" in lines[0] and "GiB of weights" in lines[0], result.stderr
    assert lines[1].startswith("  hint: hookcli shapes")
    assert result.stdout == ""
    monkeypatch.setattr(limits, "memory_bytes", lambda: 1 << 40)
    assert cli(command, "hf:gpt2", *TINY_GPT2).exit_code == 0


def test_shapes_of_an_hf_model_too_large_for_the_memory_still_run_on_meta(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookcli import limits

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(limits, "memory_bytes", lambda: 64 << 10)
    result = cli("shapes", "hf:gpt2", *TINY_GPT2, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["device"] == "meta"


def test_a_timm_model_too_large_for_the_memory_is_refused_before_it_is_built(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """timm has models of billions of parameters (aimv2_3b: 11 GiB): counted on meta as for hf:."""
    from hookcli import limits

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(limits, "memory_bytes", lambda: 64 << 10)
    result = cli("stats", "timm:test_resnet", "--input-shape", "1x3x32x32")
    assert result.exit_code == 2, result.stderr
    assert "timm:test_resnet has" in result.stderr and "  hint: " in result.stderr
    assert result.stdout == ""


def _train_logged(path: Path, steps: int, seed: int) -> list[float]:
    """``steps`` steps of a small MLP under ``hookcli.watch(every=1, out=path)``; plain torch's losses."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with hookcli.watch(model, optimizer, every=1, out=path) as w:
        for _ in range(steps):
            x = torch.randn(16, 4)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            w.step(loss=loss)
            losses.append(loss.item())
    return losses


def test_a_run_resumed_after_a_crash_mid_write_is_reported(cli, tmp_path: Path) -> None:
    """A run killed while writing a line, then resumed with the same ``out`` (the log is appended to
    for that): the new run's first line was glued to the torn one, and ``hookcli report`` refused the
    whole log (exit 2, "line 3 is not JSON"). The new run must start on a line of its own, the torn
    line be left out with a note, and every whole line of both runs be reported."""
    log = tmp_path / "run.jsonl"
    first = _train_logged(log, 3, seed=0)
    lines = log.read_bytes().splitlines(keepends=True)
    torn = lines[0] + lines[1] + lines[2][: len(lines[2]) // 2]
    log.write_bytes(torn)  # the crash: line 3 half written
    second = _train_logged(log, 2, seed=1)
    assert log.read_bytes().startswith(torn)  # nothing the user had is lost
    result = cli("report", log, "--format", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["steps"] == [0, 1, 0, 1]
    assert report["losses"] == pytest.approx(first[:2] + second, rel=1e-6)
    notes = result.stderr.splitlines()
    assert notes[0].startswith("note: line 3 left out: it is cut short"), result.stderr
    assert "steps go back" in result.stderr and "Error" not in result.stderr


@pytest.fixture(scope="module")
def three_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The three lines of a real watch log."""
    log = tmp_path_factory.mktemp("log") / "run.jsonl"
    _train_logged(log, 3, seed=0)
    return log.read_text().splitlines(keepends=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 1.0, exclude_max=True))
def test_a_line_cut_anywhere_then_followed_by_whole_lines_is_left_out(three_lines: list[str], tmp_path: Path,
                                                                      cut: float) -> None:
    """Wherever the crash cut line 2 (inside a number, a string, a key), the report leaves it out with
    a note and reads the lines after it."""
    cut_at = max(1, int(cut * (len(three_lines[1]) - 1)))
    log = tmp_path / "cut.jsonl"
    log.write_text(three_lines[0] + three_lines[1][:cut_at] + "\n" + three_lines[2])
    report = hookcli.report(log)
    assert report.steps == [0, 2]
    assert report.notes[0].startswith("line 2 left out: it is cut short")


def test_a_log_whose_only_line_is_cut_short_says_so(cli, three_lines: list[str], tmp_path: Path) -> None:
    """A run killed while writing its first line: the error said "no logged steps (empty log)" and the
    note about the torn line was lost; it must say that its only line is cut short."""
    log = tmp_path / "cut.jsonl"
    log.write_text(three_lines[0][:100])
    result = cli("report", log)
    assert result.exit_code == 2
    err = result.stderr.splitlines()
    assert len(err) == 2 and err[0].startswith("Error: ") and "cut short" in err[0], result.stderr
    assert "empty log" not in err[0] and err[1].startswith("  hint: ") and result.stdout == ""


@settings(max_examples=20, deadline=None)
@given(loss=st.integers(min_value=2**1024, max_value=10**600) | st.integers(min_value=-(10**600), max_value=-(2**1024)))
def test_a_loss_beyond_floats_range_is_an_infinite_loss_not_an_internal_error(loss: int) -> None:
    """``w.step(loss=10**400)``: a Python int is a number, but ``float()`` of it raised OverflowError out
    of ``w.step`` (an internal error). It is the infinite loss float arithmetic makes of it, which the
    ``nonfinite`` rule flags."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hookcli.watch(model, optimizer) as w:
        model(torch.ones(3, 2)).sum().backward()
        optimizer.step()
        w.step(loss=loss)
    assert w.last is not None and w.last.loss == (float("inf") if loss > 0 else float("-inf"))
    assert [f.direction for f in w.findings if f.rule == "nonfinite"] == ["loss"]


CHDIR_SCRIPT = """
import json, os, sys
import torch
from torch import nn

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "work"))  # the script works in its folder
torch.manual_seed(0)
model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
updates = []
for step in range(2):
    model(torch.randn(4, 3)).sum().backward()
    before = model.weight.detach().clone()
    optimizer.step()
    optimizer.zero_grad()
    updates.append(float((model.weight.detach() - before).norm()))
json.dump(updates, open("updates.json", "w"))
"""


def test_watch_scripts_out_is_where_the_user_ran_hookcli_not_where_the_script_went(cli, tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``hookcli watch --out runs/a.jsonl -- python train.py`` with a script that changes its working
    directory before its first step: the log was opened there (work/runs/a.jsonl), not in the folder
    the user typed the command in, where the summary line said it was."""
    (tmp_path / "work").mkdir()
    (tmp_path / "train.py").write_text(CHDIR_SCRIPT)
    monkeypatch.chdir(tmp_path)
    result = cli("watch", "--every", "1", "--out", "runs/a.jsonl", "--", "python", "train.py")
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "work" / "runs").exists()
    lines = [json.loads(line) for line in (tmp_path / "runs" / "a.jsonl").read_text().splitlines()]
    assert "2 logged to runs/a.jsonl" in result.stderr
    updates = json.loads((tmp_path / "work" / "updates.json").read_text())
    weight = [[p for p in line["params"] if p["name"] == "weight"][0] for line in lines]
    assert [line["step"] for line in lines] == [0, 1]
    assert [p["update_norm"] for p in weight] == pytest.approx(updates, rel=1e-6)


COMPILED_SCRIPT = """
import json, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
compiled = torch.compile(model, backend="eager")
losses = []
for step in range(3):
    loss = compiled(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
json.dump(losses, open(sys.argv[1], "w"))
"""


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches emptied before and after (compiled code of one test must not serve another)."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_watch_script_of_a_model_compiled_before_its_first_step(cli, tmp_path: Path, fresh_dynamo: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/watch.md: a script that compiles its model before the first step is watched under the
    model's own module names, and its losses are those of the same script run without hookcli."""
    import runpy

    (tmp_path / "train.py").write_text(COMPILED_SCRIPT)
    monkeypatch.chdir(tmp_path)
    result = cli("watch", "--every", "1", "--out", "run.jsonl", "--", "python", "train.py", "watched.json")
    assert result.exit_code == 0, result.stderr
    monkeypatch.setattr("sys.argv", ["train.py", "plain.json"])
    runpy.run_path("train.py", run_name="__main__")
    assert json.loads((tmp_path / "watched.json").read_text()) == json.loads((tmp_path / "plain.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [(x["name"], x["calls"], x["stats"]["count"]) for x in lines[1]["layers"]] == [
        ("0", 1, 64), ("1", 1, 64), ("2", 1, 8)]
    assert [p["name"] for p in lines[0]["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def _compiled_mlp() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    return model, torch.compile(model, backend="eager"), torch.optim.Adam(model.parameters(), lr=1e-2)


def test_watching_a_model_after_dynamo_compiled_its_code_unwatched_is_refused(fresh_dynamo: None) -> None:
    """A model compiled and trained a while, then watched (or a second model of the same classes,
    compiled anew: a notebook's next cell). Dynamo reused the graphs compiled without hooks (it does
    not guard on module hooks): no hook fired and every logged line had ``layers: []``, silently. It
    must be refused (as ``stats`` refuses it) at the first logged step; after ``torch.compiler.reset()``,
    as the hint says, the outputs are recorded, equal to plain torch's."""
    torch.manual_seed(0)
    _, compiled, optimizer = _compiled_mlp()
    for _ in range(2):
        compiled(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model, compiled, optimizer = _compiled_mlp()  # new modules, the same code: the same compiled graph
    with pytest.raises(UnsupportedError, match="no hook fired in the torch.compile'd model") as caught:
        with hookcli.watch(compiled, optimizer) as w:
            compiled(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
            w.step()
    assert "torch.compiler.reset()" in (caught.value.hint or "")
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks  # the watch took its hooks away
    torch.compiler.reset()
    outputs: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().double()))
    with hookcli.watch(compiled, optimizer) as w:
        compiled(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        w.step()
    assert w.last is not None
    (first,) = [layer for layer in w.last.layers if layer.name == "0"]
    assert first.stats["rms"] == pytest.approx(float(outputs[0].pow(2).mean().sqrt()), rel=1e-6)


def test_a_stale_compiled_graph_is_refused_at_the_blocks_end_when_the_optimizer_ends_the_steps(
        fresh_dynamo: None) -> None:
    """The same stale graph in a loop without ``w.step()`` (the optimizer's step ends each step): the
    refusal is found inside the optimizer's hook, so it is not raised there (the loop's optimizer steps
    all run, as unwatched) but at the block's end, as ``on_finding="raise"`` is; never turned into a
    WatchWarning, which would leave the user with an empty log and a passing run."""
    torch.manual_seed(0)
    _, compiled, optimizer = _compiled_mlp()
    for _ in range(2):
        compiled(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model, compiled, optimizer = _compiled_mlp()
    done = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", WatchWarning)
        with pytest.raises(UnsupportedError, match="no hook fired in the torch.compile'd model"):
            with hookcli.watch(compiled, optimizer):
                for step in range(3):
                    compiled(torch.randn(8, 4)).pow(2).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    done.append(step)
    assert done == [0, 1, 2]
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
