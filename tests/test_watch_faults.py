"""A monitor never takes down the run it watches: ``hookcli.watch`` and ``hookcli watch -- CMD`` under
faults found by a probe round. A full disk (a real 64 KiB tmpfs, a real file-size limit, /dev/full)
and a TensorBoard writer that fails stop the writing, said once, never the loop; hookcli's own failure
inside a hook stops the watch, said once; hooks never travel with copies (pickle, deepcopy); real
SIGTERM/SIGINT to a real process; a real FIFO; a real optimizer subclass; one-shot hookcli calls inside
a watched loop; a forward raising GeneratorExit, a forward changing its weights.

Every loop's numbers are compared with the same loop run unwatched, bit for bit; the logged numbers
against plain torch."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from hookcli.errors import WatchWarning
from timeouts import scaled_timeout

REPO = Path(__file__).resolve().parent.parent


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, w: Any = None,
          between: Callable[[int], None] | None = None) -> list[float]:
    """``steps`` seeded steps (dropout draws from the global RNG); ``between(step)`` after each."""
    torch.manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 4)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if w is not None:
            w.step(loss=loss)
        if between is not None:
            between(step)
        losses.append(loss.item())
    return losses


def unwatched(steps: int, make: Callable[[], nn.Module] = mlp) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make()
    losses = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), steps)
    return losses, model.state_dict()


def assert_same(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    for (name, a), b in zip(state.items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def watch_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(c.message) for c in caught if c.category is WatchWarning]


def whole_lines(path: Path) -> list[dict[str, Any]]:
    """The log's lines; it must end with a complete one."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.decode().splitlines()]


# -- 1. a full disk, a writer that fails: the loop goes on -----------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB file system (a tmpfs; mounting needs root: skipped elsewhere, where the file-size
    limit test below covers a full disk)."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, check=False)


@pytest.mark.parametrize("writer", ["out", "tensorboard_dir"])
def test_a_full_disk_stops_the_writing_not_the_loop(tiny_disk: Path, writer: str,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """400 steps, every one logged, on a 64 KiB disk: it fills up within the first hundred. The loop runs
    to its end with the unwatched run's losses and weights, the code after the with block runs, the log
    ends with its last whole line, the TensorBoard writer's thread prints no traceback, and one
    WatchWarning says what stopped, when and why."""
    want, state = unwatched(400)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = tiny_disk / ("exp.jsonl" if writer == "out" else "tb")
    after = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookcli.watch(model, opt, **{writer: target}) as w:
            got = train(model, opt, 400, w)
        after = True  # (the final checkpoint)
    assert after and got == want and w.last is not None and w.last.step == 399
    assert_same(state, model)
    (said,) = watch_warnings(caught)
    what = "its log" if writer == "out" else "TensorBoard scalars"
    assert f"stopped writing {what} at step " in said and "no space left on device" in said, said
    assert "Exception in thread" not in capfd.readouterr().err
    if writer == "out":
        lines = whole_lines(target)
        assert 0 < len(lines) < 400 and [line["step"] for line in lines] == list(range(len(lines)))
        assert lines[-1]["loss"] == pytest.approx(want[len(lines) - 1], rel=1e-6)
        assert f"at step {len(lines)}:" in said


def test_a_file_size_limit_leaves_whole_lines_and_the_loop_alone(tmp_path: Path) -> None:
    """A real RLIMIT_FSIZE of 20 KB in a process of its own (no root needed): the write that crosses it
    is cut back, the log ends with a whole line, and the loop ends with the unwatched run's loss."""
    script = textwrap.dedent(f"""
        import json, resource, signal, sys, warnings
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from test_watch_faults import mlp, train
        import torch, hookcli
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        model = mlp()
        want = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 60)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hookcli.watch(model, opt, out={str(tmp_path / 'exp.jsonl')!r}) as w:
                got = train(model, opt, 60, w)
        print(json.dumps([got == want, [str(c.message) for c in caught]]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            timeout=scaled_timeout(300), check=False)
    assert result.returncode == 0, result.stderr
    same, said = json.loads(result.stdout.splitlines()[-1])
    assert same
    assert len(said) == 1 and "the file is too large for this file system" in said[0], said
    lines = whole_lines(tmp_path / "exp.jsonl")
    assert 0 < len(lines) < 60 and (tmp_path / "exp.jsonl").stat().st_size <= 20000


@pytest.mark.parametrize("writer", ["out", "tensorboard_dir"])
def test_a_log_folder_removed_mid_run_is_said_not_raised(tmp_path: Path, writer: str) -> None:
    """The folder of the log (or of the TensorBoard scalars) is removed after step 3: the lines would go
    to a file no one can read. The loop runs its 8 steps with the unwatched run's numbers, and one
    WatchWarning says that writing stopped at step 4 and why."""
    import shutil

    want, state = unwatched(8)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    folder = tmp_path / "runs"
    target = folder / ("exp.jsonl" if writer == "out" else "tb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookcli.watch(model, opt, **{writer: target}) as w:
            got = train(model, opt, 8, w, between=lambda step: step == 3 and shutil.rmtree(folder))
    assert got == want and w.last.step == 7
    assert_same(state, model)
    (said,) = watch_warnings(caught)
    assert " at step 4: " in said and "removed during the run" in said, said


# -- 2. hookcli's own failure inside the loop ------------------------------------------------------------------


class Unreadable(torch.Tensor):
    """A tensor subclass hookcli does not know, whose ``detach`` raises (what hookcli's forward hook does
    first with an output): the model and the loss never detach, so only hookcli's statistics fail."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.Tensor.detach:
            raise RuntimeError("this output cannot be detached")
        return super().__torch_function__(func, types, args, kwargs or {})


class Odd(nn.Module):
    """fc, ReLU, head: from step ``at`` on fc's output is made an ``Unreadable`` after fc's hooks ran, so the
    head's output is one (its forwards counted)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head, self.at, self.calls = nn.Linear(4, 8), nn.Linear(8, 1), at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        if self.calls > self.at:
            h = h.as_subclass(Unreadable)
        return self.head(torch.relu(h)).as_subclass(torch.Tensor)


@pytest.mark.parametrize("call_step", [True, False], ids=["w.step", "optimizer-only"])
def test_a_hook_that_fails_stops_the_watch_not_the_loop(tmp_path: Path, call_step: bool) -> None:
    """From step 2 hookcli's forward hook cannot read an output: the loop runs its 6 steps with the
    unwatched run's losses and weights, no exception reaches it (w.step(), optimizer.step(), the with
    block's end), one WatchWarning names the step and what failed, and the log holds steps 0 and 1."""
    plain = Odd(at=2)
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 6)
    model = Odd(at=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "exp.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookcli.watch(model, opt, out=log) as w:
            got = train(model, opt, 6, w if call_step else None)
    assert got == want
    assert_same(plain.state_dict(), model)
    (said,) = watch_warnings(caught)
    assert said.startswith("hookcli.watch stopped at step 2: internal error: hookcli's forward hook on head raised "
                           "RuntimeError: this output cannot be detached"), said
    assert [line["step"] for line in whole_lines(log)] == [0, 1]
    assert not model.fc._forward_hooks and not model.fc._forward_pre_hooks


def test_a_failure_reading_a_closures_gradients_stops_the_watch_not_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hookcli's own failure when the closure handed to optimizer.step() returns (reading the gradients it
    left, at step 1): the closure's loss reaches the optimizer, the loop runs its 4 steps with the unwatched
    run's losses and weights, no exception reaches it, one WatchWarning says why, the log holds step 0."""
    from hookcli.engine.hooks import HookSet

    def run(watched: bool) -> tuple[list[float], nn.Module, list[str], Path]:
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses: list[float] = []
        log = tmp_path / f"{watched}.jsonl"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hookcli.watch(model, opt, out=log) if watched else contextlib.nullcontext() as w:
                torch.manual_seed(1)
                for _ in range(4):
                    x = torch.randn(32, 4)

                    def closure(x: torch.Tensor = x) -> torch.Tensor:
                        opt.zero_grad()
                        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                        loss.backward()
                        return loss

                    losses.append(float(opt.step(closure)))
                    if w is not None:
                        w.step()
        return losses, model, watch_warnings(caught), log

    want, plain, _, _ = run(False)
    reads = {"n": 0}
    original = HookSet.param_vectors

    def failing(self: HookSet, **kwargs: Any) -> Any:
        reads["n"] += 1
        if reads["n"] == 4:  # step 0: the pre-step's, the closure's; step 1: the pre-step's, then this
            raise RuntimeError("the gradients cannot be read")
        return original(self, **kwargs)

    monkeypatch.setattr(HookSet, "param_vectors", failing)
    got, model, said, log = run(True)
    assert got == want
    assert_same(plain.state_dict(), model)
    assert len(said) == 1 and said[0].startswith("hookcli.watch stopped at step 1: internal error: "), said
    assert "the gradients cannot be read" in said[0]
    assert [line["step"] for line in whole_lines(log)] == [0]


class Complex(nn.Module):
    """A complex weight (a unitary-style layer), a real loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.to(torch.cfloat) @ self.w).abs())


def test_complex_parameters_never_raise_into_the_loop() -> None:
    """A model with a complex parameter: the watched loop computes what the unwatched one does (the watch
    may not measure complex values: then it says so once), and nothing is raised."""
    plain = Complex()
    want = train(plain, torch.optim.SGD(plain.parameters(), lr=0.01), 4)
    model = Complex()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hookcli.watch(model, opt) as w:
            got = train(model, opt, 4, w)
    assert got == want
    assert_same(plain.state_dict(), model)
    assert len(watch_warnings(caught)) <= 1


def test_per_sample_gradients_inside_the_loop_are_left_out() -> None:
    """``vmap(grad(functional_call(...)))`` inside a watched loop (per-sample gradient norms, as DP-SGD
    clips them): its batched forwards are not the step's, so they are left out; the step's own forward is
    logged against plain torch, and the per-sample gradients are those of the unwatched loop."""
    from torch.func import functional_call, grad, vmap

    def run(watch: bool) -> tuple[list[torch.Tensor], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        norms, outs = [], []

        def sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((functional_call(model, params, (x.unsqueeze(0),)) - y) ** 2).sum()

        with hookcli.watch(model, opt) if watch else contextlib.nullcontext() as w:
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)
                params = {k: v.detach() for k, v in model.named_parameters()}
                per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
                norms.append(torch.stack([v.flatten(1).norm(dim=1) for v in per_sample.values()]))
                out = model[0](x)
                outs.append(out.detach())
                nn.functional.mse_loss(model[2](model[1](out)), y).backward()
                opt.step()
                opt.zero_grad()
                if w is not None:
                    w.step()
        return norms + outs, w

    want, _ = run(False)
    got, w = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    first = w.last.layers[0]
    assert (first.name, first.calls, first.shape) == ("0", 1, [5, 8])
    assert first.stats["mean"] == pytest.approx(float(want[-1].double().mean()), rel=1e-6)


# -- 3. hooks never travel with copies -------------------------------------------------------------------------


class Counter:
    """The user's own forward hook: picklable (a module-level class), it counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self.calls += 1


def test_a_watched_model_pickles_and_its_copies_carry_no_hook_of_hookcli(tmp_path: Path) -> None:
    """While a watch is on, ``torch.save(model)`` and ``torch.save(deepcopy(model).half())`` (a checkpoint
    each step) work and hold nothing of hookcli (they load where hookcli is not installed); an EMA made by
    ``copy.deepcopy(model)`` has no hook of hookcli's, its forwards are not counted, and it has none after
    the run; the user's own hook travels with every copy as torch copies it."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    mine = Counter()
    model.fc.register_forward_hook(mine)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 3, 32, 32)
    with hookcli.watch(model, opt, layers="conv1,fc") as w:
        ema = copy.deepcopy(model)
        for step in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                ema(torch.randn(3, 3, 32, 32))  # another batch size: its calls would show
            data = pickle.dumps(model)
            torch.save(copy.deepcopy(model).half(), tmp_path / f"ckpt{step}.pt")
            w.step()
    assert b"hookcli" not in data and b"hookcli" not in (tmp_path / "ckpt1.pt").read_bytes()
    assert [(layer.name, layer.calls, layer.shape[0]) for layer in w.last.layers] == [("conv1", 1, 2), ("fc", 1, 2)]
    loaded = pickle.loads(data)
    saved = torch.load(tmp_path / "ckpt1.pt", weights_only=False)
    for copied in (ema, loaded, saved):
        for name, module in copied.named_modules():
            assert not module._forward_pre_hooks, name
            assert [type(hook) for hook in module._forward_hooks.values()] == ([Counter] if name == "fc" else []), name
            assert not module._forward_hooks_with_kwargs and not module._forward_hooks_always_called, name
            assert "__getstate__" not in vars(module), name
    assert "__getstate__" not in vars(model.fc) and list(model.fc._forward_hooks.values()) == [mine]
    assert torch.equal(loaded.fc.weight, model.fc.weight)


# -- 4. SIGTERM and SIGINT under watch -- CMD ------------------------------------------------------------------

LOOPS = """\
import time

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 4)
step = 0
while True:
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if step == 3:
        print("ready", flush=True)
    time.sleep(0.005)
"""


def stopped(cwd: Path, command: list[str], sig: int) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a process of its own, send it ``sig`` once it has trained 3 steps."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        process.send_signal(sig)
        out, err = process.communicate(timeout=scaled_timeout(120))
    finally:
        process.kill()
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_watched_script_as_it_ends_python(tmp_path: Path, sig: int) -> None:
    """A real SIGTERM or SIGINT to ``hookcli watch -- python loops.py``: the exit status a shell sees of
    ``python loops.py`` (143, 130), no traceback of hookcli's (SIGINT: the script's KeyboardInterrupt
    traceback, as python prints it), a note, and a log of whole lines."""
    (tmp_path / "loops.py").write_text(LOOPS)
    plain = stopped(tmp_path, [sys.executable, "loops.py"], sig)
    assert plain.returncode == -sig
    result = stopped(tmp_path, [sys.executable, "-m", "hookcli", "watch", "--every", "1", "--out", "log.jsonl",
                                "--", "python", "loops.py"], sig)
    assert result.returncode == 128 + sig, result.stderr
    name = signal.Signals(sig).name
    assert f"hookcli watch: the script was stopped by {name} after " in result.stderr
    assert "hookcli/" not in result.stderr and "Terminated" not in result.stderr, result.stderr
    if sig == signal.SIGINT:
        assert plain.stderr.splitlines()[-1] == "KeyboardInterrupt"
        assert "Traceback (most recent call last):" in result.stderr and 'File "loops.py"' in result.stderr
        assert "\nKeyboardInterrupt\n" in result.stderr
    else:
        assert plain.stderr == "" and "Traceback" not in result.stderr
    steps = [line["step"] for line in whole_lines(tmp_path / "log.jsonl")]
    assert steps[:3] == [0, 1, 2] and steps == list(range(len(steps)))


#: The loop above, but a real SIGINT comes as hookcli's function ``sys.argv[1]`` (a qualified name) begins,
#: in its third step: a profile function (the script's own) sends it, at a moment no timing could pick.
LOOPS_INTERRUPTED_IN_HOOKCLI = """\
import os
import signal
import sys

import torch
from torch import nn


def interrupt_in_hookcli(frame, event, arg):
    if event == "call" and frame.f_code.co_qualname == sys.argv[1] and \\
            os.sep + "hookcli" + os.sep in frame.f_code.co_filename:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 4)
step = 0
while True:
    if step == 3:
        sys.setprofile(interrupt_in_hookcli)
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
"""


@pytest.mark.parametrize(("where", "logged"), [("StepWatcher._pre_step", 3), ("StepWatcher._post_step", 3),
                                               ("LineLog.write_line", 3), ("OutputStream.write", 4)])
def test_a_ctrl_c_inside_hookcli_s_step_code_shows_the_script_s_traceback_only(tmp_path: Path, where: str,
                                                                                logged: int) -> None:
    """SIGINT while the main thread runs hookcli's hooks (the watch's pre-step, its post-step, the log's
    line before it is written, and while it is written with SIGINT held: step 3's line is written whole
    first): exit 130, the script's KeyboardInterrupt traceback with hookcli's frames and those of what
    hookcli called left out (the script's and torch's kept), the note, and a log of whole lines."""
    (tmp_path / "loops.py").write_text(LOOPS_INTERRUPTED_IN_HOOKCLI)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "hookcli", "watch", "--every", "1", "--out", "log.jsonl", "--",
                             "python", "loops.py", where], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=scaled_timeout(120))
    assert result.returncode == 130, result.stderr
    assert "hookcli watch: the script was stopped by SIGINT after 3 steps" in result.stderr
    assert "hookcli/" not in result.stderr, result.stderr
    traceback_text = result.stderr[result.stderr.index("Traceback (most recent call last):"):]
    line = LOOPS_INTERRUPTED_IN_HOOKCLI.splitlines().index("    optimizer.step()") + 1
    assert traceback_text.splitlines()[1:3] == [f'  File "loops.py", line {line}, in <module>', "    optimizer.step()"]
    assert "torch/optim/optimizer.py" in traceback_text and "\nKeyboardInterrupt\n" in traceback_text
    assert "contextlib.py" not in traceback_text and "signal.py" not in traceback_text, traceback_text
    assert [line["step"] for line in whole_lines(tmp_path / "log.jsonl")] == list(range(logged))


# -- 5. a log that cannot seek ---------------------------------------------------------------------------------


def test_the_log_streams_into_a_fifo(tmp_path: Path) -> None:
    """``out=`` a real named pipe, read by another thread: every line arrives whole, as the records are."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    records = []
    with hookcli.watch(model, opt, out=fifo, every=2) as w:
        train(model, opt, 5, w, between=lambda _s: records.append(w.last))
    reader.join(timeout=scaled_timeout(60))
    lines = got[0].decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 2, 4]
    logged = {r.step: r.to_json_line().rstrip("\n") for r in records}  # w.last after each step
    assert lines == [logged[0], logged[2], logged[4]]


def test_the_log_streams_to_dev_stdout_through_a_pipe(tmp_path: Path) -> None:
    """``hookcli watch --out /dev/stdout -- python train.py`` with stdout a real pipe: the log's lines
    reach the reader among the script's output, and the script's exit code is kept."""
    train_py = REPO / "tests" / "watch_train.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "hookcli", "watch", "--every", "2", "--out", "/dev/stdout", "--",
                             "python", str(train_py), "--steps", "5"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=scaled_timeout(300), check=False)
    assert result.returncode == 0, result.stderr
    logged = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["step"] for line in logged] == [0, 2, 4]
    assert result.stdout.splitlines()[-1].startswith("trained 5 steps")


# -- 6. an optimizer subclass calling super().step() ------------------------------------------------------------


class Inner(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        return super().step(closure)


class Outer(Inner):
    """Two classes deep: SGD.step, Inner.step and Outer.step each run torch's step hooks. The first
    step raises after SGD stepped (``fail``): its hooks' post-step never runs."""

    fail = False

    def step(self, closure: Any = None) -> Any:  # noqa: D102
        out = super().step(closure)
        if self.fail:
            self.fail = False
            raise RuntimeError("the subclass's own failure")
        return out


def subclass_run(log: Path, make: Callable[..., torch.optim.Optimizer], fail_at: int | None = None
                 ) -> tuple[list[dict[str, Any]], list[float]]:
    """4 steps ended by optimizer.step() alone, every one logged: the log's lines and each step's change of
    the first weight in plain torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = make(model.parameters(), lr=0.1)
    updates = []
    with hookcli.watch(model, opt, out=log):
        for step in range(4):
            before = model[0].weight.detach().clone()
            nn.functional.mse_loss(model(torch.full((4, 4), float(step))), torch.ones(4, 1)).backward()
            opt.fail = step == fail_at
            with pytest.raises(RuntimeError, match="subclass") if step == fail_at else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
            updates.append(float((model[0].weight.detach() - before).double().norm()))
    return whole_lines(log), updates


def test_an_optimizer_subclass_step_is_one_step(tmp_path: Path) -> None:
    """An optimizer two subclasses deep (each ``step`` calls ``super().step()``, so torch runs the step
    hooks three times a step): one step each, the log the very one of plain SGD, each update the
    weight's change around its step in plain torch."""
    lines, updates = subclass_run(tmp_path / "outer.jsonl", Outer)
    plain, plain_updates = subclass_run(tmp_path / "plain.jsonl", torch.optim.SGD)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines == plain and updates == plain_updates
    for line, update in zip(lines, updates):
        assert line["params"][0]["update_norm"] == pytest.approx(update, rel=1e-5)


def test_a_subclass_step_that_raised_leaves_the_next_steps_counted_once(tmp_path: Path) -> None:
    """The second step raises inside the chain after the weights changed (its post-step hooks never run,
    as for any optimizer.step() that raises): the steps after it are counted once each, and the last
    line's update is the last step's."""
    lines, updates = subclass_run(tmp_path / "log.jsonl", Outer, fail_at=1)
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[-1]["params"][0]["update_norm"] == pytest.approx(updates[3], rel=1e-5)


# -- 7. one-shot hookcli calls inside a watched loop ------------------------------------------------------------


@pytest.mark.parametrize("call", ["stats(train=True)", "grads", "check"])
def test_hookcli_calls_inside_a_watched_loop_are_not_training(call: str) -> None:
    """``hookcli.stats``/``grads``/``check`` on the watched model inside the loop: the step logs its
    training forward alone (1 call, its batch, its values in float64) and the gradients of its own
    backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    other = torch.randn(7, 4)
    with hookcli.watch(model, opt) as w:
        out = model[0](x)
        model[2](model[1](out)).pow(2).mean().backward()
        if call == "grads":
            hookcli.grads(model, inputs=other, loss="mean")
        elif call == "check":
            hookcli.check(model, inputs=other)
        else:
            hookcli.stats(model, inputs=other, train=True)
        want_grad = model[0].weight.grad.detach().double().clone()
        opt.step()
        w.step()
    first = w.last.layers[0]
    assert [(layer.calls, layer.shape[0]) for layer in w.last.layers] == [(1, 6)] * 3
    assert first.stats["mean"] == pytest.approx(float(out.detach().double().mean()), rel=1e-6)
    grad = w.last.params[0].grad
    assert grad["rms"] == pytest.approx(float(want_grad.pow(2).mean().sqrt()), rel=1e-6)


# -- 8. GeneratorExit from forward; a forward that changes its weights -------------------------------------------

MODELS = """\
import torch
from torch import nn


class Closes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        raise GeneratorExit("closed by the model")


class Drifts(nn.Module):
    \"\"\"Each forward nudges its weight in place, as a buggy weight normalisation would.\"\"\"

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.add_(1.0)
        self.fc.bias.data.mul_(2.0)
        return self.fc(x)
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / "faulty.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    sys.modules.pop("faulty", None)
    return importlib.import_module("faulty")


def test_a_forward_raising_generator_exit_is_the_models_failure(cli, models: Any) -> None:
    result = cli("stats", "faulty.py:Closes", "--input-shape", "2x4")
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: the model raised in forward at (model) (Closes) with input shape(s) 2x4: "
                      "GeneratorExit: closed by the model"], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("call", ["stats", "shapes", "grads", "check", "features", "diff"])
def test_a_forward_that_changes_its_weights_leaves_the_users_alone(models: Any, call: str) -> None:
    model = models.Drifts()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs: dict[str, Any] = {"inputs": torch.randn(2, 4)}
    if call == "diff":
        kwargs["vs_dtype"] = "float64"
    with contextlib.suppress(hookcli.HookcliError):  # check may fail its rules: the weights are the point
        getattr(hookcli, call)(model, **kwargs)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    x = torch.randn(3, 4)
    assert torch.equal(model.fc.weight, before["fc.weight"])
    with torch.no_grad():
        model(x)
    assert torch.equal(model.fc.weight, before["fc.weight"] + 1)  # the model still does what it did


def test_pickling_loads_without_hookcli(tmp_path: Path) -> None:
    """The pickle of a watched model loads in a process where hookcli cannot be imported."""
    model = mlp()
    with hookcli.watch(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
    (tmp_path / "m.pt").write_bytes(buffer.getvalue())
    script = ("import sys; sys.modules['hookcli'] = None\n"
              f"import torch; m = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
              "print(sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules()))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=scaled_timeout(120), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
