"""``hookcli watch`` from the command line: ``watch -- CMD`` runs a real training script (written to
tmp_path) in-process and unchanged, its log checked against plain torch (``torch.autograd.grad``); the
script's exit status passed through, sys.argv / sys.path / ``__main__`` put back, no hook left on the
script's model, its optimizer or process-wide; ``watch MODEL --steps N`` on a tiny model; the
``[watch]`` config table; bad usage one line and exit 2."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

import hookcli
from hookcli.errors import UsageError
from torchrun_launch import torchrun_env

#: A training script as a user writes it: argparse, a seeded model, SGD, plain optimizer.step() and
#: zero_grad(), no hookcli. It keeps what the test reads in ``probe`` (a module beside it).
TRAIN = '''\
import argparse
import sys

import torch
from torch import nn

import probe

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--freeze", action="store_true", help="the bug: the head is not in the optimizer")
parser.add_argument("--exit", type=int, default=None)
parser.add_argument("--boom", action="store_true")
parser.add_argument("--validate", action="store_true", help="a validation forward every 2 steps")
args = parser.parse_args()
probe.argv, probe.path0, probe.name = list(sys.argv), sys.path[0], __name__

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model[0].parameters() if args.freeze else model.parameters(), lr=args.lr)
probe.model, probe.optimizer = model, optimizer
x = torch.linspace(-1, 1, 32 * 4).reshape(32, 4)
y = x.sum(1, keepdim=True)
for _step in range(args.steps):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if args.validate and _step % 2 == 0:
        model.eval()
        with torch.no_grad():
            probe.val_loss = nn.functional.mse_loss(model(x[:7] * 2), y[:7] * 2).item()
        model.train()
probe.loss = loss.item()
print(f"trained {args.steps} steps")
if args.boom:
    raise ValueError("boom at the end")
if args.exit is not None:
    sys.exit(args.exit)
'''


def reference_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def reference_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1, 1, 32 * 4).reshape(32, 4)
    return x, x.sum(1, keepdim=True)


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    """train.py and its probe module in tmp_path; the probe is forgotten after the test."""
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "probe.py").write_text("")
    sys.modules.pop("probe", None)
    yield tmp_path / "train.py"
    sys.modules.pop("probe", None)


def probe() -> ModuleType:
    return sys.modules["probe"]


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def global_hooks() -> list[int]:
    return [len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks),
            len(torch_module._global_forward_hooks_always_called),
            len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks)]


def test_a_script_trained_under_watch_is_logged_as_plain_torch_computes_it(cli, script: Path, tmp_path: Path) -> None:
    log = tmp_path / "runs" / "exp.jsonl"
    result = cli("watch", "--every", "2", "--out", log, "--", "python", script, "--lr", "0.1", "--steps", "5")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "trained 5 steps\n"  # the script's own output, and nothing of hookcli's
    assert "hookcli watch: watching Sequential (49 parameters) stepped by SGD" in result.stderr
    assert "5 steps, 3 logged to" in result.stderr
    lines = read_log(log)
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert lines[0]["layers"] == []  # step 0 is seen from its optimizer.step() on
    assert [layer["name"] for layer in lines[1]["layers"]] == ["0", "1", "2"]
    assert [p["name"] for p in lines[1]["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]

    # plain torch: SGD by hand with torch.autograd.grad, in float64
    model = reference_model().double()
    x, y = (t.double() for t in reference_data())
    params = list(model.parameters())
    update0 = output2 = grad2 = None
    for step in range(3):
        if step == 2:
            with torch.no_grad():
                output2 = model[0](x)
        grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
        if step == 0:
            update0 = 0.1 * grads[0].norm()
        if step == 2:
            grad2 = grads[0]
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= 0.1 * g
    assert output2 is not None and grad2 is not None and update0 is not None
    assert lines[0]["params"][0]["update_norm"] == pytest.approx(update0.item(), rel=1e-5)
    layer0 = lines[1]["layers"][0]
    assert layer0["stats"]["count"] == 32 * 8
    assert layer0["stats"]["mean"] == pytest.approx(output2.mean().item(), rel=1e-4, abs=1e-6)
    assert lines[1]["params"][0]["grad"]["rms"] == pytest.approx(grad2.pow(2).mean().sqrt().item(), rel=1e-4)


def test_a_script_that_validates_logs_what_it_logs_without(cli, script: Path, tmp_path: Path) -> None:
    """``hookcli watch -- script``: a validation forward every 2 steps (eval mode, no_grad) adds nothing to
    the log (the same lines as without it) and changes nothing in the run (the same final loss)."""
    logs, losses = [], []
    for flags in ([], ["--validate"]):
        log = tmp_path / f"exp{len(flags)}.jsonl"
        result = cli("watch", "--every", "1", "--out", log, "--", "python", script, "--steps", "5", *flags)
        assert result.exit_code == 0, result.stderr
        assert result.stdout == "trained 5 steps\n"
        logs.append(read_log(log))
        losses.append(probe().loss)
    assert [line["step"] for line in logs[0]] == [0, 1, 2, 3, 4]
    assert [layer["calls"] for layer in logs[0][2]["layers"]] == [1, 1, 1]
    assert logs[1] == logs[0] and losses[1] == losses[0]


def test_argv_path_and_main_are_set_as_python_sets_them_and_put_back(cli, script: Path, tmp_path: Path) -> None:
    argv, path, main = sys.argv, list(sys.path), sys.modules["__main__"]
    result = cli("watch", "--every", "1", "--", "python", script, "--steps", "2")
    assert result.exit_code == 0, result.stderr
    assert probe().argv == [str(script), "--steps", "2"]
    assert probe().path0 == str(tmp_path)
    assert probe().name == "__main__"
    assert sys.argv is argv and sys.path == path and sys.modules["__main__"] is main


def test_the_scripts_numbers_are_the_same_with_and_without_the_watch(cli, script: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import runpy

    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "4"])
    monkeypatch.syspath_prepend(str(script.parent))
    runpy.run_path(str(script), run_name="__main__")  # the script alone, as python runs it
    alone, probe().loss = probe().loss, None
    result = cli("watch", "--every", "1", "--", "python", script, "--steps", "4")
    assert result.exit_code == 0, result.stderr
    assert probe().loss == alone  # bit for bit


def test_no_hook_is_left_on_the_model_the_optimizer_or_the_process(cli, script: Path) -> None:
    before = global_hooks()
    result = cli("watch", "--every", "1", "--", script, "--steps", "3")  # SCRIPT.py without python
    assert result.exit_code == 0, result.stderr
    model, optimizer = probe().model, probe().optimizer
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None) and not p._backward_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert global_hooks() == before == [0, 0, 0, 0, 0]


def test_a_frozen_layer_shows_its_finding_on_stderr_and_the_exit_code_stays_the_scripts(cli, script: Path) -> None:
    result = cli("watch", "--every", "1", "--", "python", script, "--freeze", "--steps", "5")
    assert result.exit_code == 0
    assert result.stdout == "trained 5 steps\n"
    lines = [line for line in result.stderr.splitlines() if "frozen" in line]
    assert lines == ["hookcli watch: step 2: warning frozen (2.weight): 2.weight requires grad but did not change in "
                     "3 logged steps (it has a gradient: not in the optimizer? a learning rate of 0?)",
                     "hookcli watch: step 2: warning frozen (2.bias): 2.bias requires grad but did not change in "
                     "3 logged steps (it has a gradient: not in the optimizer? a learning rate of 0?)"]
    assert result.stderr.splitlines()[-1].endswith("5 steps, 5 logged (no --out: no log written); 2 findings")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(code=st.integers(0, 255))
def test_the_scripts_exit_status_is_passed_through(cli, tmp_path: Path, code: int) -> None:
    exits = tmp_path / "exits.py"
    exits.write_text(f"import sys\nprint('bye')\nsys.exit({code})\n")
    result = cli("watch", "--every", "1", "--", "python", exits)
    assert result.exit_code == code
    assert result.stdout == "bye\n"
    assert result.stderr == "hookcli watch: nothing was watched: the script never called optimizer.step()\n"


def test_an_optimizer_over_no_module_the_script_called_is_said_at_the_end(cli, tmp_path: Path) -> None:
    (tmp_path / "raw.py").write_text("import torch\nw = torch.zeros(3, requires_grad=True)\n"
                                     "opt = torch.optim.SGD([w], lr=0.1)\n(w - 1).pow(2).sum().backward()\nopt.step()\n"
                                     "raise SystemExit('done')\n")
    result = cli("watch", "--", "python", tmp_path / "raw.py")
    assert result.exit_code == 1  # sys.exit with a message: printed, status 1, as python does
    assert result.stdout == ""
    assert result.stderr == ("done\nhookcli watch: nothing was watched: no module the script called holds the "
                             "parameters of its SGD\n")


def test_an_uncaught_exception_in_the_script_is_its_traceback_and_exit_1(cli, script: Path) -> None:
    result = cli("watch", "--every", "1", "--", "python", script, "--steps", "2", "--boom")
    assert result.exit_code == 1
    assert result.stdout == "trained 2 steps\n"
    trace = result.stderr[result.stderr.index("Traceback (most recent call last):"):]
    assert f'File "{script}", line ' in trace and trace.splitlines()[-2] == "ValueError: boom at the end"
    assert trace.splitlines()[-1].startswith("hookcli watch: Sequential, SGD: 2 steps")
    frames = "\n".join(trace.splitlines()[:-1])
    assert "runpy" not in frames and "hookcli" not in frames
    assert not any(line.startswith("Error:") for line in result.stderr.splitlines())


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_rank_0_alone_says_the_watchs_lines_and_every_rank_its_traceback(
        cli, script: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """Under torchrun every rank runs the script: hookcli's lines (the model found, findings, the
    summary) are said once, by rank 0; the script's own output and traceback stay every rank's."""
    torchrun_env(monkeypatch, rank)
    result = cli("watch", "--every", "1", "--", "python", script, "--steps", "3", "--freeze", "--boom")
    assert result.exit_code == 1
    assert result.stdout == "trained 3 steps\n"
    ours = [line for line in result.stderr.splitlines() if line.startswith("hookcli watch:")]
    if rank == 0:
        assert any("watching Sequential" in line for line in ours)
        assert any("warning frozen (2.weight)" in line for line in ours)
        assert ours[-1].startswith("hookcli watch: Sequential, SGD: 3 steps")
    else:
        assert ours == []
    assert result.stderr.splitlines()[-1 if rank else -2] == "ValueError: boom at the end"


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_without_a_process_group_rank_0_alone_writes_the_log(
        cli, script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """A script under torchrun that makes no process group: every rank is its own run, so one --out
    written by all of them would interleave their lines (each step twice). Rank 0 writes its own run's
    log and says so; the others write none. The log's numbers are plain torch's run of that script."""
    torchrun_env(monkeypatch, rank)
    log = tmp_path / "log.jsonl"
    result = cli("watch", "--every", "1", "--out", log, "--", "python", script, "--lr", "0.1", "--steps", "3")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "trained 3 steps\n"
    if rank == 1:
        assert not log.exists() and result.stderr == ""
        return
    assert "the log is rank 0's own run" in result.stderr
    lines = read_log(log)
    assert [line["step"] for line in lines] == [0, 1, 2]
    model = reference_model().double()
    x, y = (t.double() for t in reference_data())
    grad = torch.autograd.grad(nn.functional.mse_loss(model(x), y), [model[0].weight])[0]
    first = {p["name"]: p for p in lines[0]["params"]}
    assert first["0.weight"]["update_norm"] == pytest.approx(0.1 * grad.norm().item(), rel=1e-5)  # SGD's step 0


def test_sys_exit_3_in_a_training_script_exits_3(cli, script: Path) -> None:
    result = cli("watch", "--every", "1", "--", "python", script, "--steps", "2", "--exit", "3")
    assert result.exit_code == 3
    assert "2 steps, 2 logged" in result.stderr


def test_python_dash_m_runs_a_module_as_main(cli, script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "m.jsonl"
    result = cli("watch", "--every", "1", "--out", log, "--", "python", "-m", "trainpkg.train", "--steps", "3")
    assert result.exit_code == 0, result.stderr
    assert probe().name == "__main__"
    assert probe().argv == [str(package / "train.py"), "--steps", "3"]
    assert [line["step"] for line in read_log(log)] == [0, 1, 2]
    sys.modules.pop("trainpkg.train", None)
    sys.modules.pop("trainpkg", None)


@pytest.mark.parametrize(("args", "message"), [
    ([], "Error: watch --: no command after --"),
    (["python"], "Error: watch -- python: no script or -m MODULE after python"),
    (["python", "missing.py"], "Error: watch --: the script missing.py does not exist"),
    (["-m"], "Error: watch -- -m: no module named after -m"),
    (["python", "-m", "no_such_module_here"], "Error: watch -- -m: no module named 'no_such_module_here'"),
    (["torchrun", "train.py"], "Error: watch -- runs a Python script in hookcli's own process, not 'torchrun'"),
    (["python", "-u", "train.py"], "Error: watch --: python's own option '-u' is not taken"),
])
def test_bad_commands_are_one_line_and_exit_2(cli, args: list[str], message: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli("watch", "--", *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[1].startswith("  hint: ") and "Traceback" not in result.stderr
    assert lines[0].startswith(message.replace("no module named after", "no module name after"))


@pytest.mark.parametrize(("args", "message"), [
    (["watch"], "Error: watch needs -- CMD (your training script) or MODEL --steps N"),
    (["watch", "tiny_models:Scaled"], "Error: watch MODEL needs --steps N"),
    (["watch", "tiny_models:Scaled", "--steps", "0"], "Error: Invalid value for '--steps'"),
    (["watch", "--every", "0", "--", "python", "x.py"], "Error: Invalid value for '--every'"),
    (["watch", "--steps", "3", "--", "python", "x.py"], "Error: watch -- CMD does not take --steps"),
    (["watch", "tiny_models:Scaled", "--", "python", "x.py"], "Error: watch -- CMD does not take MODEL"),
])
def test_bad_usage_is_one_line_and_exit_2(cli, args: list[str], message: str) -> None:
    result = cli(*args)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(message) and lines[1].startswith("  hint: ")


def test_a_bad_layer_for_the_model_found_stops_the_script_at_its_first_step(cli, script: Path) -> None:
    result = cli("watch", "--layers", "nope", "--", "python", script, "--steps", "3")
    assert result.exit_code == 2
    assert result.stdout == ""  # the script did not finish
    assert result.stderr.splitlines()[-2].startswith("Error: no module named 'nope'")


def test_watch_model_steps_trains_a_tiny_model_and_logs_it(cli, tmp_path: Path) -> None:
    log = tmp_path / "tiny.jsonl"
    result = cli("watch", "tiny_models:Scaled", "--steps", "4", "--every", "2", "--lr", "0.1", "--input-shape",
                 "4x4", "--out", log)
    assert result.exit_code == 0, result.stderr
    assert " ".join(result.stdout.split()).startswith(f"watch: tiny_models:Scaled, SGD: 4 steps, 2 logged to {log}; "
                                                      "0 findings")
    assert result.stdout.rstrip().endswith("PASSED")
    lines = read_log(log)
    assert [line["step"] for line in lines] == [0, 2]
    assert all(line["loss"] is not None for line in lines) and lines[0]["layers"]


def test_watch_model_steps_in_eval_mode_is_training_and_logged(cli, tmp_path: Path) -> None:
    """``--eval`` trains in eval mode with autograd on: that is training, not validation; every call logged."""
    log = tmp_path / "eval.jsonl"
    result = cli("watch", "tiny_models:Scaled", "--steps", "2", "--eval", "--input-shape", "4x4", "--out", log)
    assert result.exit_code == 0, result.stderr
    lines = read_log(log)
    assert [line["step"] for line in lines] == [0, 1]
    assert all(line["layers"] and all(layer["calls"] == 1 for layer in line["layers"]) for line in lines)


def test_watch_model_with_a_nan_exits_1_with_the_finding(cli) -> None:
    result = cli("watch", "tiny_models:MakesNaN", "--steps", "2", "--input-shape", "4x4", "-f", "json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [(f["rule"], f["severity"], f["step"]) for f in report["findings"]] == [("nonfinite", "error", 0)]
    assert result.stderr.startswith("Error: watch: step 0: error nonfinite")


def test_watch_model_from_python_trains_a_copy_and_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = hookcli.watch_model(model, steps=3, optimizer="adam", input_shapes=["4x4"])
    assert (run.model, run.optimizer, run.steps, run.findings) == ("Sequential", "Adam", 3, [])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


_NET = nn.Linear(4, 3)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"optimizer": torch.optim.Adam(_NET.parameters())}, "makes its own optimizer: give its name, got a Adam"),
    ({"optimizer": ["adam"]}, "unknown optimizer ['adam']"),
    ({"out": 123}, "out must be a path"),
])
def test_watch_model_bad_arguments_are_one_line_usage_errors(kwargs: dict[str, Any], words: str) -> None:
    """An optimizer object (its multi-line repr was the message), a list (TypeError: unhashable) and an
    out= that is not a path (TypeError) are UsageErrors of one line with a hint; nothing is trained."""
    before = _NET.weight.detach().clone()
    with pytest.raises(UsageError) as info:
        hookcli.watch_model(_NET, steps=2, input_shapes=["4x4"], **kwargs)
    assert words in info.value.message and "\n" not in info.value.message and info.value.hint
    assert info.value.exit_code == 2 and torch.equal(_NET.weight, before)


def test_watch_model_copies_a_spectral_norm_critic_after_a_training_forward() -> None:
    """spectral_norm keeps its ``weight`` as a tensor computed with autograd, which copy.deepcopy refuses
    (the watch said "cannot be deep-copied", exit 2); the copy is trained, the model left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 8)), nn.LeakyReLU(0.2), nn.Linear(8, 3))
    model(torch.randn(2, 4)).sum()  # the user's own forward: the weight is no graph leaf now
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = hookcli.watch_model(model, steps=2, optimizer="adam", input_shapes=["4x4"])
    assert (run.model, run.steps, run.findings) == ("Sequential", 2, [])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_watch_table_of_a_config_sets_every_out_and_rules(cli, script: Path, tmp_path: Path) -> None:
    config = tmp_path / "hookcli.toml"
    config.write_text('[watch]\nevery = 2\nout = "runs/cfg.jsonl"\n[watch.rules.frozen]\nsteps = 2\n')
    result = cli("watch", "--config", config, "--", "python", script, "--freeze", "--steps", "6")
    assert result.exit_code == 0, result.stderr
    lines = read_log(tmp_path / "runs" / "cfg.jsonl")
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert "step 2: warning frozen (2.weight)" in result.stderr  # 2 logged steps in a row, not 3


@pytest.mark.parametrize(("toml", "message"), [
    ('[watch]\nout = "../outside.jsonl"\n', "key 'watch.out' names"),
    ('[watch]\nevry = 2\n', "unknown key 'evry' in [watch]"),
    ('[watch.rules.frozen]\nstep = 2\n', "[watch] rules: 'frozen' has no key 'step'"),
])
def test_a_bad_watch_table_is_exit_2_naming_the_file(cli, tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "sub" / "hookcli.toml"
    config.parent.mkdir()
    config.write_text(toml)
    result = cli("watch", "--config", config, "--", "python", "x.py")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {config}") and message in result.stderr.splitlines()[0]


GAN = '''\
import torch
from torch import nn

torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
discriminator = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
criterion = nn.BCEWithLogitsLoss()  # a module the script calls, with no parameters
g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3)
d_opt = torch.optim.SGD(discriminator.parameters(), lr=1e-2)
for _step in range(3):
    fake = generator(torch.randn(16, 2))
    d_loss = criterion(discriminator(fake.detach()), torch.zeros(16, 1))
    d_loss.backward()
    d_opt.step()
    d_opt.zero_grad()
    g_loss = criterion(discriminator(fake), torch.ones(16, 1))
    g_loss.backward()
    g_opt.step()
    g_opt.zero_grad()
'''


def test_two_models_and_two_optimizers_the_first_stepped_is_watched_and_the_other_named(cli, tmp_path: Path) -> None:
    (tmp_path / "gan.py").write_text(GAN)
    log = tmp_path / "gan.jsonl"
    result = cli("watch", "--every", "1", "--out", log, "--", "python", tmp_path / "gan.py")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[:2] == [
        "hookcli watch: watching Sequential (49 parameters) stepped by SGD, from step 0's optimizer.step()",
        "hookcli watch: another optimizer (Adam) steps too; only the first (SGD) is watched"]
    lines = read_log(log)
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [p["shape"] for p in lines[1]["params"]] == [[8, 4], [8], [1, 8], [1]]  # the discriminator's
    # the discriminator is called twice a step (on fake.detach() and on fake): its calls merged
    assert [layer["calls"] for layer in lines[1]["layers"]] == [2, 2, 2]


def test_watch_model_takes_one_batch_of_data_per_step(cli, tmp_path: Path) -> None:
    data = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 40
    torch.save(data, tmp_path / "data.pt")
    log = tmp_path / "data.jsonl"
    result = cli("watch", "tiny_models:Scaled", "--steps", "5", "--data", tmp_path / "data.pt", "--batch-size", "4",
                 "--out", log, "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["steps"] == 3 and "the data set ended after 3 batches: 3 steps, not 5" in report["notes"]
    assert [line["layers"][0]["shape"][0] for line in read_log(log)] == [4, 4, 2]


def test_watch_model_whose_forward_raises_exits_1_naming_the_step_and_module(cli) -> None:
    result = cli("watch", "tiny_models:Raises", "--steps", "2")
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: step 0: the model raised in forward at bad (CheckedLinear)")


def test_watch_model_runs_one_hook_set_for_the_whole_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``watch MODEL --steps N`` installs the watch's hook set once and its run loop hooks nothing of its
    own: no one-shot hook set inside the watch at every step; every step is still logged with its rows."""
    from hookcli.engine.hooks import HookSet

    installs: list[int] = []
    install = HookSet.install

    def counted(self: HookSet, *args: Any, **kwargs: Any) -> HookSet:
        installs.append(len(args[1]))  # (how many modules it hooks)
        return install(self, *args, **kwargs)

    monkeypatch.setattr(HookSet, "install", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    run = hookcli.watch_model(model, steps=4, input_shapes=["4x4"], out=tmp_path / "log.jsonl")
    assert run.steps == 4 and len(installs) == 1 and installs[0] > 0
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "layers" in line]
    assert [line["step"] for line in steps] == [0, 1, 2, 3] and all(line["layers"] for line in steps)
