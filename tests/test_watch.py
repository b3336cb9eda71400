"""``hookcli.watch`` over the user's own training loop: every number of a logged step against plain
torch in float64 (the test's own forward hooks, ``torch.autograd.grad``, the parameters before and after
``optimizer.step``), what a step is (optimizer.step, w.step, both, neither optimizer), unlogged steps
idle, a watched run bit for bit the unwatched one with the RNG untouched, nothing left hooked, and the
log: one complete JSON line per logged step that survives a crash and that pandas reads."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as torch_module

import hookcli
from hookcli.errors import OutputError, UsageError, WatchWarning
from hookcli.records import WATCH_STAT_KEYS


class Net(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> a Linear called twice (a reused module) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.3)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.bn(self.fc1(x))))
        return self.head(torch.tanh(self.shared(self.shared(h))))


def batches(step: int, micro: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's micro-batches, from a generator of their own (the global RNG is the loop's)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(5 + m, 6, generator=g), torch.randn(5 + m, 2, generator=g)) for m in range(micro)]


def reference(values: list[torch.Tensor]) -> dict[str, float]:
    """The logged statistics of the values of all ``values`` together, in float64 with plain torch."""
    d = torch.cat([v.detach().reshape(-1).double() for v in values])
    m = d - d.mean()
    return {"mean": float(d.mean()), "std": float(d.std(correction=0)), "rms": float(d.pow(2).mean().sqrt()),
            "min": float(d.min()), "max": float(d.max()), "abs_max": float(d.abs().max()),
            "zero_fraction": float((d == 0).sum()) / d.numel(), "nan_count": 0, "inf_count": 0,
            "kurtosis": float(d.numel() * m.pow(4).sum() / m.pow(2).sum() ** 2), "count": d.numel()}


def assert_stats(logged: dict[str, Any], values: list[torch.Tensor]) -> None:
    want = reference(values)
    assert tuple(logged) == WATCH_STAT_KEYS
    scale = want["rms"]
    for key in ("count", "nan_count", "inf_count", "zero_fraction"):
        assert logged[key] == want[key], key
    for key in ("mean", "std", "rms", "min", "max", "abs_max"):
        assert logged[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9 * scale), key
    assert logged["kurtosis"] == pytest.approx(want["kurtosis"], rel=1e-5, nan_ok=True), "kurtosis"


def read_log(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def no_hooks_left(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    for name, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, name
        assert not module._forward_hooks_with_kwargs and not module._forward_hooks_always_called, name
    for name, p in model.named_parameters():
        assert not p._post_accumulate_grad_hooks and not p._backward_hooks, name
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks


# -- every number against plain torch ----------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["kernel", "torch reductions"])
def test_a_logged_step_equals_plain_torch(tmp_path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two accumulation micro-batches and a module called twice in each: the log's entry per (module,
    output) holds all four calls merged; gradients w.r.t. outputs from torch.autograd.grad; parameters'
    .grad before optimizer.step, their norms before it and their updates from the weights around it.
    Step 1 is checked (Adam's state is not fresh there); the reference runs on a copy, same RNG. Both CPU
    statistics paths: the C kernel and HOOKCLI_NO_KERNEL=1."""
    from hookcli.engine.kernel import NO_KERNEL_ENV
    from hookcli.engine.stats import _fastreduce

    if kernel == "kernel" and _fastreduce is None:
        pytest.skip("hookcli.engine._fastreduce was not built here")
    monkeypatch.setenv(NO_KERNEL_ENV, "0" if kernel == "kernel" else "1")
    torch.manual_seed(0)
    model = Net().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    names = ["fc1", "bn", "act", "shared", "head"]  # the default: owners of parameters and activations
    rng = torch.get_rng_state()
    for step in range(2):
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        handles = [getattr(ref, n).register_forward_hook(lambda _m, _i, out, n=n, seen=seen: seen[n].append(out))
                   for n in names]
        grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for x, y in batches(step, micro=2):
            count = {n: len(v) for n, v in seen.items()}
            ref_loss = (ref(x) - y).pow(2).mean() / 2
            new = [(n, out) for n in names for out in seen[n][count[n]:]]
            for (n, _), g in zip(new, torch.autograd.grad(ref_loss, [o for _, o in new], retain_graph=True)):
                grads[n].append(g)
            ref_loss.backward()
        for h in handles:
            h.remove()
        before = {n: p.detach().clone() for n, p in ref.named_parameters()}
        pgrads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()

    torch.set_rng_state(rng)  # the same dropout masks in the watched run
    log = tmp_path / "log.jsonl"
    with hookcli.watch(model, opt, out=log) as w:
        for step in range(2):
            for x, y in batches(step, micro=2):
                loss = (model(x) - y).pow(2).mean() / 2
                loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)

    line = read_log(log)[-1]
    assert line["schema"] == 1 and line["step"] == 1 and line["loss"] == float(ref_loss.detach())
    layers = {entry["name"]: entry for entry in line["layers"]}
    assert list(layers) == names
    for n in names:
        entry = layers[n]
        assert entry["calls"] == len(seen[n]) == (4 if n == "shared" else 2), n
        assert entry["output"] == "" and entry["dtype"] == "float32" and entry["shape"] == list(seen[n][0].shape)
        assert_stats(entry["stats"], seen[n])
        assert_stats(entry["grad"], grads[n])
    params = {entry["name"]: entry for entry in line["params"]}
    assert list(params) == [n for n, _ in ref.named_parameters()]
    for n, p in ref.named_parameters():
        entry = params[n]
        assert entry["shape"] == list(p.shape)
        assert_stats(entry["grad"], [pgrads[n]])
        norm = float(before[n].double().norm())
        update = float((p.detach().double() - before[n].double()).norm())
        assert entry["norm"] == pytest.approx(norm, rel=1e-12)
        assert entry["update_norm"] == pytest.approx(update, rel=1e-5)
        assert entry["update_ratio"] == pytest.approx(update / norm, rel=1e-5)


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), shift=st.floats(-50, 50),
       spread=st.floats(1e-2, 1e2), seed=st.integers(0, 2**16))
def test_micro_batches_of_any_sizes_merge_to_the_statistics_of_all_their_values(
        sizes: list[int], shift: float, spread: float, seed: int) -> None:
    """Per (module, output) the step's calls are merged: the statistics of all their values at once,
    whatever the micro-batches' sizes and the data's offset and spread (no optimizer: w.step ends it)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 3, generator=g) * spread + shift for n in sizes]
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    with hookcli.watch(model, layers="0") as w:
        for x in xs:
            out = model[0](x)  # the selected module, called directly: its output is the loss's input
            outs.append(out)
            loss = out.pow(2).sum() / 2
            grads.append(torch.autograd.grad(loss, out, retain_graph=True)[0])
            loss.backward()
        w.step()
    (entry,) = w.last.layers
    assert entry.calls == len(sizes)
    assert_stats(entry.stats, outs)
    assert_stats(entry.grad, grads)
    assert [p.name for p in w.last.params] == ["0.weight", "0.bias"]
    assert all(p.update_norm is None and p.update_ratio is None for p in w.last.params)


# -- nothing changes and nothing stays ---------------------------------------------------------------------------


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, watch: Any = None) -> list[float]:
    losses = []
    for step in range(steps):
        (x, y), = batches(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if watch is not None:
            watch.step(loss=loss)
        losses.append(loss.item())
    return losses


def twin_runs() -> tuple[Net, Net, torch.optim.SGD, torch.optim.SGD]:
    """A seeded ``Net`` in train mode and its copy, each with its own SGD (momentum 0.9): the loop run
    unwatched and the same loop run watched."""
    torch.manual_seed(0)
    plain = Net().train()
    watched = copy.deepcopy(plain)
    return (plain, watched, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(watched.parameters(), lr=0.1, momentum=0.9))


def assert_same_state(plain: nn.Module, watched: nn.Module) -> None:
    """The two models' weights and buffers are equal bit for bit."""
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("call_step", [True, False], ids=["w.step", "optimizer-only"])
def test_a_watched_run_is_the_unwatched_run_bit_for_bit(tmp_path: Path, call_step: bool) -> None:
    """20 steps with dropout and BatchNorm, seeded: the same losses, weights and buffers, and the global
    RNG state after the loop is the same (hookcli draws no random numbers); nothing hooked after."""
    plain, watched, opt_plain, opt_watched = twin_runs()
    torch.manual_seed(1)
    want = train(plain, opt_plain, 20)
    rng_after = torch.get_rng_state()

    torch.manual_seed(1)
    with hookcli.watch(watched, opt_watched, every=3, out=tmp_path / "log.jsonl") as w:
        got = train(watched, opt_watched, 20, w if call_step else None)
    assert got == want
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert_same_state(plain, watched)
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 3, 6, 9, 12, 15, 18]
    # without w.step(loss=): the value backward() was called on, the loop's own loss bit for bit
    assert [line["loss"] for line in lines] == [want[s] for s in range(0, 20, 3)]
    no_hooks_left(watched, opt_watched)


@pytest.mark.parametrize("where", ["forward", "backward", "after optimizer.step"])
def test_no_hook_stays_when_the_loop_raises(tmp_path: Path, where: str) -> None:
    """The loop's own exception goes through unchanged; the finished steps' lines are in the log, each
    complete; no hook is left on the model, its parameters, the optimizer or process-wide."""
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "log.jsonl"

    class Stop(Exception):
        pass

    with pytest.raises(Stop), hookcli.watch(model, opt, every=2, out=log) as w:
        for step in range(6):
            (x, y), = batches(step)
            if step == 5 and where == "forward":
                raise Stop
            loss = nn.functional.mse_loss(model(x), y)
            if step == 5 and where == "backward":
                raise Stop
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 4 and where == "after optimizer.step":
                raise Stop  # step 4 is finished but w.step has not come: its line is written on the way out
            w.step(loss=loss)
    no_hooks_left(model, opt)
    assert [line["step"] for line in read_log(log)] == [0, 2, 4]


def test_a_killed_process_leaves_every_finished_line(tmp_path: Path) -> None:
    """A process killed by SIGKILL in the middle of a step: every line written before is complete."""
    log = tmp_path / "log.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, torch, hookcli
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with hookcli.watch(model, opt, every=2, out={str(log)!r}) as w:
            for step in range(100):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                if step == 7:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward(); opt.step(); opt.zero_grad()
                w.step(loss=loss)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr
    lines = read_log(log)
    assert [line["step"] for line in lines] == [0, 2, 4, 6]
    assert all(len(line["layers"]) == 3 and len(line["params"]) == 4 for line in lines)


def test_pandas_reads_the_log(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "log.jsonl"
    with hookcli.watch(model, opt, every=4, out=log) as w:
        losses = train(model, opt, 10, w)
    frame = pandas.read_json(log, lines=True)
    assert list(frame["step"]) == [0, 4, 8]
    assert list(frame["loss"]) == pytest.approx([losses[0], losses[4], losses[8]], rel=1e-14)  # pandas' float parser
    layers = pandas.json_normalize(frame.to_dict("records"), "layers", ["step"])
    assert len(layers) == 3 * 5 and set(layers["name"]) == {"fc1", "bn", "act", "shared", "head"}
    assert (layers["stats.count"] > 0).all()


# -- what a step is ----------------------------------------------------------------------------------------------


def steps_in(log: Path) -> list[int]:
    return [line["step"] for line in read_log(log)] if log.exists() else []


def test_without_w_step_the_optimizer_ends_steps(tmp_path: Path) -> None:
    """optimizer.step ends each step; the first step's line waits for the next optimizer step (or the
    block's end) to see that no w.step() follows; from then on a line is written at optimizer.step."""
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "log.jsonl"
    written, losses = [], []
    with hookcli.watch(model, opt, every=2, out=log):
        for step in range(5):
            (x, y), = batches(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            written.append(steps_in(log))
            opt.zero_grad()
    assert written == [[], [0], [0, 2], [0, 2], [0, 2, 4]]
    assert steps_in(log) == [0, 2, 4]
    assert all(line["params"][0]["update_norm"] > 0 for line in read_log(log))
    assert [line["loss"] for line in read_log(log)] == [losses[0], losses[2], losses[4]]  # backward()'s, bit for bit


def test_with_w_step_the_line_is_written_at_w_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "log.jsonl"
    after_opt, after_w = [], []
    with hookcli.watch(model, opt, every=2, out=log) as w:
        for step in range(5):
            (x, y), = batches(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            after_opt.append(steps_in(log))
            w.step(loss=loss)
            after_w.append(steps_in(log))
    assert after_opt == [[], [0], [0], [0, 2], [0, 2]]
    assert after_w == [[0], [0], [0, 2], [0, 2], [0, 2, 4]]
    assert all(isinstance(line["loss"], float) for line in read_log(log))


def test_without_an_optimizer_w_step_ends_steps() -> None:
    """optimizer=None: the parameters' .grad and norms as they stand at w.step(); no update norms."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with hookcli.watch(model, every=2) as w:
        for step in range(3):
            x = torch.randn(6, 3)
            loss = model(x).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            w.step()
            if step == 2:
                for entry, (name, p) in zip(w.last.params, model.named_parameters()):
                    assert entry.name == name and entry.update_norm is None and entry.update_ratio is None
                    assert entry.norm == pytest.approx(float(p.detach().double().norm()), rel=1e-12)
                    assert_stats(entry.grad, [p.grad])
            model.zero_grad()
    assert w.last.step == 2 and w.last.loss == loss.item()  # the value backward() was called on
    assert [layer.name for layer in w.last.layers] == ["0", "1", "2"]


class OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op run, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


#: The ops of the first-non-finite-loss flag at an unlogged step's end: isfinite of the loss (decomposed),
#: and ``torch.where`` into the device scalar.
LOSS_FLAG = ["aten.detach", "aten.abs", "aten.ne", "aten.eq", "aten.mul", "aten.all", "aten.logical_not",
             "aten.lt", "aten.bitwise_and", "aten.scalar_tensor", "aten.where", "aten.copy_"]


def test_unlogged_steps_run_exactly_the_unwatched_ops_and_register_no_tensor_hook() -> None:
    """On an unlogged step the watched model runs the very aten ops an unwatched one runs, the loss flag
    aside (no
    statistics, no copy, no transfer), its outputs get no tensor hook and the hook set stays empty; a
    logged step does register them (so the check can fail)."""
    torch.manual_seed(0)
    plain = Net().eval()
    watched = copy.deepcopy(plain)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_watched = torch.optim.SGD(watched.parameters(), lr=0.1)
    outputs: list[torch.Tensor] = []
    watched.fc1.register_forward_hook(lambda _m, _i, out: outputs.append(out))

    def one_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> list[str]:
        (x, y), = batches(step)
        with OpLog() as log:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return log.ops

    with hookcli.watch(watched, opt_watched, every=3) as w:
        hooks = w._watcher.hooks
        for step in range(5):
            want = one_step(plain, opt_plain, step)
            got = one_step(watched, opt_watched, step)
            logged = step % 3 == 0
            assert bool(outputs[-1]._backward_hooks) == logged, step
            if not logged:
                # plus, at the step's end, the loss's device flag (the first non-finite loss) on the 0-d copy
                # of the value backward() was called on, made in both runs (the wrapper is process-wide)
                at = got.index("aten.abs")
                assert got[at - 1:at + len(LOSS_FLAG) - 1] == LOSS_FLAG, step
                assert got[:at - 1] + got[at + len(LOSS_FLAG) - 1:] == want, step
                assert all(size == 0 for size in hooks.session.sizes().values()) and not hooks._accumulated
            else:
                assert got != want  # the statistics ran: the comparison can tell



# -- validation forwards and wrapped models ----------------------------------------------------------------------

VALIDATION_GUARDS = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def loop_with_validation(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, validate: str | None,
                         guard: str = "no_grad", watch: Any = None) -> tuple[list[float], list[float]]:
    """The usual loop; with ``validate``, every 2 steps a validation forward (eval mode, no autograd) at
    the step's start or right after ``optimizer.step()``. Its losses and its validation losses."""
    losses: list[float] = []
    val_losses: list[float] = []

    def validation(step: int) -> None:
        g = torch.Generator().manual_seed(5000 + step)
        xv, yv = torch.randn(7, 6, generator=g), torch.randn(7, 2, generator=g)  # a batch size of its own
        model.eval()
        with VALIDATION_GUARDS[guard]():
            val_losses.append(nn.functional.mse_loss(model(xv), yv).item())
        model.train()

    for step in range(steps):
        if validate == "at the step's start" and step % 2 == 0:
            validation(step)
        (x, y), = batches(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if validate == "after optimizer.step" and step % 2 == 0:
            validation(step)
        opt.zero_grad()
        if watch is not None:
            watch.step(loss=loss)
        losses.append(loss.item())
    return losses, val_losses


@pytest.mark.parametrize("guard", list(VALIDATION_GUARDS))
@pytest.mark.parametrize("where", ["at the step's start", "after optimizer.step"])
def test_validation_forwards_inside_the_loop_are_not_counted(tmp_path: Path, where: str, guard: str) -> None:
    """A loop that validates every 2 steps (``model.eval()``, ``torch.no_grad()`` or inference mode,
    ``model.train()``) logs what the loop without validation logs: each step's calls, outputs and
    gradients are those of its training forward alone (checked against plain torch, ``calls`` exact), the
    lines are those of a watch over the loop without validation; and the watched loop computes bit for
    bit what the unwatched one does (losses, validation losses, weights, buffers, the RNG)."""
    torch.manual_seed(0)
    plain = Net().train()
    ref, watched, bare = copy.deepcopy(plain), copy.deepcopy(plain), copy.deepcopy(plain)
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (plain, ref, watched, bare)]
    names = ["fc1", "bn", "act", "shared", "head"]
    steps = 4

    # plain torch, no validation: each step's outputs, their gradients and the parameters' gradients
    torch.manual_seed(1)
    want_outputs, want_grads, want_pgrads = [], [], []
    for step in range(steps):
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        handles = [getattr(ref, n).register_forward_hook(lambda _m, _i, out, n=n, seen=seen: seen[n].append(out))
                   for n in names]
        (x, y), = batches(step)
        loss = nn.functional.mse_loss(ref(x), y)
        for h in handles:
            h.remove()
        outs = [(n, out) for n in names for out in seen[n]]
        grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for (n, _), g in zip(outs, torch.autograd.grad(loss, [o for _, o in outs], retain_graph=True)):
            grads[n].append(g)
        loss.backward()
        want_pgrads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        opts[1].step()
        opts[1].zero_grad()
        want_outputs.append(seen)
        want_grads.append(grads)

    torch.manual_seed(1)
    want_losses, want_val = loop_with_validation(plain, opts[0], steps, validate=where, guard=guard)
    rng_after = torch.get_rng_state()
    torch.manual_seed(1)
    with hookcli.watch(watched, opts[2], out=tmp_path / "val.jsonl") as w:
        got_losses, got_val = loop_with_validation(watched, opts[2], steps, validate=where, guard=guard, watch=w)
    assert (got_losses, got_val) == (want_losses, want_val) and len(got_val) == 2
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert_same_state(plain, watched)
    no_hooks_left(watched, opts[2])

    lines = read_log(tmp_path / "val.jsonl")
    assert [line["step"] for line in lines] == list(range(steps))
    for step, line in enumerate(lines):
        layers = {entry["name"]: entry for entry in line["layers"]}
        assert list(layers) == names, step
        for n in names:
            assert layers[n]["calls"] == (2 if n == "shared" else 1), (step, n)
            assert layers[n]["shape"] == [5, 2 if n == "head" else 8]  # the training batch's, not validation's 7
            assert_stats(layers[n]["stats"], want_outputs[step][n])
            assert_stats(layers[n]["grad"], want_grads[step][n])
        for entry in line["params"]:
            assert_stats(entry["grad"], [want_pgrads[step][entry["name"]]])

    torch.manual_seed(1)
    with hookcli.watch(bare, opts[3], out=tmp_path / "bare.jsonl") as w:
        loop_with_validation(bare, opts[3], steps, validate=None, watch=w)
    assert lines == read_log(tmp_path / "bare.jsonl")


def test_validation_is_left_out_of_unlogged_steps_and_of_the_flight_recorder(tmp_path: Path) -> None:
    """``every=3`` with ``flight=2``, the loop raising after 5 steps (the ring is written): the loop that
    validates every 2 steps writes the very lines the loop without validation writes, the flight
    recorder's line of the unlogged step 4 (which validated) included."""
    lines = {}
    for validate in (None, "after optimizer.step"):
        torch.manual_seed(0)
        model = Net().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log = tmp_path / f"{validate}.jsonl"
        torch.manual_seed(1)
        with pytest.raises(RuntimeError, match="the loop's own"), \
                hookcli.watch(model, opt, every=3, flight=2, out=log) as w:
            loop_with_validation(model, opt, 5, validate=validate, watch=w)
            raise RuntimeError("the loop's own")
        lines[validate] = read_log(log)
    assert [(line["step"], line.get("flight", False)) for line in lines[None]] == [(0, False), (3, False), (4, True)]
    assert [layer["calls"] for layer in lines[None][-1]["layers"]] == [1, 1, 1, 2, 1]
    assert lines["after optimizer.step"] == lines[None]


class FrozenBackbone(nn.Module):
    """A backbone, run under ``torch.no_grad()`` inside the forward when ``frozen``, then a head."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.frozen = frozen
        self.backbone = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad() if self.frozen else contextlib.nullcontext():
            h = self.backbone(x)
        return self.head(h)


@pytest.mark.parametrize("loop", ["frozen backbone under no_grad", "frozen BatchNorm in eval mode",
                                  "trains with the model in eval mode"])
def test_training_forwards_in_eval_mode_or_without_autograd_are_counted(loop: str) -> None:
    """Only a forward in eval mode *and* without autograd is validation: a frozen backbone run under
    ``torch.no_grad()`` in a model in train mode, a BatchNorm put in eval mode on purpose, and a loop
    that trains with the whole model in eval mode (no dropout) are training, every call counted and
    measured (against the outputs plain forward hooks see)."""
    torch.manual_seed(0)
    model = FrozenBackbone(frozen=loop == "frozen backbone under no_grad").train()
    if loop == "frozen backbone under no_grad":
        model.backbone.requires_grad_(False)
    elif loop == "frozen BatchNorm in eval mode":
        model.backbone[1].eval()
    else:
        model.eval()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    names = ["backbone.0", "backbone.1", "backbone.2", "head"]
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = [model.get_submodule(n).register_forward_hook(lambda _m, _i, out, n=n: seen[n].append(out))
               for n in names]
    with hookcli.watch(model, opt) as w:
        for step in range(2):
            (x, y), = batches(step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            w.step()
    for h in handles:
        h.remove()
    layers = {entry.name: entry for entry in w.last.layers}
    assert list(layers) == names
    for n in names:
        assert layers[n].calls == 1
        assert_stats(layers[n].stats, seen[n][-1:])
    assert layers["head"].grad is not None
    assert (layers["backbone.0"].grad is None) == (loop == "frozen backbone under no_grad")


@pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel runs the module itself only without GPUs")
def test_a_data_parallel_model_is_watched_and_measured_under_its_own_names(tmp_path: Path) -> None:
    """``nn.DataParallel(model)`` (without GPUs it calls the module) is unwrapped as DDP is: the watch's
    layers and parameters are named ``0``, not ``module.0``, and its log is the bare model's, whose
    numbers are plain torch's; ``hookcli.stats`` of it names and measures the layers as the bare model's."""
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    inner = copy.deepcopy(bare)
    wrapped = nn.DataParallel(inner)
    opt_bare = torch.optim.Adam(bare.parameters(), lr=0.05)
    opt_wrapped = torch.optim.Adam(wrapped.parameters(), lr=0.05)
    seen: list[torch.Tensor] = []
    handle = inner[1].register_forward_hook(lambda _m, _i, out: seen.append(out))
    with hookcli.watch(bare, opt_bare, out=tmp_path / "bare.jsonl") as w:
        train(bare, opt_bare, 3, w)
    with hookcli.watch(wrapped, opt_wrapped, out=tmp_path / "dp.jsonl") as w:
        train(wrapped, opt_wrapped, 3, w)
    handle.remove()
    lines = read_log(tmp_path / "dp.jsonl")
    assert [entry["name"] for entry in lines[0]["layers"]] == ["0", "1", "2"]
    assert [entry["name"] for entry in lines[0]["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert lines == read_log(tmp_path / "bare.jsonl")
    assert_stats(lines[-1]["layers"][1]["stats"], seen[-1:])
    no_hooks_left(wrapped, opt_wrapped)

    x = torch.randn(3, 6)
    report = hookcli.stats(nn.DataParallel(bare), inputs=x)
    rows = {row.name: row for row in report.layers}
    assert "module" not in rows and {"0", "1", "2"} <= set(rows)
    want = reference([bare[:2](x)])
    assert rows["1"].stats["mean"] == pytest.approx(want["mean"], rel=1e-6)
    assert rows["1"].stats["max"] == pytest.approx(want["max"], rel=1e-6)


# -- bad input and the log file ----------------------------------------------------------------------------------


LINEAR = nn.Linear(2, 2)


@pytest.mark.parametrize(("args", "kwargs", "words"), [
    (("resnet18",), {}, "nn.Module"),
    ((nn.Linear(2, 2), object()), {}, "torch.optim.Optimizer"),
    ((nn.Linear(2, 2),), {"every": 0}, "every"),
    ((nn.Linear(2, 2),), {"every": 2.5}, "every"),
    ((nn.Linear(2, 2),), {"every": True}, "every"),
    ((nn.Linear(2, 2),), {"layers": "nope"}, "no module named 'nope'"),
    ((nn.Linear(2, 2),), {"out": 123}, "out must be a path"),
    ((LINEAR, [torch.optim.SGD(LINEAR.parameters(), 0.1), torch.optim.Adam(LINEAR.parameters())]), {},
     "takes one optimizer, got a list of 2"),
    ((nn.Linear(2, 2),), {"out": b"runs/exp.jsonl"}, "out must be a path"),
    ((nn.Linear(2, 2),), {"tensorboard_dir": 1}, "tensorboard_dir must be a path"),
])
def test_bad_arguments_are_usage_errors(args: tuple[Any, ...], kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError) as info:
        hookcli.watch(*args, **kwargs)
    assert info.value.exit_code == 2 and words in str(info.value) and info.value.hint
    assert "\n" not in info.value.message


def test_a_loss_that_is_not_one_number_is_a_usage_error_and_the_watch_goes_on() -> None:
    model = nn.Linear(2, 2)
    with hookcli.watch(model) as w:
        out = model(torch.randn(3, 2))
        out.sum().backward()
        with pytest.raises(UsageError, match=r"one-element tensor, got a tensor of shape \[3, 2\]"):
            w.step(loss=out)
        w.step(loss=out.sum())
    assert w.last.step == 0 and w.last.loss == pytest.approx(float(out.sum().detach()), rel=1e-7)
    with pytest.raises(UsageError, match="outside its with block"):
        w.step()
    with pytest.raises(UsageError, match="has run already"):
        w.__enter__()
    no_hooks_left(model, None)


def test_an_unwritable_log_is_refused_before_any_step(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(OutputError, match="it is a directory") as info:
        hookcli.watch(model, out=tmp_path)
    assert info.value.exit_code == 2
    no_hooks_left(model, None)


def test_an_existing_log_keeps_its_lines(tmp_path: Path) -> None:
    """The log is appended to (a resumed run's lines follow the first run's); missing folders are made."""
    log = tmp_path / "runs" / "exp.jsonl"
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _run in range(2):
        with hookcli.watch(model, opt, out=log) as w:
            for _ in range(2):
                model(torch.randn(4, 2)).sum().backward()
                opt.step()
                opt.zero_grad()
                w.step()
    assert steps_in(log) == [0, 1, 0, 1]


def test_layers_choose_the_modules_and_their_parameters() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, opt, layers="fc1,head") as w:
        (x, y), = batches(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert [layer.name for layer in w.last.layers] == ["fc1", "head"]
    assert [p.name for p in w.last.params] == ["fc1.weight", "fc1.bias", "head.weight", "head.bias"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_log_that_fails_mid_run_never_raises_into_optimizer_step() -> None:
    """A write that fails in the optimizer's hook (no space left) stops the log, said once as a
    WatchWarning; the loop trains on with the unwatched run's numbers, the watch's records go on, and
    leaving the block raises nothing (the code after it runs)."""
    plain, watched, opt_plain, opt_watched = twin_runs()
    torch.manual_seed(1)
    want = train(plain, opt_plain, 4)
    torch.manual_seed(1)
    with pytest.warns(WatchWarning) as caught, hookcli.watch(watched, opt_watched, out="/dev/full") as w:
        losses = train(watched, opt_watched, 4)
    assert losses == want and w.last is not None and w.last.step == 3
    (warning,) = [c for c in caught if c.category is WatchWarning]
    assert "stopped writing its log at step 0: cannot write /dev/full: no space left on device" in str(warning.message)
    assert warning.filename == __file__  # the user's line, not hookcli's
    assert_same_state(plain, watched)
    no_hooks_left(watched, opt_watched)


def test_a_logged_step_reaches_the_host_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """hookcli's own host transfer (``to_host``, wrapped to count its calls, still run): once per logged
    step, none on unlogged ones; the first step with a loss from w.step() reads the loss in a second."""
    import hookcli.engine.stats as engine_stats
    import hookcli.engine.watch as engine_watch

    calls: list[int] = []
    real = engine_stats.to_host
    for module in (engine_stats, engine_watch):  # a step's Transfer, and the loss read by w.step()
        monkeypatch.setattr(module, "to_host", lambda vectors: calls.append(len(vectors)) or real(vectors))
    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    with hookcli.watch(model, opt, every=2) as w:
        for step in range(5):
            (x, y), = batches(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
            per_step.append(len(calls))
    assert per_step == [2, 2, 3, 3, 4]
    # the loss rides with the rest (at step 0 the one backward() was called on: w.step's comes after)
    assert calls[1] == 1 and calls[2] == calls[3] == calls[0]


# -- real models -------------------------------------------------------------------------------------------------


def test_resnet18_with_in_place_relus_reused_in_each_block() -> None:
    """torchvision's resnet18: every BasicBlock calls its in-place ReLU twice, so its entry merges two
    calls (the values each call returned, before the next op changed them); every conv, norm and the fc
    are there; parameters' gradients are the .grad before optimizer.step."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    relu = model.layer1[0].relu
    seen: list[torch.Tensor] = []
    handle = relu.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    with hookcli.watch(model, opt) as w:
        nn.functional.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    handle.remove()
    layers = {entry.name: entry for entry in w.last.layers}
    expected = {n for n, m in model.named_modules()
                if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear))}
    assert set(layers) == expected
    assert layers["layer1.0.relu"].calls == 2 and layers["conv1"].calls == 1
    assert_stats(layers["layer1.0.relu"].stats, seen)
    params = {entry.name: entry for entry in w.last.params}
    assert len(params) == len(grads)
    for name in ("conv1.weight", "layer4.1.bn2.bias", "fc.weight"):
        assert_stats(params[name].grad, [grads[name]])
    no_hooks_left(model, opt)


def test_a_tiny_gpt2_built_from_its_config() -> None:
    """transformers' GPT-2 (random weights from a tiny config): its Conv1D layers, norms, embeddings and
    its own activation class (NewGELUActivation) are watched; the loss is the model's own."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (2, 12))
    with hookcli.watch(model, opt, every=2) as w:
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    assert w.last.step == 2 and w.last.loss == pytest.approx(float(loss.detach()), rel=1e-7)
    types = {entry.type for entry in w.last.layers}
    assert {"Embedding", "Conv1D", "LayerNorm", "NewGELUActivation"} <= types
    assert all(entry.grad is not None and entry.grad["count"] > 0 for entry in w.last.layers
               if entry.type in ("Conv1D", "NewGELUActivation"))
    assert all(p.update_norm is not None and p.update_norm > 0 for p in w.last.params)
    no_hooks_left(model, opt)


def test_a_long_watch_keeps_nothing_per_step(tmp_path: Path) -> None:
    """600 steps, every one logged: what the watch holds does not grow with the steps (only the latest
    record is kept; the hook set empties itself at each boundary). Measured over the last 300 steps."""
    import gc
    import tracemalloc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 4)
    with hookcli.watch(model, opt, out=tmp_path / "log.jsonl") as w:
        for step in range(600):
            if step == 250:
                tracemalloc.start()
            if step == 300:
                gc.collect()
                baseline, _ = tracemalloc.get_traced_memory()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - baseline
        tracemalloc.stop()
    # (measured: 12 KB once, torch's dispatch and the first traced steps; keeping every record: 2.6 MB)
    assert grown < 64 * 1024, f"{grown} bytes allocated and kept over the last 300 steps"
    assert w.last.step == 599 and len(read_log(tmp_path / "log.jsonl")) == 600


# -- w.step() in the wrong place: warned once, nothing changed ---------------------------------------------------


def misused_loop(model: nn.Module, opt: torch.optim.Optimizer, order: str, steps: int, watch: Any = None) -> list[float]:
    """``train``'s loop with ``w.step()`` where the docs forbid it: ``before`` optimizer.step(), only in
    odd steps (``some``: the optimizer ended the first steps alone), only every third step (``twice``)."""
    losses = []
    for step in range(steps):
        (x, y), = batches(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if order == "before" and watch is not None:
            watch.step(loss=loss)
        opt.step()
        if watch is not None and (order == "some" and step % 2 or order == "twice" and step % 3 == 0):
            watch.step(loss=loss)
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("order", "every", "words"), [
    ("before", 1, "optimizer.step() ran right after w.step(), with no forward or backward between"),
    ("before", 3, "optimizer.step() ran right after w.step(), with no forward or backward between"),
    ("some", 2, "w.step() was called after optimizer.step() had ended the steps without it"),
    ("twice", 1, "optimizer.step() ran twice without a w.step() between"),
])
def test_w_step_in_the_wrong_place_is_warned_once_and_changes_nothing(order: str, every: int, words: str) -> None:
    """The loop's losses, weights, buffers and RNG are the unwatched loop's, bit for bit; one
    StepOrderWarning, at the user's own line, saying what to do."""
    from hookcli.errors import StepOrderWarning

    plain, watched, opt_plain, opt_watched = twin_runs()
    torch.manual_seed(1)
    want = misused_loop(plain, opt_plain, order, 8)
    rng_after = torch.get_rng_state()
    torch.manual_seed(1)
    with pytest.warns(StepOrderWarning) as caught:
        with hookcli.watch(watched, opt_watched, every=every) as w:
            got = misused_loop(watched, opt_watched, order, 8, w)
    assert got == want and torch.equal(torch.get_rng_state(), rng_after)
    assert_same_state(plain, watched)
    (warning,) = [c for c in caught if c.category is StepOrderWarning]
    message = str(warning.message)
    assert words in message and "call w.step() after optimizer.step(), in every step or in none" in message
    assert warning.filename == __file__  # the user's w.step() line (or with block), not hookcli's
    no_hooks_left(watched, opt_watched)


def test_a_misuse_warning_turned_into_an_error_is_raised_at_w_step_not_in_optimizer_step() -> None:
    """With warnings as errors the warning raises where the user called w.step(), never inside
    optimizer.step() (whose update has then happened in full)."""
    from hookcli.errors import StepOrderWarning

    torch.manual_seed(0)
    model = Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    with warnings_as_errors(StepOrderWarning), hookcli.watch(model, opt) as w:
        for step in range(3):
            (x, y), = batches(step)
            nn.functional.mse_loss(model(x), y).backward()
            calls.append("w.step")
            try:
                w.step()
            except StepOrderWarning:
                calls.append("raised")
                break
            calls.append("optimizer.step")
            before = model.head.weight.detach().clone()
            opt.step()
            assert not torch.equal(before, model.head.weight)  # the update happened
            opt.zero_grad()
    assert calls == ["w.step", "optimizer.step", "w.step", "raised"]


@contextlib.contextmanager
def warnings_as_errors(category: type[Warning]) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", category)
        yield


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("loop", ["w.step after", "optimizer only", "no optimizer", "lbfgs closure", "grad scaler skips"])
def test_the_documented_loops_are_not_warned(loop: str, every: int) -> None:
    """w.step() after optimizer.step() (every=1 and 3), optimizer.step() alone, w.step() without an
    optimizer, LBFGS (its forward and backward run inside optimizer.step()), and a GradScaler that skips
    optimizer.step() at its first steps (w.step() with no optimizer step before it: not a misuse)."""
    from hookcli.errors import StepOrderWarning

    torch.manual_seed(0)
    model = Net().train()
    opt = (torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2) if loop == "lbfgs closure"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # the first steps overflow (CPU, float32)
    skipped = []
    with warnings_as_errors(StepOrderWarning), \
            hookcli.watch(model, None if loop == "no optimizer" else opt, every=every) as w:
        for step in range(7):
            (x, y), = batches(step)
            if loop == "lbfgs closure":
                def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss
                opt.step(closure)
                w.step()
                continue
            loss = nn.functional.mse_loss(model(x), y)
            if loop == "grad scaler skips":
                scaler.scale(loss * 8).backward()
                before = model.head.weight.detach().clone()
                scaler.step(opt)
                scaler.update()
                skipped.append(torch.equal(before, model.head.weight))
            else:
                loss.backward()
                if loop != "no optimizer":
                    opt.step()
            if loop != "optimizer only":
                w.step(loss=loss)
            opt.zero_grad()
    if loop == "grad scaler skips":
        assert skipped[0] and not skipped[-1]  # some steps skipped, later ones stepped


def test_a_selected_branch_that_does_not_run_in_a_step_is_not_a_misuse() -> None:
    """The watched module (``layers="aux"``) runs only in odd steps and the gradients are zeroed, not
    freed: at the even steps' optimizer.step() nothing watched has run, and none runs after it either,
    so nothing is warned (w.step() after optimizer.step(), as documented)."""
    from hookcli.errors import StepOrderWarning

    torch.manual_seed(0)
    trunk, aux = nn.Linear(6, 2), nn.Linear(6, 2)
    model = nn.ModuleDict({"trunk": trunk, "aux": aux})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings_as_errors(StepOrderWarning), hookcli.watch(model, opt, layers="aux") as w:
        for step in range(6):
            (x, y), = batches(step)
            out = trunk(x) + (aux(x) if step % 2 else 0)
            nn.functional.mse_loss(out, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            w.step()
    assert w.last is not None and w.last.step == 5 and [layer.name for layer in w.last.layers] == ["aux"]


@pytest.mark.parametrize("every", [1, 2])
def test_a_closure_step_logs_the_gradients_it_applied(every: int) -> None:
    """optimizer.step(closure) with the forward and backward inside the closure (Lightning's automatic
    optimisation does so for every optimizer; LBFGS): the parameters' gradients on a logged step are those
    the closure made and the step applied, as torch.autograd.grad gives them at the pre-step weights
    (were null: 'no backward of the step reached it'), and a head left out of the optimizer is frozen
    saying it has a gradient (was: 'no gradient reached it'). The loop's numbers are unchanged."""

    def run(watch: bool) -> tuple[list[float], list[dict[str, float]], Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)  # the bug: model[2] is left out
        losses, norms = [], []
        with hookcli.watch(model, opt, every=every) if watch else contextlib.nullcontext() as w:
            for step in range(6):
                (x, y), = batches(step)
                expected = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
                norms.append({name: float(g.norm()) for (name, _), g in zip(model.named_parameters(), expected)})

                def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    opt.zero_grad()
                    model[2].zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                losses.append(float(opt.step(closure).detach()))
                if watch:
                    w.step()
                    if step % every == 0:
                        assert w.last is not None and w.last.step == step
                        for p in w.last.params:
                            assert p.grad is not None
                            got = p.grad["rms"] * math.sqrt(p.grad["count"])
                            assert got == pytest.approx(norms[-1][p.name], rel=1e-5, abs=1e-12)
        return losses, norms, w

    plain, plain_norms, _ = run(False)
    watched, watched_norms, w = run(True)
    assert watched == plain and watched_norms == plain_norms
    frozen = [f for f in w.findings if f.rule == "frozen"]
    assert {f.layer for f in frozen} == {"2.weight", "2.bias"}
    assert all("it has a gradient" in f.message for f in frozen)


class _FreeingSGD(torch.optim.SGD):
    """SGD that frees each gradient once its step has applied it, as memory-saving optimizers do."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        return loss


@pytest.mark.parametrize("optimizer", ["sgd", "frees its gradients"])
def test_an_accumulated_step_whose_closure_runs_the_last_micro_batch_logs_the_summed_gradient(optimizer: str) -> None:
    """Gradient accumulation with the last micro-batch's backward inside the closure of optimizer.step()
    (Lightning's automatic optimisation under accumulate_grad_batches): the logged gradient is the sum over
    every micro-batch (torch.autograd.grad of the summed losses at the step's weights, float64), not the
    earlier micro-batches' seen at the pre-step; read when the closure returns, so an optimizer that frees
    .grad in its step changes nothing. The loop's numbers are those of the unwatched loop."""

    def run(watch: bool) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = (_FreeingSGD if optimizer != "sgd" else torch.optim.SGD)(model.parameters(), lr=0.1, momentum=0.9)
        losses: list[float] = []
        with hookcli.watch(model, opt, every=1) if watch else contextlib.nullcontext() as w:
            for step in range(4):
                (x0, y0), (x1, y1) = batches(step, micro=2)
                reference_model = copy.deepcopy(model).double()
                total = sum(nn.functional.mse_loss(reference_model(x.double()), y.double()) / 2
                            for x, y in ((x0, y0), (x1, y1)))
                expected = dict(zip([n for n, _ in model.named_parameters()],
                                    torch.autograd.grad(total, list(reference_model.parameters()))))
                (nn.functional.mse_loss(model(x0), y0) / 2).backward()

                def closure(x: torch.Tensor = x1, y: torch.Tensor = y1) -> torch.Tensor:
                    loss = nn.functional.mse_loss(model(x), y) / 2
                    loss.backward()
                    return loss

                losses.append(float(opt.step(closure).detach()))
                opt.zero_grad()
                if watch:
                    w.step()
                    assert w.last is not None and w.last.step == step
                    for p in w.last.params:
                        want = expected[p.name]
                        assert p.grad is not None and p.grad["count"] == want.numel()
                        assert p.grad["rms"] == pytest.approx(float(want.pow(2).mean().sqrt()), rel=1e-5)
                        assert p.grad["max"] == pytest.approx(float(want.max()), rel=1e-5, abs=1e-7)
        return losses, model, opt

    plain, plain_model, _ = run(False)
    watched, watched_model, opt = run(True)
    assert watched == plain
    assert_same_state(plain_model, watched_model)
    no_hooks_left(watched_model, opt)


def test_w_step_at_the_top_of_the_loop_is_warned_once() -> None:
    """``w.step()`` first in each iteration (before the forward) ends an empty step 0 and makes every
    logged line hold the step before its number: warned once as a StepOrderWarning at that line (it was
    silent), the loop's losses and weights bitwise those of a run without the watch."""
    from hookcli.errors import StepOrderWarning

    def run(watch: bool) -> tuple[list[float], torch.Tensor, Any, list[warnings.WarningMessage]]:
        torch.manual_seed(0)
        model = Net().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with hookcli.watch(model, opt, every=2) if watch else contextlib.nullcontext() as w:
                for step in range(5):
                    if watch:
                        w.step()
                    (x, y), = batches(step)
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
        return losses, model.head.weight.detach().clone(), w, [s for s in seen if s.category is StepOrderWarning]

    plain, plain_weight, _, _ = run(False)
    watched, weight, w, warned = run(True)
    assert watched == plain and torch.equal(weight, plain_weight)
    (warning,) = warned
    assert "w.step() ended step 0 before anything of it ran" in str(warning.message)
    assert warning.filename == __file__
